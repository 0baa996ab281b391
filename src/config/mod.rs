//! Configuration: parsing network configs and NADs, the flat-file merge, and the one validator.

pub mod flat;
pub mod ipam;
pub mod netconf;
pub mod problem;
pub mod trust;

pub use ipam::{
    DEFAULT_AGENT_SOCKET, IpamConfig, NodeSlice, PluginSlots, RangeConfig, Source, StaticAddress,
    Validated, kept_in_slices_problem, node_slice_base, node_slice_pool_problem,
    result_shape_problem, validate_ipam,
};
pub use netconf::NetConf;
pub use problem::Problem;
