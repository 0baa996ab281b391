//! Two dangers of a migration from upstream whereabouts, said loudly: a CRD that prunes our
//! fields ([`schema`]), and upstream's own components still running next to ours ([`upstream`]).
//!
//! The checks themselves, pure: what an installed CRD lacks, and whether a pod template is
//! upstream's.

pub mod schema;
pub mod upstream;

#[cfg(test)]
mod tests;
