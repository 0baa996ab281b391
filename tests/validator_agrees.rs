//! One validator, in truth: over generated and mutated network configs, the NAD validator (the
//! webhook's and `whereabouts-operator validate`'s) accepts a config if and only if the plugin
//! does not refuse it at ADD with a configuration error. No cluster: the plugin's `load` is where
//! an ADD reads and checks its config, before any API call.

use proptest::prelude::*;
use serde_json::{Value, json};
use whereabouts::cni::protocol::{Code, Command};
use whereabouts::cni::{FlatSource, Invocation};
use whereabouts::nad_check::check_spec_config;

/// The plugin's verdict: `Ok` or the CNI error code and message.
fn plugin(config: &str) -> Result<(), (Code, String)> {
    let env = |k: &str| match k {
        "CNI_CONTAINERID" => Some("c1".to_owned()),
        "CNI_IFNAME" => Some("net1".to_owned()),
        // Node slices read the node's name; this one is valid.
        "NODENAME" => Some("node-1".to_owned()),
        "CNI_ARGS" => {
            Some("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u".to_owned())
        }
        _ => None,
    };
    Invocation::read(&env, config, FlatSource::Paths(vec![]))
        .load(Command::Add)
        .map(|_| ())
        .map_err(|e| (e.code, e.msg))
}

/// Codes that mean "this configuration cannot work": what the validator must have refused.
fn is_config_error(code: Code) -> bool {
    matches!(
        code,
        Code::IncompatibleVersion | Code::UnsupportedField | Code::Decode | Code::InvalidConfig
    )
}

fn agree(config: &str) -> Result<(), TestCaseError> {
    let nad = check_spec_config(config);
    // A NAD may leave its range to the node's flat file, which the validator cannot see: it warns
    // and accepts (by design), and the plugin refuses only on a node whose flat file has none.
    prop_assume!(
        !nad.warnings
            .iter()
            .any(|w| w.reason.contains("flat file must supply")),
        "range left to the flat file"
    );
    let refused_at_add = match plugin(config) {
        Ok(()) => None,
        Err((c, msg)) if is_config_error(c) => Some(format!("code {}: {msg}", c.number())),
        // Anything else (environment, ...) is not the config's fault here.
        Err((c, msg)) => {
            return Err(TestCaseError::fail(format!(
                "unexpected code {} ({msg}) for {config}",
                c.number()
            )));
        }
    };
    prop_assert!(nad.whereabouts, "not seen as whereabouts: {config}");
    prop_assert_eq!(
        nad.is_valid(),
        refused_at_add.is_none(),
        "validator errors {:?}, plugin {:?}, config {}",
        nad.errors.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        refused_at_add,
        config
    );
    Ok(())
}

fn version() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        prop::sample::select(vec![
            "", "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "1.2.3.4", "0.2",
            "2.0.0", " 1.0.0", "latest",
        ])
        .prop_map(|v| Some(json!(v))),
        prop::sample::select(vec![
            json!(-1),
            json!(1.0),
            json!(null),
            json!(true),
            json!([])
        ])
        .prop_map(Some),
    ]
}

fn cidr() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        json!("10.0.0.0/24"),
        json!("10.0.1.0/24"),
        json!("10.0.0.128/25"),
        json!("192.168.7.9/30"),
        json!("10.0.0.5/32"),
        json!("fd00::/64"),
        json!("fd00:0:0:1::/120"),
        json!("10.0.0.0/33"),
        json!("abc.1.0.0/24"),
        json!("10.0.0.0"),
        json!(""),
        json!(7),
    ])
}

fn address() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        json!("10.0.0.10"),
        json!("10.0.0.200"),
        json!("10.0.1.3"),
        json!("fd00::5"),
        json!("10.0.0.300"),
        json!(""),
        json!(3),
    ])
}

/// An `ipRanges` entry or the top level's range keys.
fn range_keys() -> impl Strategy<Value = serde_json::Map<String, Value>> {
    (
        prop::option::weighted(0.9, cidr()),
        prop::option::of(address()),
        prop::option::of(address()),
        prop::option::of(prop::collection::vec(cidr(), 0..3)),
        prop::option::weighted(
            0.3,
            prop::sample::select(vec!["/28", "24", "/120", "/126", "x", "/31", "/8"]),
        ),
    )
        .prop_map(|(range, start, end, exclude, slice)| {
            let mut m = serde_json::Map::new();
            if let Some(s) = slice {
                m.insert("node_slice_size".into(), json!(s));
            }
            if let Some(r) = range {
                m.insert("range".into(), r);
            }
            if let Some(s) = start {
                m.insert("range_start".into(), s);
            }
            if let Some(e) = end {
                m.insert("range_end".into(), e);
            }
            if let Some(x) = exclude {
                m.insert("exclude".into(), json!(x));
            }
            m
        })
}

fn ipam() -> impl Strategy<Value = Value> {
    (
        range_keys(),
        prop::option::of(prop::collection::vec(range_keys(), 0..3)),
        prop::option::of(prop::sample::select(vec![
            json!([{"address": "10.5.0.5/24"}]),
            json!([{"address": "10.5.0.5/24"}, {"address": "fd05::5/64"}]),
            json!([{"address": "fd05::5/64", "gateway": "fd05::1"}]),
            json!([{"address": "nope"}]),
        ])),
        prop::option::of(prop::sample::select(vec![
            json!("10.0.0.1"),
            json!("fd00::1"),
            json!("x"),
        ])),
        prop::option::of(prop::sample::select(vec![
            json!([{"dst": "0.0.0.0/0"}]),
            json!([{"dst": "::/0"}, {"dst": "10.9.0.0/16", "gw": "10.0.0.1"}]),
            json!([{"dst": "bad"}]),
        ])),
        prop::option::of(prop::sample::select(vec![
            json!("blue"),
            json!("Not_A_DNS-Name!"),
            json!(""),
        ])),
    )
        .prop_map(|(top, ranges, addresses, gateway, routes, network_name)| {
            let mut m = top;
            m.insert("type".into(), json!("whereabouts"));
            let optional = [
                ("ipRanges", ranges.map(|r| json!(r))),
                ("addresses", addresses),
                ("gateway", gateway),
                ("routes", routes),
                ("network_name", network_name),
            ];
            for (key, value) in optional {
                if let Some(v) = value {
                    m.insert(key.into(), v);
                }
            }
            Value::Object(m)
        })
}

/// A plugin config or a conflist holding `ipam`, with `version` at the top.
fn config() -> impl Strategy<Value = Value> {
    // An invalid name is an invalid NodeSlicePool name once slices are on.
    let name = prop::sample::select(vec!["n", "Not_A_Name"]);
    (version(), ipam(), any::<bool>(), name).prop_map(|(version, ipam, list, name)| {
        let mut c = if list {
            json!({"name": name, "plugins": [{"type": "bridge", "ipam": ipam}, {"type": "tuning"}]})
        } else {
            json!({"name": name, "type": "macvlan", "master": "eth0", "ipam": ipam})
        };
        if let Some(v) = version {
            c["cniVersion"] = v;
        }
        c
    })
}

/// Values that break a key's type or meaning.
fn garbage() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        json!(null),
        json!([null]),
        json!([{"type": "tuning"}, 3]),
        json!(true),
        json!(-1),
        json!(""),
        json!("x".repeat(300)),
        json!([]),
        json!({}),
        json!(["10.0.0.0/24"]),
        json!({"range": "10.0.0.0/24"}),
        // Host paths: inside the node's directories, outside, or only seemingly inside.
        json!("/tmp/evil"),
        json!("/etc/cni/net.d/whereabouts.d/whereabouts.conf"),
        json!("/etc/cni/net.d/whereabouts.d/../../../tmp/evil"),
        json!({"kubeconfig": "/tmp/evil.kubeconfig"}),
        json!({"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}),
        json!({"kubeconfig": "/etc/cni/net.d/whereabouts.d//k"}),
        json!({"kubeconfig": 7}),
    ])
}

/// A generated config with one key of its ipam (or the version) replaced, added or removed.
fn mutated() -> impl Strategy<Value = Value> {
    let keys = prop::sample::select(vec![
        "range",
        "range_start",
        "range_end",
        "exclude",
        "ipRanges",
        "addresses",
        "gateway",
        "routes",
        "network_name",
        "enable_overlapping_ranges",
        "dns",
        "log_level",
        "log_file",
        "agent_socket",
        "plugin_slots",
        "plugin_slots_dir",
        "configuration_path",
        "kubernetes",
        "cniVersion",
        "plugins",
    ]);
    (config(), keys, prop::option::of(garbage())).prop_map(|(mut c, key, value)| {
        if key == "plugins" {
            return broken_plugins(c, value.unwrap_or(Value::Null));
        }
        let target = if key == "cniVersion" {
            &mut c
        } else if c.get("plugins").is_some() {
            &mut c["plugins"][0]["ipam"]
        } else {
            &mut c["ipam"]
        };
        let obj = target.as_object_mut().unwrap();
        match value {
            Some(v) => obj.insert(key.into(), v),
            None => obj.remove(key),
        };
        c
    })
}

/// What libcni cannot load, and both must refuse: a `plugins` key beside a single plugin's ipam
/// (libcni then reads a conflist), or an entry that is not a plugin object in a conflist's list.
fn broken_plugins(mut c: Value, entry: Value) -> Value {
    match c.get_mut("plugins").and_then(Value::as_array_mut) {
        Some(list) => list.push(entry),
        None => c["plugins"] = entry,
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, max_global_rejects: 3000, ..ProptestConfig::default() })]

    #[test]
    fn generated_configs(c in config()) {
        agree(&c.to_string())?;
    }

    #[test]
    fn mutated_configs(c in mutated()) {
        agree(&c.to_string())?;
    }
}

/// The three configs the issue names, refused by both with the same words.
#[test]
fn the_reported_versions_are_refused_by_both() {
    for (version, words) in [
        (json!("1.2.3.4"), r#"cniVersion "1.2.3.4" is not supported"#),
        (json!(-1), r#"cniVersion "-1" must be a string"#),
    ] {
        let c = json!({"cniVersion": version, "name": "n", "type": "macvlan",
                       "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}})
        .to_string();
        let nad = check_spec_config(&c);
        assert!(
            nad.errors[0].to_string().starts_with(words),
            "{:?}",
            nad.errors
        );
        let (code, msg) = plugin(&c).unwrap_err();
        assert_eq!(code, Code::IncompatibleVersion);
        assert!(msg.starts_with(words), "{msg}");
    }
    // 0.2.0 works, as with upstream.
    let c = json!({"cniVersion": "0.2.0", "name": "n", "type": "macvlan",
                   "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}})
    .to_string();
    assert!(check_spec_config(&c).is_valid());
    assert!(plugin(&c).is_ok());
}

/// Issue 24's configs: a kubeconfig or flat file of the NAD author's choosing, and a conflist
/// libcni cannot load, are refused by both, naming the field and the value; a log file of their
/// choosing is only warned of (upstream's example NADs set one), and followed by neither.
#[test]
fn host_files_and_broken_conflists_are_refused_by_both() {
    let with = |key: &str, value: Value| {
        let mut c = json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan",
                           "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}});
        c["ipam"][key] = value;
        c.to_string()
    };
    let refused = [
        (
            with(
                "kubernetes",
                json!({"kubeconfig": "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/x/k"}),
            ),
            r#"ipam.kubernetes.kubeconfig "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/x/k" names the plugin's credentials, which are node configuration"#,
        ),
        (
            with(
                "configuration_path",
                json!("/etc/cni/net.d/whereabouts.d/../../../tmp/f.conf"),
            ),
            r#"ipam.configuration_path "/etc/cni/net.d/whereabouts.d/../../../tmp/f.conf" names the node's flat file"#,
        ),
    ];
    for (c, words) in refused {
        let nad = check_spec_config(&c);
        assert!(
            nad.errors[0].to_string().starts_with(words),
            "{:?}",
            nad.errors
        );
        let (code, msg) = plugin(&c).unwrap_err();
        assert_eq!(code, Code::InvalidConfig);
        assert!(msg.contains(words), "{msg}");
    }
    let logged = with("log_file", json!("/etc/cron.d/x"));
    let nad = check_spec_config(&logged);
    assert!(nad.is_valid());
    assert_eq!(nad.warnings[0].path, "ipam.log_file");
    assert!(plugin(&logged).is_ok());
    let documented = with(
        "kubernetes",
        json!({"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}),
    );
    assert!(check_spec_config(&documented).is_valid());
    assert!(plugin(&documented).is_ok());
    let broken = json!({"cniVersion": "1.0.0", "name": "n", "plugins": [null],
                        "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}})
    .to_string();
    let nad = check_spec_config(&broken);
    assert!(nad.whereabouts);
    assert!(
        nad.errors[0]
            .to_string()
            .starts_with(r#"plugins[0] "null" must be a JSON object"#),
        "{:?}",
        nad.errors
    );
    assert_eq!(plugin(&broken).unwrap_err().0, Code::InvalidConfig);
}
