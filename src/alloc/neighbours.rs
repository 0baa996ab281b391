//! What this process's writer turns saw of other nodes: whether every other claim a turn recorded
//! on its pool was made by this node. The plain plugin reports it to its node's bound
//! (`cni::slots`), which lets a node that bursts alone on its pools take more plugin processes at
//! once, and keeps every node narrow as soon as one sees another node's claim on a pool it writes.
//!
//! A process-wide note, not a field of the engine: a plugin process runs one request, and only it
//! reads the note once that request is done. (The agent and the operator write it and never read
//! it.)

use std::sync::atomic::{AtomicU8, Ordering};

/// What the turns of this process saw, the most crowded first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Neighbours {
    /// No turn recorded other claims (or none ran).
    Unknown = 0,
    /// Every other claim recorded was this node's own.
    Alone = 1,
    /// A claim of another node, or of no node (upstream's, or a node not named), was among them.
    Crowded = 2,
}

static SEEN: AtomicU8 = AtomicU8::new(Neighbours::Unknown as u8);

/// Notes one turn's write: the node of the writer's own entry, and those of the other claims it
/// recorded. One sighting of another node makes the whole process's note crowded.
pub fn note<'a>(own: &str, others: impl IntoIterator<Item = &'a str>) {
    SEEN.fetch_max(judge(own, others) as u8, Ordering::Relaxed);
}

/// What one turn's write saw.
fn judge<'a>(own: &str, others: impl IntoIterator<Item = &'a str>) -> Neighbours {
    if own.is_empty() || others.into_iter().any(|node| node != own) {
        Neighbours::Crowded
    } else {
        Neighbours::Alone
    }
}

/// What the turns of this process saw so far.
pub fn seen() -> Neighbours {
    match SEEN.load(Ordering::Relaxed) {
        0 => Neighbours::Unknown,
        1 => Neighbours::Alone,
        _ => Neighbours::Crowded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_nodes_claim_or_one_of_no_node_is_a_crowd() {
        assert_eq!(judge("a", ["a", "a"]), Neighbours::Alone);
        assert_eq!(judge("a", []), Neighbours::Alone);
        assert_eq!(judge("a", ["a", "b"]), Neighbours::Crowded);
        assert_eq!(judge("a", ["a", ""]), Neighbours::Crowded, "upstream's");
        assert_eq!(judge("", ["", ""]), Neighbours::Crowded, "a node not named");
        // The most crowded sighting wins (`note` keeps the maximum).
        assert!(Neighbours::Crowded > Neighbours::Alone && Neighbours::Alone > Neighbours::Unknown);
    }
}
