//! The ranges of an `ipam` object: the top-level `range` and each of `ipRanges`, their bounds and
//! excludes, and the checks across them (overlaps, node slices, the names they give objects).

use std::net::IpAddr;

use ipnet::IpNet;

use super::reader::{Reader, parse_cidr_or_ip, parse_ip};
use super::{NodeSlice, RangeConfig};
use crate::config::problem::Problem;
use crate::crd::size::{MAX_NODE_SLICES, NODE_SLICE_ENTRY_BYTES};
use crate::ipam::naming::{object_name_problem, pool_name, reservation_name};
use crate::ipam::slices::{parse_slice_size, slice_count, slice_size_problem};
use crate::ipam::{AddrRange, Bound, RangeError};

pub(super) fn read_ranges(r: &mut Reader<'_>, network_name: Option<&str>) -> Vec<RangeConfig> {
    let mut ranges = Vec::new();
    let top_prefix = r.prefix.to_owned();
    if let Some(range) = read_one_range(r, &top_prefix, network_name, true) {
        ranges.push(range);
    }
    for (i, entry) in r.array("ipRanges").iter().enumerate() {
        let prefix = format!("{}.ipRanges[{i}]", r.prefix);
        let Some(obj) = entry.as_object() else {
            r.errors.push(Problem::with_value(
                &prefix,
                entry,
                "must be an object with a range",
            ));
            continue;
        };
        let mut nested = r.nested(obj, &prefix);
        let range = read_one_range(&mut nested, &prefix, network_name, false);
        if range.is_none() && nested.errors.is_empty() {
            nested
                .errors
                .push(Problem::at(format!("{prefix}.range"), "is missing"));
        }
        r.errors.append(&mut nested.errors);
        ranges.extend(range);
    }
    ranges
}

/// Reads `range`, `range_start`, `range_end` and `exclude` from one object. `path` is where the
/// range is reported: the ipam object itself for the top-level range, `ipRanges[i]` otherwise.
fn read_one_range(
    r: &mut Reader<'_>,
    prefix: &str,
    network_name: Option<&str>,
    top_level: bool,
) -> Option<RangeConfig> {
    let range_text = r.string("range");
    let mut start = r.ip("range_start");
    let mut end = r.ip("range_end");
    let excludes = read_excludes(r);
    // The top-level range's slice size is the top-level key, read by `check_node_slice`.
    let own_slice = (!top_level)
        .then(|| r.string("node_slice_size").map(str::to_owned))
        .flatten();
    let range_text = range_text?;
    let cidr_text = split_start_cidr(r, range_text, &mut start, &mut end)?;
    let Ok(cidr) = cidr_text.trim().parse::<IpNet>() else {
        r.errors.push(Problem::with_value(
            r.path("range"),
            range_text,
            "is not a CIDR (expected for example 10.0.0.0/24 or fd00::/64)",
        ));
        return None;
    };
    // The bounds are checked even when an exclude did not parse, so every problem is reported;
    // the range is only usable when all excludes parsed.
    match check_bounds(cidr, start, end, &excludes) {
        // An exclude that did not parse is reported above; the range is not usable without it.
        Ok(_) if !excludes.complete => None,
        Ok(range) => {
            let path = if top_level {
                format!("{prefix}.range")
            } else {
                prefix.to_owned()
            };
            let node_slice = match own_slice {
                Some(text) => Some(node_slice(r, r.path("node_slice_size"), &text, &range)?),
                None => None,
            };
            Some(RangeConfig {
                path,
                pool_name: pool_name(network_name, range.cidr()),
                range,
                node_slice,
            })
        }
        Err(e) => {
            r.errors.push(range_problem(
                prefix,
                range_text,
                &excludes.nets,
                start,
                end,
                e,
            ));
            None
        }
    }
}

/// The CIDR part of `range_text`. In the `START-CIDR` form, START is range_start and the CIDR's
/// own address is range_end, so `start` and `end` are set from it (and must not be set already).
/// `None` when the form is wrong, the problem recorded.
fn split_start_cidr<'t>(
    r: &mut Reader<'_>,
    range_text: &'t str,
    start: &mut Option<IpAddr>,
    end: &mut Option<IpAddr>,
) -> Option<&'t str> {
    let Some((s, cidr)) = range_text.split_once('-') else {
        return Some(range_text);
    };
    let Some(s) = parse_ip(s) else {
        r.errors.push(Problem::with_value(
            r.path("range"),
            range_text,
            "is not a CIDR or START-CIDR (the start is not an IP address)",
        ));
        return None;
    };
    if start.is_some() || end.is_some() {
        r.errors.push(Problem::with_value(
            r.path("range"),
            range_text,
            "gives a start in START-CIDR form; do not also set range_start or range_end",
        ));
        return None;
    }
    *start = Some(s);
    *end = cidr.parse::<IpNet>().ok().map(|n| n.addr());
    Some(cidr)
}

/// The range of `cidr` with its bounds and the excludes that parsed; an exclude's error names
/// its position in the list as written, not among those that parsed.
fn check_bounds(
    cidr: IpNet,
    start: Option<IpAddr>,
    end: Option<IpAddr>,
    excludes: &Excludes,
) -> Result<AddrRange, RangeError> {
    AddrRange::new(cidr, start, end, &excludes.nets).map_err(|e| match e {
        RangeError::FamilyMismatch {
            bound: Bound::Exclude(i),
            value,
            cidr,
        } => RangeError::FamilyMismatch {
            bound: Bound::Exclude(excludes.positions[i]),
            value,
            cidr,
        },
        other => other,
    })
}

/// The excludes that parse, with their positions in the list as written, and whether all did.
struct Excludes {
    nets: Vec<IpNet>,
    positions: Vec<usize>,
    complete: bool,
}

fn read_excludes(r: &mut Reader<'_>) -> Excludes {
    let mut ex = Excludes {
        nets: Vec::new(),
        positions: Vec::new(),
        complete: true,
    };
    for (i, v) in r.array("exclude").iter().enumerate() {
        match v.as_str().and_then(parse_cidr_or_ip) {
            Some(net) => {
                ex.nets.push(net);
                ex.positions.push(i);
            }
            None => {
                ex.complete = false;
                let path = format!("{}.exclude[{i}]", r.prefix);
                let shown = v
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| v.to_string());
                r.errors.push(Problem::with_value(
                    path,
                    shown,
                    "is not a CIDR or IP address",
                ));
            }
        }
    }
    ex
}

/// Turns a core range error into a problem naming the field the user wrote.
fn range_problem(
    prefix: &str,
    range_text: &str,
    excludes: &[IpNet],
    start: Option<IpAddr>,
    end: Option<IpAddr>,
    e: RangeError,
) -> Problem {
    let field = |b: Bound| format!("{prefix}.{b}");
    match e {
        RangeError::NoUsableAddress { .. } => Problem::with_value(
            format!("{prefix}.range"),
            range_text,
            "has no usable address (a prefix needs at least two host bits)",
        ),
        RangeError::FamilyMismatch { bound, value, cidr } => Problem::with_value(
            field(bound),
            value,
            format!("is not of the same address family as range {cidr}"),
        ),
        RangeError::Outside { bound, value, cidr } => {
            Problem::with_value(field(bound), value, format!("is outside range {cidr}"))
        }
        RangeError::Inverted { .. } => Problem::with_value(
            field(Bound::Start),
            start.map(|s| s.to_string()).unwrap_or_default(),
            format!(
                "is after range_end {}",
                end.map(|s| s.to_string()).unwrap_or_default()
            ),
        ),
        RangeError::AllExcluded { cidr, first, last } => Problem::with_value(
            format!("{prefix}.exclude"),
            excludes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            format!("leaves no usable address in range {cidr} (window {first} to {last})"),
        ),
    }
}
/// The top-level `node_slice_size` slices every range that has no size of its own (upstream
/// slices only the first range, which keeps its meaning); an `ipRanges` entry may carry its own,
/// as a single prefix length cannot fit a /24 and a /64 at once.
pub(super) fn check_node_slice(r: &mut Reader<'_>, ranges: &mut [RangeConfig]) {
    let Some(text) = r.string("node_slice_size").map(str::to_owned) else {
        return;
    };
    let path = r.path("node_slice_size");
    if parse_slice_size(&text).is_none() {
        r.errors.push(Problem::with_value(
            path,
            text,
            "is not a prefix length (for example /28, or 28)",
        ));
        return;
    }
    for range in ranges.iter_mut().filter(|g| g.node_slice.is_none()) {
        range.node_slice = node_slice(r, path.clone(), &text, &range.range);
    }
}

/// The slice size `text` (at `path`) for `range`, or `None` with the problem recorded.
fn node_slice(
    r: &mut Reader<'_>,
    path: String,
    text: &str,
    range: &AddrRange,
) -> Option<NodeSlice> {
    let Some(prefix) = parse_slice_size(text) else {
        r.errors.push(Problem::with_value(
            path,
            text,
            "is not a prefix length (for example /28, or 28)",
        ));
        return None;
    };
    let count = slice_count(range.cidr(), prefix);
    let too_many = (count > MAX_NODE_SLICES).then(|| format!(
        "cuts range {} into {count} slices; a NodeSlicePool lists every slice in one object and holds at most {MAX_NODE_SLICES} (about {NODE_SLICE_ENTRY_BYTES} bytes each under the API server's 1.5 MiB limit): use a larger slice",
        range.cidr()
    ));
    if let Some(why) = slice_size_problem(range.cidr(), prefix).or(too_many) {
        r.errors.push(Problem::with_value(path, text, why));
        return None;
    }
    Some(NodeSlice {
        prefix,
        text: text.to_owned(),
    })
}

/// The network name prefixes every pool and reservation name, so both must stay valid names.
pub(super) fn check_network_name(r: &mut Reader<'_>, name: &str, ranges: &[RangeConfig]) {
    let path = r.path("network_name");
    if let Some(why) = object_name_problem(name) {
        r.errors.push(Problem::with_value(
            path,
            name,
            format!("is not usable in object names: {why}"),
        ));
        return;
    }
    for range in ranges {
        let last = range.range.window().1;
        for object in [range.pool_name.clone(), reservation_name(Some(name), last)] {
            if let Some(why) = object_name_problem(&object) {
                r.errors.push(Problem::with_value(
                    path.clone(),
                    name,
                    format!("gives the object name {object:?}, which {why}"),
                ));
            }
        }
    }
}

/// Two ranges of one config whose windows overlap would hand out two addresses from one window to
/// each interface, which is never what was meant.
pub(super) fn check_overlaps(r: &mut Reader<'_>, ranges: &[RangeConfig]) {
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[..i] {
            if a.range.windows_overlap(&b.range) {
                r.errors.push(Problem::with_value(
                    a.path.clone(),
                    a.range.cidr(),
                    format!("overlaps {} ({})", b.path, b.range.cidr()),
                ));
            }
        }
    }
}
