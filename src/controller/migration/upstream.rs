//! Upstream whereabouts' own components, by the exact names its manifests give them.
//!
//! Each is read by name (no list of every DaemonSet in the cluster: the operator's Role names
//! exactly these objects) and counts as upstream's only when its pod template runs upstream's
//! programs or image, so an object of ours that someone named the same never matches.

use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde::{Deserialize, Serialize};

/// Upstream's manifests and its chart (`namespaceOverride`) put everything in kube-system.
pub const NAMESPACE: &str = "kube-system";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Kind {
    DaemonSet,
    Deployment,
    CronJob,
}

impl Kind {
    /// As kubectl names the resource (`kubectl delete daemonset ...`).
    pub fn resource(self) -> &'static str {
        match self {
            Kind::DaemonSet => "daemonset",
            Kind::Deployment => "deployment",
            Kind::CronJob => "cronjob",
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.resource())
    }
}

/// One of upstream's objects: where it comes from and what it does to an install of ours.
#[derive(Debug)]
pub struct Known {
    pub kind: Kind,
    pub name: &'static str,
    /// Where upstream defines it.
    pub source: &'static str,
    pub harm: &'static str,
}

const NODE_HARM: &str = "its install-cni.sh copies upstream's plugin, flat file and kubeconfig \
     over ours on every node when its pod restarts, and its ip-control-loop runs upstream's \
     reconciler, which frees sticky and claimed addresses it does not understand";
const SLICES_HARM: &str = "it assigns the same NodeSlicePools as our operator: it frees a \
     departed node's slice at once, addresses in use and all, and re-slices every node when a \
     range or slice size changes";
const RECONCILER_HARM: &str =
    "its ip-reconciler frees sticky and claimed addresses it does not understand";

/// Every object of upstream's the operator looks for, in the order it reads them. The chart's
/// names are those of the release `whereabouts` that upstream's README installs
/// (`<release>-whereabouts-chart`); a release of another name is not found.
pub const KNOWN: [Known; 5] = [
    Known {
        kind: Kind::DaemonSet,
        name: "whereabouts",
        source: "upstream's doc/crds/daemonset-install.yaml",
        harm: NODE_HARM,
    },
    Known {
        kind: Kind::DaemonSet,
        name: "whereabouts-whereabouts-chart",
        source: "upstream's Helm chart, release whereabouts",
        harm: NODE_HARM,
    },
    Known {
        kind: Kind::Deployment,
        name: "whereabouts-controller",
        source: "upstream's doc/crds/node-slice-controller.yaml",
        harm: SLICES_HARM,
    },
    Known {
        kind: Kind::Deployment,
        name: "whereabouts-whereabouts-chart-controller",
        source: "upstream's Helm chart, release whereabouts",
        harm: SLICES_HARM,
    },
    Known {
        kind: Kind::CronJob,
        name: "ip-reconciler",
        source: "upstream's doc/crds/ip-reconciler-job.yaml, from releases before ip-control-loop",
        harm: RECONCILER_HARM,
    },
];

/// The known object of that kind and name.
pub fn known(kind: Kind, name: &str) -> Option<&'static Known> {
    KNOWN.iter().find(|k| k.kind == kind && k.name == name)
}

/// Programs of upstream's image that only upstream runs (its Dockerfile copies them to `/`).
const UPSTREAM_PROGRAMS: [&str; 5] = [
    "ip-control-loop",
    "node-slice-controller",
    "ip-reconciler",
    "install-cni.sh",
    "token-watcher.sh",
];

/// Upstream's image repository (`ghcr.io/k8snetworkplumbingwg/whereabouts`), also when mirrored.
const UPSTREAM_IMAGE: &str = "k8snetworkplumbingwg/whereabouts";

/// Ours: every container of our images runs this binary.
const OUR_PROGRAM: &str = "whereabouts-operator";

/// Why a pod template is upstream's (`container whereabouts runs /ip-control-loop`), or `None`
/// when it is not, or is ours.
pub fn evidence(spec: &PodSpec) -> Option<String> {
    let containers: Vec<&Container> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .collect();
    if containers
        .iter()
        .any(|c| words(c).any(|w| program(w) == OUR_PROGRAM))
    {
        return None;
    }
    // The most telling program first: ip-control-loop rather than the installer before it.
    let runs = UPSTREAM_PROGRAMS.iter().find_map(|name| {
        containers.iter().find_map(|c| {
            let word = words(c).find(|w| program(w) == *name)?;
            Some(format!("container {} runs {word}", c.name))
        })
    });
    runs.or_else(|| {
        containers.iter().find_map(|c| {
            let image = c.image.as_deref()?;
            (repository(image).ends_with(UPSTREAM_IMAGE))
                .then(|| format!("container {} runs image {image}", c.name))
        })
    })
}

/// The words of a container's command and arguments (upstream's DaemonSet runs its programs
/// from a shell script in `args`).
fn words(c: &Container) -> impl Iterator<Item = &str> {
    c.command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .flat_map(|s| s.split_whitespace())
}

/// The program a word names (`/ip-control-loop` -> `ip-control-loop`).
fn program(word: &str) -> &str {
    word.rsplit('/').next().unwrap_or(word)
}

/// An image reference without its tag and digest.
fn repository(image: &str) -> &str {
    let image = image.split('@').next().unwrap_or(image);
    match image.rfind(':') {
        // A colon after the last slash is the tag's; one before it, a registry's port.
        Some(colon) if colon > image.rfind('/').unwrap_or(0) => &image[..colon],
        _ => image,
    }
}
