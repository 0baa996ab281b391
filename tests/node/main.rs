//! The node tier: the product as users run it, on a real node of this machine (e2e/node.sh:
//! kubelet, containerd and runc, kube-proxy, kube-scheduler), installed from the image built here
//! with `kubectl apply -k` as the README says. Pods' eth0 (dual-stack: an IPv4 and an IPv6 address)
//! and net1 come from our plugin through the real runtime.
//!
//! Run with `make node` (e2e/run-node-tests.sh), as root. The tests share one node and disturb it
//! (they stop the kubelet, restart containerd, roll the DaemonSet), so they run one at a time.

// The e2e tier's kubectl and polling helpers; the rest of it is for that tier.
#[allow(dead_code)]
#[path = "../e2e/harness.rs"]
mod harness;

mod addresses;
mod cluster;
mod faults;
mod install;
mod lifecycle;
mod migration;
mod multus;
mod multus_thick;
mod reinstall;
mod workloads;
