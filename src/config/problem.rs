//! A problem found in a configuration: where it is, the offending value, and what is wrong.

use std::fmt;

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// JSON path inside the network configuration, for example `ipam.ipRanges[1].range_start`.
    pub path: String,
    /// The value as the user wrote it, when there is one to show.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// What is wrong, phrased to follow the value: `is outside range 10.0.0.0/24`.
    pub reason: String,
}

impl Problem {
    pub fn new(path: impl Into<String>, value: Option<String>, reason: impl Into<String>) -> Self {
        Problem {
            path: path.into(),
            value,
            reason: reason.into(),
        }
    }

    pub fn with_value(
        path: impl Into<String>,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Problem::new(path, Some(value.to_string()), reason)
    }

    pub fn at(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Problem::new(path, None, reason)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            Some(v) => write!(f, "{} {:?} {}", self.path, v, self.reason),
            None => write!(f, "{} {}", self.path, self.reason),
        }
    }
}

/// Joins problems into one message, the form used by CNI errors and admission denials.
pub fn join(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(Problem::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}
