//! One allocatable range: a CIDR, its usable window and its excluded blocks.
//!
//! Positions are *offsets* from the network address, the unit the IPPool stores as its allocation
//! keys. The window is `network+1 ..= broadcast-1`, narrowed by `range_start`/`range_end`; excluded
//! CIDRs are merged into sorted disjoint blocks, so a walk over free offsets jumps a block in one
//! step and costs O(allocations + excludes), never O(size of the range).

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use thiserror::Error;

use super::addr::{Family, from_u128, to_u128};

/// Which bound of a range an error speaks of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Start,
    End,
    Exclude(usize),
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::Start => f.write_str("range_start"),
            Bound::End => f.write_str("range_end"),
            Bound::Exclude(i) => write!(f, "exclude[{i}]"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RangeError {
    #[error("range {cidr} has no usable address (a prefix needs at least two host bits)")]
    NoUsableAddress { cidr: IpNet },
    #[error("{bound} {value} is not of the same address family as range {cidr}")]
    FamilyMismatch {
        bound: Bound,
        value: String,
        cidr: IpNet,
    },
    #[error("{bound} {value} is outside range {cidr}")]
    Outside {
        bound: Bound,
        value: IpAddr,
        cidr: IpNet,
    },
    #[error("range_start {start} is after range_end {end}")]
    Inverted { start: IpAddr, end: IpAddr },
    #[error("exclude leaves no usable address in range {cidr} (window {first} to {last})")]
    AllExcluded {
        cidr: IpNet,
        first: IpAddr,
        last: IpAddr,
    },
}

/// A contiguous block of offsets, both ends inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Block {
    first: u128,
    last: u128,
}

/// A validated range. Construction is the only place bounds are checked, so every `AddrRange`
/// in the program has a non-empty window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddrRange {
    cidr: IpNet,
    family: Family,
    base: u128,
    first: u128,
    last: u128,
    excludes: Vec<IpNet>,
    blocks: Vec<Block>,
}

impl AddrRange {
    /// Builds the window of `cidr` (host bits dropped), narrowed by `start`/`end` and with
    /// `excludes` removed. A start at the network address is moved to the first usable address, as
    /// upstream does; anything outside the CIDR is an error instead of being silently ignored.
    pub fn new(
        cidr: IpNet,
        start: Option<IpAddr>,
        end: Option<IpAddr>,
        excludes: &[IpNet],
    ) -> Result<Self, RangeError> {
        let cidr = cidr.trunc();
        let family = Family::of(cidr.addr());
        let host_bits = cidr.max_prefix_len() - cidr.prefix_len();
        if host_bits < 2 {
            return Err(RangeError::NoUsableAddress { cidr });
        }
        let base = to_u128(cidr.network());
        let span = if host_bits == 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        };
        let (mut first, mut last) = (1u128, span - 1);
        if let Some(ip) = start {
            first = first.max(offset_in(cidr, family, base, Bound::Start, ip)?);
        }
        if let Some(ip) = end {
            last = last.min(offset_in(cidr, family, base, Bound::End, ip)?);
        }
        if first > last {
            let (start, end) = (
                start.unwrap_or(cidr.network()),
                end.unwrap_or(cidr.broadcast()),
            );
            return Err(RangeError::Inverted { start, end });
        }
        let blocks = merge_excludes(cidr, family, base, excludes, first, last)?;
        let range = AddrRange {
            cidr,
            family,
            base,
            first,
            last,
            excludes: excludes.iter().map(IpNet::trunc).collect(),
            blocks,
        };
        if range.size() == 0 {
            let (first, last) = range.window();
            return Err(RangeError::AllExcluded { cidr, first, last });
        }
        Ok(range)
    }

    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    pub fn family(&self) -> Family {
        self.family
    }

    /// The excluded CIDRs as configured (host bits dropped), including any outside the window.
    pub fn excludes(&self) -> &[IpNet] {
        &self.excludes
    }

    /// First and last allocatable address before excludes.
    pub fn window(&self) -> (IpAddr, IpAddr) {
        (
            self.addr_at(self.first).expect("window inside cidr"),
            self.addr_at(self.last).expect("window inside cidr"),
        )
    }

    /// Number of allocatable addresses: the window less the excluded blocks. IPv6 sizes can exceed
    /// 2^64, hence `u128`.
    pub fn size(&self) -> u128 {
        let excluded: u128 = self.blocks.iter().map(|b| b.last - b.first + 1).sum();
        (self.last - self.first + 1) - excluded
    }

    /// The offset of `ip` from the network address, if `ip` is inside the CIDR.
    pub fn offset_of(&self, ip: IpAddr) -> Option<u128> {
        (Family::of(ip) == self.family && self.cidr.contains(&ip)).then(|| to_u128(ip) - self.base)
    }

    /// The address at `offset`, if the offset lies inside the CIDR.
    pub fn addr_at(&self, offset: u128) -> Option<IpAddr> {
        let host_bits = self.cidr.max_prefix_len() - self.cidr.prefix_len();
        if host_bits < 128 && offset >> host_bits != 0 {
            return None;
        }
        from_u128(self.family, self.base + offset)
    }

    /// True when the offset is in the window and not excluded: an address this range may hand out.
    pub fn is_allocatable(&self, offset: u128) -> bool {
        offset >= self.first
            && offset <= self.last
            && !self
                .blocks
                .iter()
                .any(|b| b.first <= offset && offset <= b.last)
    }

    /// Why `ip` is not an address this range may hand out, in words that name the range; `None`
    /// when it may. Requested addresses are judged by this.
    pub fn refusal(&self, ip: IpAddr) -> Option<String> {
        let Some(offset) = self.offset_of(ip) else {
            return Some(format!("is outside range {}", self.cidr));
        };
        if offset < self.first || offset > self.last {
            let (first, last) = self.window();
            return Some(format!(
                "is outside the usable window {first} to {last} of range {}",
                self.cidr
            ));
        }
        self.excludes
            .iter()
            .find(|net| net.contains(&ip))
            .map(|net| format!("is excluded from range {} (exclude {net})", self.cidr))
    }

    /// True when `net` shares at least one address with the window.
    pub fn window_touches(&self, net: &IpNet) -> bool {
        let (lo, hi) = (to_u128(net.network()), to_u128(net.broadcast()));
        Family::of(net.addr()) == self.family
            && lo <= self.base + self.last
            && hi >= self.base + self.first
    }

    /// The window's first and last address as integers, for ordering and comparing windows.
    pub fn window_bounds(&self) -> (u128, u128) {
        (self.base + self.first, self.base + self.last)
    }

    /// True when the two ranges' windows share at least one address.
    pub fn windows_overlap(&self, other: &AddrRange) -> bool {
        self.family == other.family
            && self.base + self.first <= other.base + other.last
            && other.base + other.first <= self.base + self.last
    }

    /// Free offsets in ascending order, skipping `taken` offsets and excluded blocks.
    pub fn free<'a>(&'a self, taken: &'a BTreeSet<u128>) -> Free<'a> {
        Free {
            range: self,
            taken,
            next: Some(self.first),
            block: 0,
        }
    }

    /// Number of allocatable addresses not in `taken` (entries outside the window do not count).
    pub fn free_count(&self, taken: &BTreeSet<u128>) -> u128 {
        let used = taken
            .range(self.first..=self.last)
            .filter(|o| self.is_allocatable(**o))
            .count();
        self.size() - used as u128
    }

    /// Chooses the offset to claim. The first attempt takes the lowest free address (the order
    /// users rely on). After a lost race, concurrent claimants would all collide on the same
    /// "next lowest" address, so later attempts pick at random among the first few free addresses,
    /// the choice widening with each attempt; allocations stay packed at the bottom of the window.
    pub fn pick(
        &self,
        taken: &BTreeSet<u128>,
        attempt: u32,
        random_below: impl FnOnce(usize) -> usize,
    ) -> Option<u128> {
        if attempt == 0 {
            return self.free(taken).next();
        }
        let spread = 4usize << attempt.min(8);
        let candidates: Vec<u128> = self.free(taken).take(spread).collect();
        if candidates.is_empty() {
            return None;
        }
        let index = random_below(candidates.len()).min(candidates.len() - 1);
        Some(candidates[index])
    }
}

/// Iterator over the free offsets of a range.
pub struct Free<'a> {
    range: &'a AddrRange,
    taken: &'a BTreeSet<u128>,
    next: Option<u128>,
    block: usize,
}

impl Iterator for Free<'_> {
    type Item = u128;

    fn next(&mut self) -> Option<u128> {
        let blocks = &self.range.blocks;
        loop {
            let candidate = self.next.filter(|c| *c <= self.range.last)?;
            while self.block < blocks.len() && blocks[self.block].last < candidate {
                self.block += 1;
            }
            if let Some(b) = blocks.get(self.block).filter(|b| b.first <= candidate) {
                self.next = b.last.checked_add(1);
                continue;
            }
            // Jump over a run of taken offsets, one ordered step at a time.
            match self.taken.range(candidate..).next() {
                Some(t) if *t == candidate => self.next = candidate.checked_add(1),
                _ => {
                    self.next = candidate.checked_add(1);
                    return Some(candidate);
                }
            }
        }
    }
}

fn offset_in(
    cidr: IpNet,
    family: Family,
    base: u128,
    bound: Bound,
    ip: IpAddr,
) -> Result<u128, RangeError> {
    if Family::of(ip) != family {
        return Err(RangeError::FamilyMismatch {
            bound,
            value: ip.to_string(),
            cidr,
        });
    }
    if !cidr.contains(&ip) {
        return Err(RangeError::Outside {
            bound,
            value: ip,
            cidr,
        });
    }
    Ok(to_u128(ip) - base)
}

/// Clips every exclude to the window and merges overlapping or adjacent blocks. Excludes of the
/// wrong family are errors; excludes outside the range are legal (and warned about elsewhere).
fn merge_excludes(
    cidr: IpNet,
    family: Family,
    base: u128,
    excludes: &[IpNet],
    first: u128,
    last: u128,
) -> Result<Vec<Block>, RangeError> {
    let mut blocks = Vec::with_capacity(excludes.len());
    for (i, net) in excludes.iter().enumerate() {
        if Family::of(net.addr()) != family {
            return Err(RangeError::FamilyMismatch {
                bound: Bound::Exclude(i),
                value: net.to_string(),
                cidr,
            });
        }
        let (lo, hi) = (to_u128(net.network()), to_u128(net.broadcast()));
        if hi < base + first || lo > base + last {
            continue;
        }
        blocks.push(Block {
            first: lo.max(base + first) - base,
            last: hi.min(base + last) - base,
        });
    }
    blocks.sort();
    let mut merged: Vec<Block> = Vec::with_capacity(blocks.len());
    for b in blocks {
        match merged.last_mut() {
            Some(m) if b.first <= m.last.saturating_add(1) => m.last = m.last.max(b.last),
            _ => merged.push(b),
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests;
