//! The pure IPAM core: range arithmetic, object naming and the choice of address.
//!
//! Nothing here performs I/O or knows about Kubernetes; the CNI plugin, the operator, the webhook
//! and the metrics all build on these types, so every rule about which address may be handed out
//! lives in one place and is tested without a cluster.

pub mod addr;
pub mod naming;
pub mod range;
pub mod slices;

pub use addr::Family;
pub use range::{AddrRange, Bound, RangeError};
