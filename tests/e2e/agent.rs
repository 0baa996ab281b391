//! The node agent (`whereabouts-operator agent`) and the plugin handing it requests, against the
//! real API server.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{Cni, Ns, signal};

/// The kubeconfig path the plugin is configured with in these tests: it does not exist, so an
/// ADD that succeeds was run by the agent (which has its own client), not by the plugin.
const SERVED: &str = "/nonexistent/whereabouts-e2e/agent.kubeconfig";

pub struct Agent {
    pub child: Child,
    pub socket: PathBuf,
    log: PathBuf,
}

impl Agent {
    /// Starts an agent for `ns` (its own client on the namespace's kubeconfig) serving plugin
    /// configs whose kubeconfig is `serves`.
    fn start(ns: &Ns, dir: &Path, serves: &str) -> Agent {
        Agent::start_with(&ns.kubeconfig, dir, serves)
    }

    /// Starts an agent whose own client uses `kubeconfig`.
    pub fn start_with(kubeconfig: &Path, dir: &Path, serves: &str) -> Agent {
        let socket = dir.join("agent.sock");
        let log = dir.join("agent.log");
        let child = Command::new(env!("CARGO_BIN_EXE_whereabouts-operator"))
            .arg("agent")
            .arg("--socket")
            .arg(&socket)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--serves-kubeconfig")
            .arg(serves)
            // Any free port: tests run agents side by side (and a node's agent may hold 9437).
            .arg("--admin-addr=127.0.0.1:0")
            .env("RUST_LOG", "info,whereabouts=debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the agent");
        let mut agent = Agent { child, socket, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        // Not the socket file: a killed agent's may still be there until this one replaces it.
        while !agent.log().contains("node agent listening") {
            if let Some(status) = agent.child.try_wait().unwrap() {
                panic!("agent exited with {status}: {}", agent.log());
            }
            assert!(Instant::now() < deadline, "no socket: {}", agent.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        agent
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The agent's established TCP connections (to the API server), from `ss`.
    fn connections(&self) -> usize {
        let out = Command::new("ss")
            .args(["-Htnp", "state", "established"])
            .output()
            .expect("ss (iproute2)");
        let pid = format!("pid={},", self.child.id());
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(&pid))
            .count()
    }

    pub fn served(&self) -> usize {
        self.log().matches(" served ").count()
    }

    /// One raw request on the socket, the answer as JSON.
    fn raw(&self, body: &[u8]) -> Value {
        let mut s = UnixStream::connect(&self.socket).unwrap();
        // The agent stops reading an oversized request and answers: the rest may not go out.
        if s.write_all(body).is_ok() {
            s.shutdown(std::net::Shutdown::Write).unwrap();
        }
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A network config whose flat file names the agent's socket and `kubeconfig`.
fn netconf(ns: &Ns, dir: &Path, ipam: Value, kubeconfig: &str, socket: &Path) -> Value {
    let flat = dir.join("whereabouts.conf");
    let text = json!({"kubernetes": {"kubeconfig": kubeconfig}, "agent_socket": socket});
    std::fs::write(&flat, text.to_string()).unwrap();
    let mut conf = ns.netconf("1.0.0", ipam);
    conf["ipam"]["configuration_path"] = flat.to_str().unwrap().into();
    conf
}

#[test]
fn the_agent_serves_concurrent_adds_dual_stack_and_dels() {
    let ns = Ns::new("agent");
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(&ns, dir.path(), SERVED);
    let conf = netconf(
        &ns,
        dir.path(),
        json!({"range": "10.40.0.0/24"}),
        SERVED,
        &agent.socket,
    );
    let mut seen = BTreeSet::new();
    for r in ns.cni_pods("ADD", &conf, 0..100) {
        assert!(seen.insert(r.addresses()[0].clone()), "duplicate address");
    }
    assert_eq!(seen.len(), 100);
    assert_eq!(ns.allocations("10.40.0.0-24").len(), 100);
    assert_eq!(ns.reservations().len(), 100);
    assert_eq!(agent.served(), 100, "{}", agent.log());
    // HTTP/2: the whole burst went over one connection.
    assert_eq!(agent.connections(), 1, "connections of the agent");
    assert!(agent.log().contains("group allocated"), "{}", agent.log());

    // The design discussion's dual-stack config, through the agent: the same addresses as direct.
    let dual = netconf(
        &ns,
        dir.path(),
        json!({"ipRanges": [{"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"}, {"range": "2001::1/64", "range_start": "2001::16", "range_end": "2001::64"}]}),
        SERVED,
        &agent.socket,
    );
    let r = ns.cni("ADD", &dual, "d1", "net1", "dual1", "u1");
    assert_eq!(r.addresses(), ["10.10.10.20/24", "2001::16/64"]);
    let again = ns.cni("ADD", &dual, "d1", "net1", "dual1", "u1");
    assert_eq!(
        again.addresses(),
        r.addresses(),
        "idempotent through the agent"
    );
    assert!(ns.cni("DEL", &dual, "d1", "net1", "dual1", "u1").ok);
    assert!(ns.allocations("2001---64").is_empty());

    // Invalid config is refused with the same CNI error as without an agent.
    let bad = netconf(
        &ns,
        dir.path(),
        json!({"range": "10.40.0.0/24", "range_start": "10.99.0.1"}),
        SERVED,
        &agent.socket,
    );
    let r = ns.cni("ADD", &bad, "b1", "net1", "bad1", "u1");
    assert!(!r.ok);
    assert_eq!(r.stdout["code"], 7, "{}", r.stdout);
    assert!(
        r.stdout["msg"].as_str().unwrap().contains("10.99.0.1"),
        "{}",
        r.stdout
    );

    for r in ns.cni_pods("DEL", &conf, 0..100) {
        assert!(r.ok, "{:?}", r);
    }
    assert!(ns.allocations("10.40.0.0-24").is_empty());
    assert!(ns.reservations().is_empty());
    assert!(agent.log().contains("group released"), "{}", agent.log());
}

/// Without an agent to take it (none listening, one killed, one serving another kubeconfig), the
/// plugin runs the request itself.
#[test]
fn without_an_agent_the_plugin_runs_the_request_itself() {
    let ns = Ns::new("agentless");
    let dir = tempfile::tempdir().unwrap();
    let own = ns.kubeconfig.to_str().unwrap().to_owned();
    let socket = dir.path().join("agent.sock");
    let mut ipam = json!({"range": "10.41.0.0/24", "log_level": "debug"});
    let conf = netconf(&ns, dir.path(), ipam.clone(), &own, &socket);
    assert_eq!(
        ns.cni("ADD", &conf, "c0", "net1", "pod0", "u0").addresses(),
        ["10.41.0.1/24"],
        "no socket at all"
    );

    // An agent serving another kubeconfig hands the request back.
    let mut agent = Agent::start(&ns, dir.path(), SERVED);
    let r = ns.cni("ADD", &conf, "c1", "net1", "pod1", "u1");
    assert_eq!(r.addresses(), ["10.41.0.2/24"]);
    assert!(r.stderr.contains("handed the request back"), "{}", r.stderr);
    assert!(r.stderr.contains("is not the one this agent serves"));
    assert_eq!(agent.served(), 0);

    // A killed agent leaves its socket file behind; nobody answers it.
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    assert!(socket.exists());
    let r = ns.cni("ADD", &conf, "c2", "net1", "pod2", "u2");
    assert_eq!(r.addresses(), ["10.41.0.3/24"], "{}", r.stderr);

    // `agent_socket` in the network config is ignored (root's plugin takes it from the node's
    // flat file only), and "" there turns the agent off: a live agent serving this kubeconfig
    // gets nothing.
    let other = tempfile::tempdir().unwrap();
    let live = Agent::start(&ns, other.path(), &own);
    ipam["agent_socket"] = live.socket.to_str().unwrap().into();
    let flat = dir.path().join("off.conf");
    std::fs::write(
        &flat,
        json!({"kubernetes": {"kubeconfig": own}, "agent_socket": ""}).to_string(),
    )
    .unwrap();
    let mut off = ns.netconf("1.0.0", ipam);
    off["ipam"]["configuration_path"] = flat.to_str().unwrap().into();
    let r = ns.cni("ADD", &off, "c3", "net1", "pod3", "u3");
    assert_eq!(r.addresses(), ["10.41.0.4/24"]);
    assert!(
        r.stderr
            .contains("ipam.agent_socket is node configuration, read from the flat file only"),
        "{}",
        r.stderr
    );
    assert_eq!(live.served(), 0, "{}", live.log());
}

/// An agent serving `range` for `ns`, and a burst of 100 ADDs through it, returned right after
/// the agent's first answer, while the rest are queued or in a group: the agent, the plugin's
/// kubeconfig (the one the agent serves), the network config and the plugin processes.
fn burst_in_flight(ns: &Ns, dir: &Path, range: &str) -> (Agent, String, Value, Vec<Child>) {
    let own = ns.kubeconfig.to_str().unwrap().to_owned();
    let agent = Agent::start(ns, dir, &own);
    let conf = netconf(ns, dir, json!({"range": range}), &own, &agent.socket);
    let children = ns.cni_spawn_pods("ADD", &conf, 0..100);
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent.served() == 0 {
        assert!(Instant::now() < deadline, "{}", agent.log());
        std::thread::sleep(Duration::from_millis(2));
    }
    (agent, own, conf, children)
}

/// The pods (by index) whose ADD failed; each failure must be retryable (code 11).
fn failed_adds(children: Vec<Child>) -> Vec<usize> {
    let mut failed = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let r = Cni::from(c.wait_with_output().unwrap());
        if !r.ok {
            assert_eq!(r.stdout["code"], 11, "retryable: {}", r.stdout);
            failed.push(i);
        }
    }
    failed
}

/// Retries every `failed` ADD as runtimes do (DEL of the failed sandbox, then a new sandbox, a
/// new container id, and its ADD), then checks that each of the 120 pods holds exactly one
/// entry of `pool`, none twice, and that no claim is left over.
fn retry_then_one_address_per_pod(ns: &Ns, conf: &Value, failed: &[usize], pool: &str) {
    for i in failed {
        let (pod, uid) = (format!("pod{i}"), format!("uid-pod{i}"));
        let r = ns.cni("DEL", conf, &format!("c{i}"), "net1", &pod, &uid);
        assert!(r.ok, "{:?}", r);
        let r = ns.cni("ADD", conf, &format!("c{i}-retry"), "net1", &pod, &uid);
        assert!(r.ok, "{:?}", r);
    }
    let pool = ns.allocations(pool);
    let pods: BTreeSet<String> = pool.values().map(|e| e["podref"].to_string()).collect();
    assert_eq!(pool.len(), 120, "one entry per pod: {pool:?}");
    assert_eq!(pods.len(), 120);
    let reservations = ns.reservations();
    assert_eq!(
        reservations.len(),
        120,
        "no claim left over: {reservations:?}"
    );
}

/// Killing the agent while ADDs are in its hands: the plugins cut off report a retryable error,
/// and their retries (the runtime's: DEL, then a new sandbox's ADD, here run after the agent is
/// gone) finish with every pod holding exactly one address, none twice, no claim left over: the
/// DEL withdraws a claim its cut-off ADD made and did not record. Two kills: one at a random point
/// of a burst of 100 (mid-group: claims made, pool not yet written, or written and not answered),
/// and one of a stopped agent holding 20 requests it has not started, so that the test always
/// cuts off some.
#[test]
fn an_agent_killed_mid_burst_leaves_no_duplicate() {
    let ns = Ns::new("agentkill");
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, own, conf, mut children) = burst_in_flight(&ns, dir.path(), "10.42.0.0/24");
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();

    let mut stopped = Agent::start(&ns, dir.path(), &own);
    signal(stopped.child.id(), "-STOP");
    children.extend(ns.cni_spawn_pods("ADD", &conf, 100..120));
    std::thread::sleep(Duration::from_millis(500));
    stopped.child.kill().unwrap();
    stopped.child.wait().unwrap();

    let failed = failed_adds(children);
    assert!(
        failed.len() >= 20,
        "the stopped agent's 20 ADDs failed: {failed:?}"
    );
    // The agent is gone: the plugin runs the retries itself.
    retry_then_one_address_per_pod(&ns, &conf, &failed, "10.42.0.0-24");
    eprintln!("{} of 120 ADDs were cut off by the kills", failed.len());
}

/// SIGTERM while ADDs are in the agent's hands (a DaemonSet rolling update): the agent finishes
/// them and hands back what arrives meanwhile, removes its socket only after that (so that no
/// request runs in a plugin beside work still in the agent), and exits 0. Every ADD succeeds or
/// asks to be retried; after the retries every pod holds one address, none twice, no claim left.
#[test]
fn an_agent_stopped_mid_burst_drains_before_its_socket_goes() {
    let ns = Ns::new("agentterm");
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, _, conf, mut children) = burst_in_flight(&ns, dir.path(), "10.43.0.0/24");
    signal(agent.child.id(), "-TERM");
    children.extend(ns.cni_spawn_pods("ADD", &conf, 100..120));
    let deadline = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "still running: {}", agent.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = agent.log();
    assert!(status.success(), "{status}: {log}");
    assert!(!agent.socket.exists(), "the socket goes with the agent");
    let (stop, removed) = (
        log.find("shutting down").expect("SIGTERM seen"),
        log.find("socket removed").expect("socket removed at exit"),
    );
    assert!(
        log[stop..removed].contains(" served "),
        "work in flight at SIGTERM was finished before the socket went: {log}"
    );
    assert!(!log[removed..].contains(" served "), "{log}");

    let failed = failed_adds(children);
    retry_then_one_address_per_pod(&ns, &conf, &failed, "10.43.0.0-24");
    eprintln!("{} of 120 ADDs were retried", failed.len());
}

/// Bad input on the socket is handed back with a reason naming the problem (the agent runs
/// nothing it cannot read); an invalid config gets the plugin's CNI error; callers other than
/// root are handed back to run their request themselves; the agent keeps serving.
#[test]
fn the_agent_refuses_bad_requests_and_non_root_callers() {
    let ns = Ns::new("agentbad");
    // A directory others may enter, so that a non-root caller can reach the socket at all.
    let dir = tempfile::Builder::new()
        .prefix("wa-agent-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let own = ns.kubeconfig.to_str().unwrap().to_owned();
    let agent = Agent::start(&ns, dir.path(), &own);
    let mode = std::fs::metadata(&agent.socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600,
        "owner-only socket"
    );

    // Unreadable requests (another plugin version during an upgrade, or garbage) are handed back
    // with the reason: the agent runs nothing it cannot read.
    let reason = |r: &Value| {
        r["direct"]["reason"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let r = agent.raw(b"{not json");
    assert!(
        reason(&r).starts_with("the agent cannot read the request: agent request: "),
        "{r}"
    );
    let r = agent.raw(br#"{"env":{},"stdin":"","flatFile":null,"extra":1}"#);
    assert!(reason(&r).contains("unknown field `extra`"), "{r}");
    let r = agent.raw(&vec![b' '; 2 << 20]);
    assert!(reason(&r).contains("larger than 1048576 bytes"), "{r}");
    let r = agent.raw(
        br#"{"env":{"CNI_COMMAND":"ADD"},"stdin":"{\"cniVersion\":\"9.9.9\"}","flatFile":null}"#,
    );
    // Validated as the plugin would: no version we answer in.
    assert_eq!(r["failed"]["code"], 1, "{r}");
    assert!(
        r["failed"]["msg"]
            .as_str()
            .unwrap()
            .starts_with("cniVersion \"9.9.9\" is not supported"),
        "{r}"
    );

    // A caller that is not root (uid 65534) on a socket opened up for it: handed back. (The
    // system Python: a per-user installation is not readable by that user.)
    std::fs::set_permissions(
        &agent.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let script = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); \
                  s.sendall(b'{\"env\":{},\"stdin\":\"\",\"flatFile\":null}'); s.shutdown(socket.SHUT_WR); \
                  print(s.makefile().read())";
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            script,
        ])
        .arg(&agent.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(
        r,
        json!({"direct": {"reason": "the agent serves root only, not uid 65534"}})
    );

    // Still serving.
    let conf = netconf(
        &ns,
        dir.path(),
        json!({"range": "10.43.0.0/24"}),
        &own,
        &agent.socket,
    );
    let r = ns.cni("ADD", &conf, "c1", "net1", "pod1", "u1");
    assert_eq!(r.addresses(), ["10.43.0.1/24"]);
    assert_eq!(agent.served(), 1, "{}", agent.log());
}

/// Requested and claimed addresses through the agent: the agent reads the pod and the claim
/// and writes the claim's status with its own client, and its groups of dynamic ADDs never take
/// them.
#[test]
fn the_agent_serves_requested_and_claimed_addresses() {
    let ns = Ns::new("agent-keep");
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(&ns, dir.path(), SERVED);
    let mut conf = netconf(
        &ns,
        dir.path(),
        json!({"range": "10.164.0.0/27", "allowPersistentIPs": true}),
        SERVED,
        &agent.socket,
    );
    conf["runtimeConfig"] = json!({"ips": ["10.164.0.2/27"]});
    let uid = ns.create_pod("fixed", &Default::default());
    assert_eq!(
        ns.cni("ADD", &conf, "c-fixed", "net1", "fixed", &uid)
            .addresses(),
        ["10.164.0.2/27"]
    );
    conf.as_object_mut().unwrap().remove("runtimeConfig");
    ns.create_ipam_claim("vm.e2e-net", "e2e-net");
    let networks = json!([{"name": "e2e-net", "ipam-claim-reference": "vm.e2e-net"}]).to_string();
    let annotations = [("k8s.v1.cni.cncf.io/networks".to_owned(), networks)].into();
    let uid = ns.create_pod("launcher", &annotations);
    let claimed = ns
        .cni("ADD", &conf, "c-launcher", "net1", "launcher", &uid)
        .addresses();
    assert_eq!(claimed, ["10.164.0.1/27"]);
    let status = ns.get_json(&["ipamclaim", "vm.e2e-net"]).unwrap()["status"].clone();
    assert_eq!(status["ips"], json!(claimed));
    assert!(
        ns.cni("DEL", &conf, "c-launcher", "net1", "launcher", &uid)
            .ok
    );
    assert_eq!(agent.served(), 3, "{}", agent.log());
    // A burst through the agent's groups: the requested and the claimed addresses stay out of it.
    for i in 0..20 {
        ns.create_pod(&format!("pod{i}"), &Default::default());
    }
    let burst: BTreeSet<String> = ns
        .cni_pods("ADD", &conf, 0..20)
        .iter()
        .map(|r| r.addresses()[0].clone())
        .collect();
    assert_eq!(burst.len(), 20);
    assert!(
        !burst.contains("10.164.0.1/27") && !burst.contains("10.164.0.2/27"),
        "{burst:?}"
    );
    assert_eq!(ns.allocations("10.164.0.0-27").len(), 22);
}
