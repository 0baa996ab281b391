//! The one retry policy: how long to wait before the next attempt, and how many attempts there
//! are, for every kind of retry in whereabouts. Each kind is a named [`Backoff`] below, so that
//! its bounds are stated once and read in one place.
//!
//! Waits grow exponentially and are jittered: losers of a race that all retried after the same
//! pause would race again in lockstep. Nothing here does I/O beyond sleeping.

use std::time::Duration;

/// How a wait is drawn below its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// The cap itself: the waiter is alone (one requeued job), nobody to fall out of step with.
    None,
    /// Anywhere from zero to the cap: losers of a race spread as widely as they can.
    Full,
    /// From half the cap to the cap: a sure pause (an API server recovering) that still spreads.
    Equal,
}

/// An exponential backoff: the cap of attempt `n` is `first * 2^n`, at most `max`; attempts up to
/// `immediate` go at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    /// Attempts `0..=immediate` do not wait (`None`: every attempt waits).
    pub immediate: Option<u32>,
    pub jitter: Jitter,
    /// How many attempts in all before giving up.
    pub attempts: u32,
}

/// A lost conditional write of a pool (another writer got in first): re-read after a short
/// pause, so that the losers do not re-read in lockstep. 5 ms, doubling, at most 80 ms.
pub const LOST_WRITE: Backoff = Backoff {
    first: Duration::from_millis(5),
    max: Duration::from_millis(80),
    immediate: None,
    jitter: Jitter::Full,
    attempts: MAX_CONFLICTS,
};

/// A lost claim of an address: the first few retries go at once (another address is picked, no
/// need to wait), then waits grow from 16 ms to at most 128 ms as losses pile up.
pub const LOST_RACE: Backoff = Backoff {
    first: Duration::from_millis(1),
    max: Duration::from_millis(128),
    immediate: Some(3),
    jitter: Jitter::Full,
    attempts: MAX_CONFLICTS,
};

/// Attempts of one allocation or release against one pool before it gives up with "try again
/// later": far more than a busy pool needs, few enough to end.
pub const MAX_CONFLICTS: u32 = 400;

/// A transient API failure (a dropped connection, an overloaded or restarting API server): six
/// attempts, waits of 40 to 640 ms. Retrying is safe because every write is conditional.
pub const TRANSIENT_API: Backoff = Backoff {
    first: Duration::from_millis(20),
    max: Duration::from_millis(640),
    immediate: Some(0),
    jitter: Jitter::Equal,
    attempts: 6,
};

/// The operator's release of a deleted pod's addresses, requeued after a failure (or a cache that
/// does not show the entries yet): 0.5 s, doubling, at most 32 s, nine attempts; the audit
/// catches anything left after that.
pub const POD_RELEASE: Backoff = Backoff {
    first: Duration::from_millis(500),
    max: Duration::from_millis(32_000),
    immediate: None,
    jitter: Jitter::None,
    attempts: 9,
};

impl Backoff {
    /// The longest wait before attempt `attempt` (counted from 0).
    pub fn cap(&self, attempt: u32) -> Duration {
        if self.immediate.is_some_and(|n| attempt <= n) {
            return Duration::ZERO;
        }
        let doubled = self
            .first
            .checked_mul(1u32.checked_shl(attempt).unwrap_or(u32::MAX))
            .unwrap_or(self.max);
        doubled.min(self.max)
    }

    /// The wait before attempt `attempt`, drawn by the jitter from below the cap.
    pub fn delay(&self, attempt: u32) -> Duration {
        let cap = self.cap(attempt).as_millis() as u64;
        let ms = match self.jitter {
            Jitter::None => cap,
            Jitter::Full => fastrand::u64(0..=cap),
            Jitter::Equal => fastrand::u64(cap / 2..=cap),
        };
        Duration::from_millis(ms)
    }

    /// Sleeps [`Backoff::delay`] (not at all when it is zero).
    pub async fn pause(&self, attempt: u32) {
        let delay = self.delay(attempt);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }

    /// Whether attempt `attempt` (counted from 0) is still allowed.
    pub fn allows(&self, attempt: u32) -> bool {
        attempt < self.attempts
    }

    /// Runs `call` until it succeeds, fails for good (`retryable` says no), or the attempts run
    /// out; waits [`Backoff::pause`] between attempts.
    pub async fn retry<T, E, F, Fut>(
        &self,
        mut call: F,
        retryable: impl Fn(&E) -> bool,
    ) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: std::fmt::Display,
    {
        let mut attempt = 0;
        loop {
            match call().await {
                Err(e) if self.allows(attempt + 1) && retryable(&e) => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "retrying a transient failure");
                    self.pause(attempt).await;
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The caps are those the four hand-written formulas had before this module.
    #[test]
    fn caps_as_before() {
        // `5 << min(attempt, 4)` ms.
        let lost_write: Vec<_> = (0..7).map(|a| LOST_WRITE.cap(a)).collect();
        assert_eq!(lost_write, [5, 10, 20, 40, 80, 80, 80].map(ms));
        // Nothing up to 3 losses, then `2^min(losses, 7)` ms.
        let lost_race: Vec<_> = (0..10).map(|a| LOST_RACE.cap(a)).collect();
        assert_eq!(lost_race, [0, 0, 0, 0, 16, 32, 64, 128, 128, 128].map(ms));
        // `20 << attempt` ms for attempts 1 to 5.
        let api: Vec<_> = (1..6).map(|a| TRANSIENT_API.cap(a)).collect();
        assert_eq!(api, [40, 80, 160, 320, 640].map(ms));
        // `500 << min(attempt, 6)` ms for the requeues after attempts 0 to 8.
        let pod: Vec<_> = (0..9).map(|a| POD_RELEASE.cap(a)).collect();
        assert_eq!(
            pod,
            [500, 1000, 2000, 4000, 8000, 16000, 32000, 32000, 32000].map(ms)
        );
    }

    #[test]
    fn delays_stay_within_their_jitter() {
        for attempt in 0..40 {
            for b in [LOST_WRITE, LOST_RACE, TRANSIENT_API, POD_RELEASE] {
                let (cap, d) = (b.cap(attempt), b.delay(attempt));
                assert!(d <= cap, "{b:?} attempt {attempt}: {d:?} > {cap:?}");
                match b.jitter {
                    Jitter::None => assert_eq!(d, cap),
                    Jitter::Equal => assert!(d >= cap / 2),
                    Jitter::Full => {}
                }
            }
        }
        // Huge attempt numbers neither overflow nor pass the cap.
        assert_eq!(LOST_WRITE.cap(u32::MAX), ms(80));
    }

    #[tokio::test]
    async fn retry_stops_at_the_bound_and_at_a_lasting_failure() {
        let quick = Backoff {
            first: ms(1),
            max: ms(1),
            immediate: None,
            jitter: Jitter::None,
            attempts: 4,
        };
        let mut calls = 0;
        let r: Result<(), String> = quick
            .retry(
                || {
                    calls += 1;
                    async { Err("busy".to_owned()) }
                },
                |_| true,
            )
            .await;
        assert_eq!((r, calls), (Err("busy".into()), 4));
        let mut calls = 0;
        let r: Result<(), String> = quick
            .retry(
                || {
                    calls += 1;
                    async { Err("gone".to_owned()) }
                },
                |e| e != "gone",
            )
            .await;
        assert_eq!((r, calls), (Err("gone".into()), 1));
    }
}
