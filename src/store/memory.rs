//! An in-memory [`Store`] with the same conditional semantics as the Kubernetes one, for fast tests
//! of the CNI handlers (including concurrency) without a cluster.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Pool, Reservation, Result, Store, StoreError, Write};
use crate::crd::{IPAllocation, OverlappingRangeIPReservationSpec};

#[derive(Default)]
pub struct MemoryStore {
    state: Mutex<State>,
    next: AtomicU64,
    /// When set, every call fails with this message (to test error paths).
    pub fail: Mutex<Option<String>>,
}

#[derive(Default, Clone)]
struct State {
    pools: BTreeMap<String, (String, BTreeMap<u128, IPAllocation>, u64)>,
    reservations: BTreeMap<String, Reservation>,
    /// The pool and address each reservation was claimed for.
    claims: BTreeMap<String, (String, std::net::IpAddr)>,
    pods: HashMap<String, String>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_pod(&self, podref: &str, uid: &str) {
        self.state
            .lock()
            .unwrap()
            .pods
            .insert(podref.into(), uid.into());
    }

    pub fn reservation_names(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap()
            .reservations
            .keys()
            .cloned()
            .collect()
    }

    /// Makes every reservation look `secs` older, as if time had passed.
    pub fn age_reservations(&self, secs: i64) {
        for r in self.state.lock().unwrap().reservations.values_mut() {
            r.created = r.created.map(|c| c - secs);
        }
    }

    /// Writes an entry directly, as another writer (an upstream plugin) would.
    pub fn put_entry(&self, pool: &str, range: &str, offset: u128, entry: IPAllocation) {
        let mut s = self.state.lock().unwrap();
        let p = s
            .pools
            .entry(pool.into())
            .or_insert_with(|| (range.into(), BTreeMap::new(), 1));
        p.1.insert(offset, entry);
        p.2 += 1;
    }

    fn check(&self, op: &'static str, object: &str) -> Result<()> {
        match self.fail.lock().unwrap().clone() {
            Some(message) => Err(StoreError::Api {
                op,
                object: object.into(),
                code: 500,
                message,
            }),
            None => Ok(()),
        }
    }

    fn with_pool(
        &self,
        op: &'static str,
        pool: &str,
        f: impl FnOnce(&mut BTreeMap<u128, IPAllocation>, u64) -> Write,
    ) -> Result<Write> {
        self.check(op, pool)?;
        let mut s = self.state.lock().unwrap();
        let Some((_, allocations, rv)) = s.pools.get_mut(pool) else {
            return Ok(Write::Missing);
        };
        let outcome = f(allocations, *rv);
        if outcome == Write::Done {
            *rv += 1;
        }
        Ok(outcome)
    }
}

fn same_owner(current: &IPAllocation, expected: &IPAllocation) -> bool {
    current.id == expected.id && current.podref == expected.podref
}

impl Store for MemoryStore {
    async fn get_pool(&self, name: &str) -> Result<Option<Pool>> {
        self.check("get", name)?;
        let s = self.state.lock().unwrap();
        Ok(s.pools.get(name).map(|(range, allocations, rv)| Pool {
            name: name.into(),
            range: range.clone(),
            allocations: allocations.clone(),
            resource_version: rv.to_string(),
        }))
    }

    async fn create_pool(&self, name: &str, range: &str) -> Result<Write> {
        self.check("create", name)?;
        let mut s = self.state.lock().unwrap();
        if s.pools.contains_key(name) {
            return Ok(Write::Conflict);
        }
        s.pools
            .insert(name.into(), (range.into(), BTreeMap::new(), 1));
        Ok(Write::Done)
    }

    async fn add_allocations(
        &self,
        pool: &str,
        entries: &[(u128, IPAllocation)],
        resource_version: &str,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, rv| {
            if rv.to_string() != resource_version {
                return Write::Conflict;
            }
            for (offset, entry) in entries {
                allocations.insert(*offset, entry.clone());
            }
            Write::Done
        })
    }

    async fn replace_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
        entry: &IPAllocation,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, _| {
            match allocations.get_mut(&offset) {
                Some(current) if same_owner(current, expected) => {
                    *current = entry.clone();
                    Write::Done
                }
                _ => Write::Conflict,
            }
        })
    }

    async fn remove_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, _| {
            match allocations.get(&offset) {
                Some(current) if same_owner(current, expected) => {
                    allocations.remove(&offset);
                    Write::Done
                }
                _ => Write::Conflict,
            }
        })
    }

    async fn create_reservation(
        &self,
        name: &str,
        spec: &OverlappingRangeIPReservationSpec,
        pool: &str,
        ip: std::net::IpAddr,
    ) -> Result<(Write, String)> {
        self.check("create", name)?;
        let mut s = self.state.lock().unwrap();
        if s.reservations.contains_key(name) {
            return Ok((Write::Conflict, String::new()));
        }
        let uid = format!("uid-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let now = super::now_secs();
        s.reservations.insert(
            name.into(),
            Reservation {
                name: name.into(),
                uid: uid.clone(),
                spec: spec.clone(),
                created: Some(now),
            },
        );
        s.claims.insert(name.into(), (pool.into(), ip));
        Ok((Write::Done, uid))
    }

    async fn claims_of(
        &self,
        pool: &str,
    ) -> Result<Vec<(std::net::IpAddr, OverlappingRangeIPReservationSpec)>> {
        self.check("list", pool)?;
        let s = self.state.lock().unwrap();
        Ok(s.claims
            .iter()
            .filter(|(_, (p, _))| p == pool)
            .filter_map(|(name, (_, ip))| Some((*ip, s.reservations.get(name)?.spec.clone())))
            .collect())
    }

    async fn get_reservation(&self, name: &str) -> Result<Option<Reservation>> {
        self.check("get", name)?;
        Ok(self.state.lock().unwrap().reservations.get(name).cloned())
    }

    async fn delete_reservation(&self, name: &str, uid: &str) -> Result<Write> {
        self.check("delete", name)?;
        let mut s = self.state.lock().unwrap();
        match s.reservations.get(name) {
            None => Ok(Write::Missing),
            Some(r) if r.uid != uid => Ok(Write::Conflict),
            Some(_) => {
                s.reservations.remove(name);
                s.claims.remove(name);
                Ok(Write::Done)
            }
        }
    }

    async fn pod_uids(&self) -> Result<HashMap<String, String>> {
        self.check("list", "pods")?;
        Ok(self.state.lock().unwrap().pods.clone())
    }
}
