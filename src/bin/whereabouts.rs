//! The CNI IPAM plugin binary (`"ipam": {"type": "whereabouts"}`): see [`whereabouts::cni::plugin`].

fn main() -> std::process::ExitCode {
    whereabouts::cni::run()
}
