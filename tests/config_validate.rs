//! The shared validator, as the CNI plugin, the webhook and the CLI see it.

use serde_json::{Value, json};
use whereabouts::config::{PluginSlots, Source, Validated, validate_ipam};

fn check(ipam: Value) -> Validated {
    validate_ipam(&ipam, "ipam", Source::Runtime)
}

fn errors(ipam: Value) -> Vec<String> {
    check(ipam).errors.iter().map(ToString::to_string).collect()
}

fn warnings(ipam: Value) -> Vec<String> {
    check(ipam)
        .warnings
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn windows(ipam: Value) -> Vec<(String, String, String, String)> {
    let v = check(ipam);
    assert!(v.errors.is_empty(), "{:?}", v.errors);
    v.config
        .unwrap()
        .ranges
        .iter()
        .map(|r| {
            let (a, b) = r.range.window();
            (
                r.range.cidr().to_string(),
                a.to_string(),
                b.to_string(),
                r.pool_name.clone(),
            )
        })
        .collect()
}

#[test]
fn dual_stack_and_multi_range_configs_from_the_design_discussion() {
    let v4 = json!({"type": "whereabouts", "ipRanges": [
        {"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"},
        {"range": "11.11.11.11/24", "range_start": "11.11.11.20", "range_end": "11.11.11.200"}]});
    assert_eq!(
        windows(v4),
        vec![
            (
                "10.10.10.0/24".into(),
                "10.10.10.20".into(),
                "10.10.10.200".into(),
                "10.10.10.0-24".into()
            ),
            (
                "11.11.11.0/24".into(),
                "11.11.11.20".into(),
                "11.11.11.200".into(),
                "11.11.11.0-24".into()
            ),
        ]
    );
    let dual = json!({"type": "whereabouts", "range": "12.12.12.12/24", "ipRanges": [
        {"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"},
        {"range": "2001::1/64", "range_start": "2001::16", "range_end": "2001::64"}]});
    let w = windows(dual);
    assert_eq!(
        w[0],
        (
            "12.12.12.0/24".into(),
            "12.12.12.1".into(),
            "12.12.12.254".into(),
            "12.12.12.0-24".into()
        )
    );
    assert_eq!(
        w[2],
        (
            "2001::/64".into(),
            "2001::16".into(),
            "2001::64".into(),
            "2001---64".into()
        )
    );
}

#[test]
fn start_cidr_form() {
    let w = windows(json!({"type": "whereabouts", "range": "192.168.1.5-192.168.1.25/24"}));
    assert_eq!(w[0].1, "192.168.1.5");
    assert_eq!(w[0].2, "192.168.1.25");
    let e = errors(json!({"range": "192.168.1.5-192.168.1.25/24", "range_start": "192.168.1.6"}));
    assert!(e[0].contains("do not also set range_start"), "{e:?}");
    let e = errors(json!({"range": "x-192.168.1.25/24"}));
    assert!(
        e[0].starts_with("ipam.range \"x-192.168.1.25/24\" is not a CIDR"),
        "{e:?}"
    );
}

#[test]
fn upstream_silent_failures_are_errors_naming_field_and_value() {
    assert_eq!(
        errors(json!({"range": "abc.169.1.0/24"})),
        vec![
            r#"ipam.range "abc.169.1.0/24" is not a CIDR (expected for example 10.0.0.0/24 or fd00::/64)"#
        ]
    );
    assert_eq!(
        errors(
            json!({"range": "10.0.0.0/24", "range_start": "10.0.0.50", "range_end": "10.0.0.10"})
        ),
        vec![r#"ipam.range_start "10.0.0.50" is after range_end 10.0.0.10"#]
    );
    assert_eq!(
        errors(
            json!({"ipRanges": [{"range": "10.0.0.0/24"}, {"range": "10.0.1.0/24", "range_start": "10.0.0.5"}]})
        ),
        vec![r#"ipam.ipRanges[1].range_start "10.0.0.5" is outside range 10.0.1.0/24"#]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "exclude": ["10.0.0.0/33"]})),
        vec![r#"ipam.exclude[0] "10.0.0.0/33" is not a CIDR or IP address"#]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/32"})),
        vec![
            r#"ipam.range "10.0.0.0/32" has no usable address (a prefix needs at least two host bits)"#
        ]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "range_end": "2001::5"})),
        vec![r#"ipam.range_end "2001::5" is not of the same address family as range 10.0.0.0/24"#]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "exclude": ["10.0.0.0/25", "10.0.0.128/25"]})),
        vec![
            r#"ipam.exclude "10.0.0.0/25,10.0.0.128/25" leaves no usable address in range 10.0.0.0/24 (window 10.0.0.1 to 10.0.0.254)"#
        ]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "gateway": "10.0.0.300"})),
        vec![r#"ipam.gateway "10.0.0.300" is not an IP address"#]
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let e = errors(
        json!({"range": "10.0.0.0/24", "range_start": "bad", "gateway": "worse", "ipRanges": [{"range": "nope"}, 5], "enable_overlapping_ranges": "yes"}),
    );
    assert_eq!(e.len(), 5, "{e:?}");
}

#[test]
fn overlapping_ranges_in_one_config_are_rejected() {
    let e = errors(json!({"ipRanges": [{"range": "10.0.0.0/24"}, {"range": "10.0.0.128/25"}]}));
    assert_eq!(
        e,
        vec![r#"ipam.ipRanges[1] "10.0.0.128/25" overlaps ipam.ipRanges[0] (10.0.0.0/24)"#]
    );
    // Disjoint windows of overlapping CIDRs are fine.
    assert!(errors(json!({"ipRanges": [{"range": "10.0.0.0/24", "range_end": "10.0.0.99"}, {"range": "10.0.0.0/24", "range_start": "10.0.0.100"}]})).is_empty());
}

#[test]
fn missing_range_depends_on_source() {
    assert_eq!(
        errors(json!({"type": "whereabouts"})),
        vec!["ipam.range is missing: set ipam.range or ipam.ipRanges"]
    );
    let nad = validate_ipam(&json!({"type": "whereabouts"}), "ipam", Source::Nad);
    assert!(nad.errors.is_empty());
    assert_eq!(nad.warnings.len(), 1);
    assert_eq!(
        errors(json!({"ipRanges": [{"range_start": "10.0.0.1"}]})),
        vec!["ipam.ipRanges[0].range is missing"]
    );
}

#[test]
fn network_name_and_node_slices() {
    let e = errors(json!({"range": "10.0.0.0/24", "network_name": "Blue_Net"}));
    assert!(
        e[0].starts_with(r#"ipam.network_name "Blue_Net" is not usable in object names"#),
        "{e:?}"
    );
    let long = "a".repeat(250);
    let e = errors(json!({"range": "10.0.0.0/24", "network_name": long}));
    assert!(e[0].contains("gives the object name"), "{e:?}");
    let w = windows(json!({"range": "10.0.0.0/24", "network_name": "blue"}));
    assert_eq!(w[0].3, "blue-10.0.0.0-24");
    assert!(errors(json!({"range": "10.0.0.0/24", "node_slice_size": "/28"})).is_empty());
    assert!(errors(json!({"range": "10.0.0.0/24", "node_slice_size": "28"})).is_empty());
    assert!(
        errors(json!({"range": "10.0.0.0/24", "node_slice_size": "/16"}))[0]
            .contains("does not fit range 10.0.0.0/24")
    );
    assert!(
        errors(json!({"range": "10.0.0.0/24", "node_slice_size": "x"}))[0]
            .contains("is not a prefix length")
    );
}

#[test]
fn node_slice_sizes_per_range() {
    // The top-level size slices every range without its own; a /26 cannot slice a /120.
    let e = errors(json!({"node_slice_size": "/26", "ipRanges": [
        {"range": "10.0.0.0/24"}, {"range": "fd00::/120"}]}));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with(r#"ipam.node_slice_size "/26" does not fit range fd00::/120"#),
        "{e:?}"
    );
    let ok = json!({"node_slice_size": "/26", "ipRanges": [
        {"range": "10.0.0.0/24"}, {"range": "fd00::/120", "node_slice_size": "/122"}]});
    assert!(errors(ok).is_empty());
    let e = errors(json!({"ipRanges": [{"range": "10.0.0.0/24", "node_slice_size": "/31"}]}));
    assert!(
        e[0].starts_with(r#"ipam.ipRanges[0].node_slice_size "/31" does not fit range 10.0.0.0/24: a slice needs at least two host bits"#),
        "{e:?}"
    );
    // Upstream's #666: a /8 in /27 slices would be a NodeSlicePool over the object size limit.
    let e = errors(json!({"range": "10.0.0.0/8", "node_slice_size": "/27"}));
    assert!(e[0].contains("into 524288 slices"), "{e:?}");
    assert!(
        warnings(json!({"ipRanges": [{"range": "10.0.0.0/24", "node_slice_size": "/26"}]}))
            .is_empty()
    );
}

#[test]
fn static_addresses_routes_dns() {
    let v = check(
        json!({"range": "10.0.0.0/24", "addresses": [{"address": "192.168.9.5/24", "gateway": "192.168.9.1"}],
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "10.1.0.0/16", "gw": "10.0.0.1"}], "dns": {"nameservers": ["10.0.0.53"]}}),
    );
    let c = v.config.unwrap();
    assert_eq!(c.addresses[0].address.to_string(), "192.168.9.5/24");
    assert_eq!(c.routes.len(), 2);
    assert!(c.dns.is_some());
    assert!(c.enable_overlapping_ranges);
    let e = errors(
        json!({"range": "10.0.0.0/24", "addresses": [{"address": "192.168.9.5"}], "routes": [{"dst": "x"}, {"dst": "1.0.0.0/8", "gw": "y"}]}),
    );
    assert_eq!(e.len(), 3, "{e:?}");
}

#[test]
fn warnings_for_risky_but_valid_configs() {
    let w = warnings(
        json!({"range": "10.0.0.0/24", "gateway": "10.0.0.1", "exclude": ["10.9.0.0/16"], "colour": "red", "log_level": "info", "leader_lease_duration": 1500}),
    );
    assert!(
        w.iter()
            .any(|m| m.starts_with(r#"ipam.gateway "10.0.0.1" is inside the allocatable window"#)),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|m| m
                == r#"ipam.exclude "10.9.0.0/16" does not touch the window of range 10.0.0.0/24"#),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|m| m == "ipam.colour is not a whereabouts setting and is ignored"),
        "{w:?}"
    );
    assert!(
        w.iter().any(|m| m.starts_with(r#"ipam.log_level "info""#)),
        "{w:?}"
    );
    assert_eq!(w.len(), 4, "legacy keys are accepted quietly: {w:?}");
    let w = warnings(json!({"range": "10.0.0.0/24", "gateway": "10.9.0.1"}));
    assert_eq!(w, vec![r#"ipam.gateway "10.9.0.1" is outside every range"#]);
    assert!(
        warnings(json!({"range": "10.0.0.0/24", "gateway": "10.0.0.1", "exclude": ["10.0.0.1"]}))
            .is_empty()
    );
}

#[test]
fn wrong_types_never_panic() {
    for v in [
        json!(null),
        json!(5),
        json!("x"),
        json!([1]),
        json!({"range": 5}),
        json!({"ipRanges": "x"}),
        json!({"exclude": {"a": 1}, "range": "10.0.0.0/24"}),
        json!({"range": "10.0.0.0/24", "routes": [5]}),
        json!({"range": "10.0.0.0/24", "addresses": [null]}),
    ] {
        let r = check(v.clone());
        assert!(!r.errors.is_empty(), "{v}");
    }
}

#[test]
fn a_bad_exclude_does_not_hide_other_problems_of_the_range() {
    let e = errors(
        json!({"range": "10.50.0.0/24", "range_start": "10.60.0.10", "exclude": ["not-an-address", "2001::/64"]}),
    );
    assert_eq!(
        e,
        vec![
            r#"ipam.exclude[0] "not-an-address" is not a CIDR or IP address"#,
            r#"ipam.range_start "10.60.0.10" is outside range 10.50.0.0/24"#,
        ]
    );
    // Positions in problems refer to the list as written, even when an earlier entry was bad.
    let e = errors(json!({"range": "10.50.0.0/24", "exclude": ["nope", "2001::/64"]}));
    assert_eq!(
        e[1],
        r#"ipam.exclude[1] "2001::/64" is not of the same address family as range 10.50.0.0/24"#
    );
}

#[test]
fn agent_socket_defaults_turns_off_and_must_be_absolute() {
    let socket = |ipam: Value| check(ipam).config.map(|c| c.agent_socket);
    assert_eq!(
        socket(json!({"range": "10.0.0.0/24"})),
        Some(Some("/run/whereabouts/agent.sock".to_owned()))
    );
    assert_eq!(
        socket(json!({"range": "10.0.0.0/24", "agent_socket": "/tmp/a.sock"})),
        Some(Some("/tmp/a.sock".to_owned()))
    );
    assert_eq!(
        socket(json!({"range": "10.0.0.0/24", "agent_socket": ""})),
        Some(None)
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "agent_socket": "run/agent.sock"})),
        vec![
            r#"ipam.agent_socket "run/agent.sock" must be an absolute path to the node agent's Unix socket, or "" to turn the agent off"#
        ]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "agent_socket": 7})),
        vec![r#"ipam.agent_socket "7" must be a string"#]
    );
    assert!(warnings(json!({"range": "10.0.0.0/24", "agent_socket": ""})).is_empty());
    // In a NAD it is ignored (the plugin takes it from the node's flat file only), with a word.
    let nad = validate_ipam(
        &json!({"range": "10.0.0.0/24", "agent_socket": "/tmp/x.sock"}),
        "ipam",
        Source::Nad,
    );
    assert_eq!(
        nad.warnings
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        [
            "ipam.agent_socket is node configuration, read from the flat file only: ignored in a network config"
        ]
    );
    // Whatever its value: the plugin ignores it, so the validator must not refuse it.
    for value in [json!("run/agent.sock"), json!(7)] {
        let nad = validate_ipam(
            &json!({"range": "10.0.0.0/24", "agent_socket": value}),
            "ipam",
            Source::Nad,
        );
        assert!(nad.errors.is_empty(), "{:?}", nad.errors);
        assert_eq!(nad.warnings.len(), 1);
    }
}

#[test]
fn plugin_slots_default_turn_off_and_are_checked() {
    let slots = |ipam: Value| check(ipam).config.map(|c| c.plugin_slots);
    let bound = |count: u32, dir: &str| {
        Some(Some(PluginSlots {
            count,
            dir: dir.to_owned(),
        }))
    };
    assert_eq!(
        slots(json!({"range": "10.0.0.0/24"})),
        bound(8, "/run/whereabouts/plugin-slots")
    );
    assert_eq!(
        slots(json!({"range": "10.0.0.0/24", "plugin_slots": 3, "plugin_slots_dir": "/tmp/s"})),
        bound(3, "/tmp/s")
    );
    assert_eq!(
        slots(json!({"range": "10.0.0.0/24", "plugin_slots": 0})),
        Some(None)
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "plugin_slots": -1, "plugin_slots_dir": "s"})),
        vec![
            r#"ipam.plugin_slots "-1" must be a whole number from 0 (unbounded) to 256"#,
            r#"ipam.plugin_slots_dir "s" must be an absolute path to a directory (created if missing)"#,
        ]
    );
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "plugin_slots": 257})),
        vec![r#"ipam.plugin_slots "257" must be a whole number from 0 (unbounded) to 256"#]
    );
    // A NAD cannot set the node's bound: ignored there, with a word, whatever its value.
    let nad = validate_ipam(
        &json!({"range": "10.0.0.0/24", "plugin_slots": "many", "plugin_slots_dir": "/tmp/x"}),
        "ipam",
        Source::Nad,
    );
    assert!(nad.errors.is_empty(), "{:?}", nad.errors);
    assert_eq!(nad.warnings.len(), 2, "{:?}", nad.warnings);
    assert!(nad.config.unwrap().plugin_slots.is_none());
}

#[test]
fn a_window_larger_than_one_pool_object_holds_is_warned_about() {
    let w = warnings(json!({"type": "whereabouts", "range": "10.0.0.0/16"}));
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with("ipam.range \"10.0.0.0/16\" has 65534 allocatable addresses, but one IPPool object records about 6732")
            && w[0].contains("etcd's 1.5 MiB request limit")
            && w[0].contains("node slices"),
        "{}",
        w[0]
    );
    // The window decides, not the CIDR; a /20 fits (a /19 does not); IPv6 /64s are not meant
    // to be filled.
    let narrowed = json!({"type": "whereabouts", "range": "10.0.0.0/16",
                          "range_start": "10.0.0.1", "range_end": "10.0.15.255"});
    assert_eq!(warnings(narrowed), Vec::<String>::new());
    assert_eq!(
        warnings(json!({"type": "whereabouts", "range": "10.0.0.0/20"})),
        Vec::<String>::new()
    );
    assert_eq!(
        warnings(json!({"type": "whereabouts", "range": "fd00::/64"})),
        Vec::<String>::new()
    );
    // Still a warning only: the config is valid.
    assert!(errors(json!({"type": "whereabouts", "range": "10.0.0.0/8"})).is_empty());
}

#[test]
fn addresses_that_stay_are_configured_and_checked() {
    let c = check(
        json!({"range": "10.0.0.0/24", "sticky_statefulset": true, "allowPersistentIPs": true}),
    )
    .config
    .unwrap();
    assert!(c.sticky_statefulset && c.allow_persistent_ips);
    let c = check(json!({"range": "10.0.0.0/24"})).config.unwrap();
    assert!(!c.sticky_statefulset && !c.allow_persistent_ips);
    assert_eq!(
        errors(json!({"range": "10.0.0.0/24", "sticky_statefulset": "yes"})),
        [r#"ipam.sticky_statefulset "yes" must be true or false"#]
    );
    // Static addresses are not reserved: one inside the network's own window is warned about.
    let w = warnings(
        json!({"ipRanges": [{"range": "10.0.0.0/24", "exclude": ["10.0.0.0/28"]}],
        "addresses": [{"address": "10.0.0.5/24"}, {"address": "10.0.0.50/24"}, {"address": "192.168.0.5/24"}]}),
    );
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with(r#"ipam.addresses[1].address "10.0.0.50/24" is inside the allocatable window of ipam.ipRanges[0] (10.0.0.0/24)"#),
        "{w:?}"
    );
}

#[test]
fn allow_persistent_ips_at_the_top_level_must_be_a_boolean() {
    let nad = |v: Value| {
        let config = json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan", "allowPersistentIPs": v,
            "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}});
        whereabouts::nad_check::check_spec_config(&config.to_string())
            .errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    assert!(nad(json!(true)).is_empty());
    assert_eq!(
        nad(json!("true")),
        [r#"allowPersistentIPs "true" must be true or false"#]
    );
}

#[test]
fn addresses_that_follow_a_pod_cannot_live_in_node_slices() {
    let nad = |config: Value| {
        whereabouts::nad_check::check_spec_config(&config.to_string())
            .errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    let sliced = json!({"type": "whereabouts", "range": "10.0.0.0/16", "node_slice_size": "/24", "sticky_statefulset": true});
    let e = nad(json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan", "ipam": sliced}));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with(
            "ipam.sticky_statefulset cannot be combined with node_slice_size (ipam.range is sliced)"
        ),
        "{e:?}"
    );
    let claims = json!({"type": "whereabouts", "range": "10.0.0.0/16", "node_slice_size": "/24"});
    let e = nad(
        json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan", "allowPersistentIPs": true, "ipam": claims}),
    );
    assert!(
        e[0].starts_with("ipam.allowPersistentIPs cannot be combined"),
        "{e:?}"
    );
}
