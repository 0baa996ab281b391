//! Typed reads of an `ipam` object's keys, each wrong type recorded as a problem.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value};

use crate::config::problem::Problem;

/// Typed access to the keys of one JSON object, recording a problem for every wrong type. Empty
/// strings and nulls read as absent, as Go's zero values do upstream.
pub(super) struct Reader<'a> {
    pub(super) obj: &'a Map<String, Value>,
    pub(super) prefix: &'a str,
    pub(super) errors: Vec<Problem>,
}

impl<'a> Reader<'a> {
    pub(super) fn path(&self, key: &str) -> String {
        format!("{}.{key}", self.prefix)
    }

    pub(super) fn wrong_type(&mut self, key: &str, v: &Value, expected: &str) {
        let path = self.path(key);
        self.errors.push(Problem::with_value(
            path,
            shown(v),
            format!("must be {expected}"),
        ));
    }

    pub(super) fn string(&mut self, key: &str) -> Option<&'a str> {
        match self.obj.get(key)? {
            Value::Null => None,
            Value::String(s) if s.is_empty() => None,
            Value::String(s) => Some(s),
            v => {
                self.wrong_type(key, v, "a string");
                None
            }
        }
    }

    pub(super) fn bool(&mut self, key: &str) -> Option<bool> {
        match self.obj.get(key)? {
            Value::Null => None,
            Value::Bool(b) => Some(*b),
            v => {
                self.wrong_type(key, v, "true or false");
                None
            }
        }
    }

    pub(super) fn array(&mut self, key: &str) -> &'a [Value] {
        match self.obj.get(key) {
            None | Some(Value::Null) => &[],
            Some(Value::Array(a)) => a,
            Some(v) => {
                self.wrong_type(key, v, "a list");
                &[]
            }
        }
    }

    pub(super) fn object(&mut self, key: &str) -> Option<&'a Map<String, Value>> {
        match self.obj.get(key)? {
            Value::Null => None,
            Value::Object(o) => Some(o),
            v => {
                self.wrong_type(key, v, "an object");
                None
            }
        }
    }

    pub(super) fn ip(&mut self, key: &str) -> Option<IpAddr> {
        let text = self.string(key)?;
        let parsed = parse_ip(text);
        if parsed.is_none() {
            let path = self.path(key);
            self.errors
                .push(Problem::with_value(path, text, "is not an IP address"));
        }
        parsed
    }

    /// A nested reader for an element such as `ipRanges[1]`.
    pub(super) fn nested(&self, obj: &'a Map<String, Value>, prefix: &'a str) -> Reader<'a> {
        Reader {
            obj,
            prefix,
            errors: Vec::new(),
        }
    }
}

/// A value as a problem shows it: a string's text (quoted once, by the problem), else its JSON.
pub(super) fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(super) fn parse_ip(text: &str) -> Option<IpAddr> {
    text.trim().parse().ok()
}

/// A CIDR, or a bare IP meaning a single address.
pub(super) fn parse_cidr_or_ip(text: &str) -> Option<IpNet> {
    let t = text.trim();
    t.parse::<IpNet>()
        .ok()
        .or_else(|| t.parse::<IpAddr>().ok().map(IpNet::from))
}
