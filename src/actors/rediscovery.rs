//! Which prefill workers are known to be down, and when an engine's topology must be asked
//! again. A P engine restarted behind the same bootstrap URL comes back on new worker ports; the
//! only way D learns them is a fresh `GET /query`, and the only hint that one is needed is a
//! peer's channel failure.
//!
//! Why a shared plain struct and not a message: the Peer is the one that sees the failure, but
//! data flows Receiver -> Peer -> aggregator, never back (DESIGN.md §3). So the Receiver owns
//! this struct and gives each Peer a write-only [`PeerHealth`] handle at construction; the Peer
//! records "down until" on a restart and "up" on a clean FINISH, and the Receiver reads the
//! record the next time it needs that engine's topology (lazily: no message, no extra wakeup).
//! Receiver and Peers live on one arbiter (they already share an `Rc` transport), so an
//! `Rc<RefCell<_>>` is enough; every borrow is short and never held across an await.
//!
//! The policy, with time passed in so it is tested without sleeping:
//! - a batch for an engine whose topology names a down peer fails at once (no pull is sent, so
//!   nothing can be written: Failed, not Uncertain) instead of waiting out the peer's backoff;
//! - such an engine's cached topology is dropped and asked again, at most once per backoff step
//!   (base, doubled per consecutive attempt, capped), so a live bootstrap server that still lists
//!   the dead workers is not asked on every batch;
//! - after a failed lookup (bootstrap down, engine not registered yet) batches fail at once
//!   without asking until the same backoff has passed: a dead bootstrap server is not hammered.

#![forbid(unsafe_code)]

use crate::fast_hash::FastMap;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::messages::PeerId;

/// Now, on the clock rediscovery keeps its times on: tokio's (the one the Peers' deadlines
/// and the idle sweep use), so that one read per batch serves them all, and a test that pauses
/// tokio's clock governs every one of them.
pub fn clock_now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// `(bootstrap address, engine id)`: one cached topology.
pub type EngineKey = (crate::messages::SharedStr, crate::messages::SharedStr);

/// Backoff between lookups of one engine while it is unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RediscoveryConfig {
    pub base: Duration,
    pub max: Duration,
}

impl RediscoveryConfig {
    /// Wait before the next lookup after `n` consecutive unhealthy ones (n >= 1).
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvrecv::actors::rediscovery::RediscoveryConfig;
    /// let c = RediscoveryConfig { base: Duration::from_millis(100), max: Duration::from_millis(300) };
    /// assert_eq!(c.backoff(1), Duration::from_millis(100));
    /// assert_eq!(c.backoff(2), Duration::from_millis(200));
    /// assert_eq!(c.backoff(40), Duration::from_millis(300));
    /// ```
    pub fn backoff(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }
}

/// Why a batch was failed without asking anyone.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Unreachable {
    #[error("peer {peer} is down ({reason}); not retried for {}", crate::millis::Millis::of(.retry_in))]
    PeerDown {
        peer: PeerId,
        reason: String,
        retry_in: Duration,
    },
    #[error("{last_error}; bootstrap not asked again for {}", crate::millis::Millis::of(.retry_in))]
    LookupBackoff {
        last_error: String,
        retry_in: Duration,
    },
}

/// What the Receiver does before a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Look up as usual (the cache answers when it holds the engine).
    Lookup,
    /// Drop the cached topology first: a peer it names is down, P may have moved.
    Refresh,
    /// Do not ask: fail the batch at once.
    Fail(Unreachable),
}

struct Down {
    until: Instant,
    reason: String,
}

#[derive(Default)]
struct Engine {
    /// This D worker's peers in the last topology seen.
    peers: Vec<PeerId>,
    /// The last lookup failed with this (nothing is cached).
    last_error: Option<String>,
    /// Consecutive unhealthy lookups (failed, or naming a down peer).
    attempts: u32,
    /// No new query before this.
    next_lookup: Option<Instant>,
    /// When a batch last named the engine (see [`Rediscovery::forget_idle`]).
    last_seen: Option<Instant>,
}

/// Peer health and per-engine lookup backoff. See the module docs.
pub struct Rediscovery {
    cfg: RediscoveryConfig,
    down: FastMap<PeerId, Down>,
    engines: FastMap<EngineKey, Engine>,
}

impl Rediscovery {
    pub fn new(cfg: RediscoveryConfig) -> Self {
        Rediscovery {
            cfg,
            down: FastMap::default(),
            engines: FastMap::default(),
        }
    }

    /// The peer's channel failed; it serves nothing before `until` (its restart backoff).
    pub fn peer_down(&mut self, peer: &PeerId, until: Instant, reason: String) {
        self.down.insert(peer.clone(), Down { until, reason });
    }

    /// The peer answered a whole pull.
    pub fn peer_up(&mut self, peer: &PeerId) {
        // Every clean pull says so: no hashing of its address while no peer is down.
        if !self.down.is_empty() {
            self.down.remove(peer);
        }
    }

    /// The first of `peers` that is down at `now`, with how long it stays down.
    pub fn down_peer(&self, peers: &[PeerId], now: Instant) -> Option<Unreachable> {
        peers.iter().find_map(|p| {
            let d = self.down.get(p).filter(|d| d.until > now)?;
            Some(Unreachable::PeerDown {
                peer: p.clone(),
                reason: d.reason.clone(),
                retry_in: d.until - now,
            })
        })
    }

    /// Whether the topology last seen for `key` names a peer that is down or was down since
    /// (a peer whose backoff ran out without a successful pull may still be gone).
    fn names_failed_peer(down: &FastMap<PeerId, Down>, e: &Engine) -> bool {
        !down.is_empty() && e.peers.iter().any(|p| down.contains_key(p))
    }

    fn backoff_left(e: &Engine, now: Instant) -> Option<Duration> {
        e.next_lookup
            .filter(|t| *t > now)
            .map(|t| t.saturating_duration_since(now))
    }

    /// Before looking `key` up for a batch.
    pub fn plan(&mut self, key: &EngineKey, now: Instant) -> Plan {
        // One lookup of the engine per batch (this runs for every batch).
        let Some(e) = self.engines.get_mut(key) else {
            return Plan::Lookup;
        };
        e.last_seen = Some(now);
        let wait = Self::backoff_left(e, now);
        if let Some(err) = &e.last_error {
            return match wait {
                Some(retry_in) => Plan::Fail(Unreachable::LookupBackoff {
                    last_error: err.clone(),
                    retry_in,
                }),
                None => Plan::Lookup,
            };
        }
        if wait.is_none() && Self::names_failed_peer(&self.down, e) {
            e.attempts += 1;
            e.next_lookup = Some(now + self.cfg.backoff(e.attempts));
            return Plan::Refresh;
        }
        Plan::Lookup
    }

    /// The lookup failed: nothing is cached; ask again only after the backoff.
    pub fn lookup_failed(&mut self, key: &EngineKey, error: String, now: Instant) {
        let e = self.engines.entry(key.clone()).or_default();
        e.last_seen = Some(now);
        e.last_error = Some(error);
        e.attempts += 1;
        e.next_lookup = Some(now + self.cfg.backoff(e.attempts));
    }

    /// The lookup gave these peers for this D worker. Returns the first one that is down now:
    /// the batch must fail at once rather than wait for that peer's backoff.
    pub fn lookup_ok(
        &mut self,
        key: &EngineKey,
        peers: &[PeerId],
        now: Instant,
    ) -> Option<Unreachable> {
        let (down, healthy) = if self.down.is_empty() {
            (None, true)
        } else {
            let down = self.down_peer(peers, now);
            (down, !peers.iter().any(|p| self.down.contains_key(p)))
        };
        // A known engine's key is not cloned (and dropped) for nothing.
        let e = match self.engines.get_mut(key) {
            Some(e) => e,
            None => self.engines.entry(key.clone()).or_default(),
        };
        e.last_seen = Some(now);
        e.last_error = None;
        if healthy {
            e.attempts = 0;
            e.next_lookup = None;
        }
        if e.peers.as_slice() != peers {
            // P moved: forget the records of workers no topology names any more.
            let old = std::mem::replace(&mut e.peers, peers.to_vec());
            for p in old {
                if !self.engines.values().any(|e| e.peers.contains(&p)) {
                    self.down.remove(&p);
                }
            }
        }
        down
    }

    /// Forget the engines no batch named for `idle` whose lookup backoff is over, and the
    /// down records no remaining engine names whose backoff is over: an engine that came and
    /// went (a P deployment replaced, a bootstrap address seen once) leaves nothing behind.
    /// Returns the engines forgotten, whose cached topologies the caller drops too; a later
    /// batch naming one looks it up afresh.
    pub fn forget_idle(&mut self, now: Instant, idle: Duration) -> Vec<EngineKey> {
        let stale = |e: &Engine| {
            e.last_seen
                .is_none_or(|t| now.saturating_duration_since(t) >= idle)
                && e.next_lookup.is_none_or(|t| t <= now)
        };
        let gone: Vec<EngineKey> = self
            .engines
            .iter()
            .filter(|(_, e)| stale(e))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &gone {
            self.engines.remove(k);
        }
        let engines = &self.engines;
        self.down
            .retain(|p, d| d.until > now || engines.values().any(|e| e.peers.contains(p)));
        gone
    }
}

/// The Peer's write-only view of [`Rediscovery`] (see the module docs for why a handle).
#[derive(Clone)]
pub struct PeerHealth(Rc<RefCell<Rediscovery>>);

impl PeerHealth {
    pub fn new(shared: Rc<RefCell<Rediscovery>>) -> Self {
        PeerHealth(shared)
    }

    pub fn down(&self, peer: &PeerId, until: Instant, reason: String) {
        self.0.borrow_mut().peer_down(peer, until, reason);
    }

    pub fn up(&self, peer: &PeerId) {
        self.0.borrow_mut().peer_up(peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn reasons_give_the_backoff_in_milliseconds() {
        let down = Unreachable::PeerDown {
            peer: PeerId::new("p"),
            reason: "closed".into(),
            retry_in: Duration::from_nanos(183_669_025),
        };
        assert!(
            down.to_string().ends_with("not retried for 184 ms"),
            "{down}"
        );
        let lookup = Unreachable::LookupBackoff {
            last_error: "refused".into(),
            retry_in: Duration::from_secs(2),
        };
        assert_eq!(
            lookup.to_string(),
            "refused; bootstrap not asked again for 2000 ms"
        );
    }

    fn r() -> Rediscovery {
        Rediscovery::new(RediscoveryConfig {
            base: 100 * MS,
            max: 400 * MS,
        })
    }

    fn key() -> EngineKey {
        ("http://b:1".into(), "e0".into())
    }

    fn p(n: u32) -> PeerId {
        PeerId::new(format!("tcp://p:{n}"))
    }

    /// Engines no batch named for the idle time are forgotten (with the down records only they
    /// named), unless their lookup backoff still runs; a batch naming one keeps it.
    #[test]
    fn idle_engines_are_forgotten_with_their_down_peers() {
        let (mut r, t0) = (r(), Instant::now());
        let other: EngineKey = ("http://b:2".into(), "e1".into());
        let failing: EngineKey = ("http://b:3".into(), "e2".into());
        r.lookup_ok(&key(), &[p(1)], t0);
        r.lookup_ok(&other, &[p(2)], t0);
        r.peer_down(&p(2), t0 + 10 * MS, "refused".into());
        assert_eq!(r.forget_idle(t0 + 500 * MS, 1000 * MS), vec![]);
        // `key` is named again; `other` is not.
        r.plan(&key(), t0 + 900 * MS);
        r.lookup_failed(&failing, "refused".into(), t0 + 900 * MS);
        let gone = r.forget_idle(t0 + 1500 * MS, 1000 * MS);
        assert_eq!(gone, vec![other.clone()]);
        assert!(
            r.down.is_empty(),
            "p2's record went with the only engine naming it"
        );
        // Idle, but its lookup backoff (100 ms from t0 + 900) is over only later.
        r.lookup_failed(&failing, "refused".into(), t0 + 1999 * MS);
        assert_eq!(r.forget_idle(t0 + 2000 * MS, Duration::ZERO), vec![key()]);
        assert_eq!(r.forget_idle(t0 + 2300 * MS, Duration::ZERO), vec![failing]);
        assert!(r.engines.is_empty());
    }

    #[test]
    fn healthy_engine_uses_the_cache() {
        let (mut r, t0) = (r(), Instant::now());
        assert_eq!(r.plan(&key(), t0), Plan::Lookup);
        assert_eq!(r.lookup_ok(&key(), &[p(1), p(2)], t0), None);
        assert_eq!(r.plan(&key(), t0 + 10 * MS), Plan::Lookup);
    }

    #[test]
    fn a_down_peer_fails_batches_at_once_and_refreshes_at_most_once_per_backoff() {
        let (mut r, t0) = (r(), Instant::now());
        r.lookup_ok(&key(), &[p(1), p(2)], t0);
        r.peer_down(&p(2), t0 + 60_000 * MS, "connection refused".into());
        // First batch after the failure: drop the cache and ask again.
        assert_eq!(r.plan(&key(), t0), Plan::Refresh);
        // Bootstrap still lists the dead worker: fail at once, naming it.
        let down = r.lookup_ok(&key(), &[p(1), p(2)], t0 + MS);
        assert!(
            matches!(&down, Some(Unreachable::PeerDown { peer, .. }) if *peer == p(2)),
            "{down:?}"
        );
        // Within the backoff: no new query, the cached view fails the batch at once.
        assert_eq!(r.plan(&key(), t0 + 50 * MS), Plan::Lookup);
        assert!(r.lookup_ok(&key(), &[p(1), p(2)], t0 + 50 * MS).is_some());
        // Backoff steps double: 100 ms, then 200 ms.
        assert_eq!(r.plan(&key(), t0 + 100 * MS), Plan::Refresh);
        r.lookup_ok(&key(), &[p(1), p(2)], t0 + 100 * MS);
        assert_eq!(r.plan(&key(), t0 + 299 * MS), Plan::Lookup);
        assert_eq!(r.plan(&key(), t0 + 300 * MS), Plan::Refresh);
        // P came back on a new port: the refresh finds it, all healthy, the backoff resets.
        assert_eq!(r.lookup_ok(&key(), &[p(1), p(3)], t0 + 301 * MS), None);
        assert_eq!(r.plan(&key(), t0 + 302 * MS), Plan::Lookup);
        // The moved-away worker's record is forgotten.
        assert!(r.down.is_empty());
    }

    #[test]
    fn a_peer_whose_backoff_ran_out_is_probed_but_the_engine_is_still_refreshed() {
        let (mut r, t0) = (r(), Instant::now());
        r.lookup_ok(&key(), &[p(1)], t0);
        r.peer_down(&p(1), t0 + 10 * MS, "restarted".into());
        assert_eq!(r.plan(&key(), t0 + 20 * MS), Plan::Refresh);
        // Same address again, backoff over: the pull is sent (a probe).
        assert_eq!(r.lookup_ok(&key(), &[p(1)], t0 + 20 * MS), None);
        r.peer_up(&p(1));
        assert_eq!(r.lookup_ok(&key(), &[p(1)], t0 + 30 * MS), None);
        assert_eq!(r.plan(&key(), t0 + 40 * MS), Plan::Lookup);
    }

    #[test]
    fn a_failed_lookup_is_not_repeated_before_its_backoff() {
        let (mut r, t0) = (r(), Instant::now());
        r.lookup_failed(&key(), "connection refused".into(), t0);
        assert!(matches!(
            r.plan(&key(), t0 + 99 * MS),
            Plan::Fail(Unreachable::LookupBackoff { ref last_error, retry_in })
                if last_error == "connection refused" && retry_in == MS
        ));
        assert_eq!(r.plan(&key(), t0 + 100 * MS), Plan::Lookup);
        r.lookup_failed(&key(), "connection refused".into(), t0 + 100 * MS);
        // Second failure: 200 ms.
        assert!(matches!(r.plan(&key(), t0 + 299 * MS), Plan::Fail(_)));
        assert_eq!(r.plan(&key(), t0 + 300 * MS), Plan::Lookup);
        r.lookup_failed(&key(), "x".into(), t0 + 300 * MS);
        r.lookup_failed(&key(), "x".into(), t0 + 700 * MS);
        // Capped at 400 ms.
        assert_eq!(r.plan(&key(), t0 + 1100 * MS), Plan::Lookup);
        // Success clears it.
        assert_eq!(r.lookup_ok(&key(), &[p(1)], t0 + 1100 * MS), None);
        assert_eq!(r.plan(&key(), t0 + 1101 * MS), Plan::Lookup);
    }

    #[test]
    fn other_engines_are_not_affected() {
        let (mut r, t0) = (r(), Instant::now());
        let other: EngineKey = ("http://b:1".into(), "e1".into());
        r.lookup_ok(&key(), &[p(1)], t0);
        r.lookup_ok(&other, &[p(2)], t0);
        r.peer_down(&p(1), t0 + 1000 * MS, "refused".into());
        assert_eq!(r.plan(&other, t0), Plan::Lookup);
        assert_eq!(r.lookup_ok(&other, &[p(2)], t0), None);
        assert_eq!(r.plan(&key(), t0), Plan::Refresh);
    }
}
