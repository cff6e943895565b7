//! The open connections of one listener (data server, handshake daemon): each one's peer
//! address, phase and last activity, so that a cap never locks new peers out. At a cap the
//! connection idle longest is closed to make room (a live TE reconnects; a leaked or hostile
//! socket is the cheapest thing to lose); a new connection is refused only when every
//! connection in its way is inside a request. Two caps: the listener's, and a lower one per
//! peer address, so one host (a TE that leaks connections, a flood) only ever evicts its own.

#![forbid(unsafe_code)]

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

use crate::fast_hash::FastMap;

/// Where a connection is in its life, as eviction sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Phase {
    /// Waiting for a request (or between two): evictable.
    Idle = 0,
    /// Inside a request (a payload landing, a handshake being answered): never evicted.
    Busy = 1,
    /// Handshake answered, waiting for the client's close: the first to go.
    Done = 2,
}

/// What a connection's task shares with the table.
#[derive(Debug)]
pub(crate) struct ConnState {
    /// Milliseconds since the table's epoch at the last phase change.
    last: AtomicU64,
    phase: AtomicU8,
    evicted: Notify,
}

/// A connection's place in the table; dropping it frees the place (if not evicted already).
#[derive(Debug)]
pub(crate) struct ConnGuard {
    table: Arc<ConnTable>,
    id: u64,
    state: Arc<ConnState>,
}

impl ConnGuard {
    /// Enter `phase` now (its activity time is now).
    pub(crate) fn set(&self, phase: Phase) {
        self.state
            .last
            .store(self.table.millis(), Ordering::Relaxed);
        self.state.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// Resolves once the table evicted this connection: its task then closes it.
    pub(crate) async fn evicted(&self) {
        self.state.evicted.notified().await;
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.table.remove(self.id);
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its address holds its share, every one of them inside a request.
    PerAddress,
    /// The listener is at its cap, every connection inside a request.
    OverCap,
}

/// Which cap an eviction made room under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Evicted {
    /// The new connection's address was at its share: its own idlest went.
    PerAddress,
    /// The listener was at its cap: the idlest of all went.
    Global,
}

struct Entry {
    ip: IpAddr,
    state: Arc<ConnState>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    conns: FastMap<u64, Entry>,
    per_ip: FastMap<IpAddr, usize>,
}

/// The open connections of one listener, under its two caps.
pub(crate) struct ConnTable {
    cap: usize,
    per_address: usize,
    epoch: Instant,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for ConnTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnTable")
            .field("cap", &self.cap)
            .field("per_address", &self.per_address)
            .field("open", &self.open())
            .finish()
    }
}

impl ConnTable {
    /// At most `cap` connections, `per_address` of them (clamped to 1..=cap) from one address.
    pub(crate) fn new(cap: usize, per_address: usize) -> Arc<Self> {
        let cap = cap.max(1);
        Arc::new(ConnTable {
            cap,
            per_address: per_address.clamp(1, cap),
            epoch: Instant::now(),
            inner: Mutex::default(),
        })
    }

    /// The per-address cap in force.
    pub(crate) fn per_address(&self) -> usize {
        self.per_address
    }

    fn millis(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update below is a single insert or remove: a panic elsewhere leaves it whole.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.lock().conns.len()
    }

    /// Connections open now from `ip`.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn open_from(&self, ip: IpAddr) -> usize {
        self.lock().per_ip.get(&ip).copied().unwrap_or(0)
    }

    /// Admit a connection from `ip`, evicting the idlest connection in its way if needed.
    pub(crate) fn admit(
        self: &Arc<Self>,
        ip: IpAddr,
    ) -> Result<(ConnGuard, Vec<Evicted>), Refusal> {
        let mut inner = self.lock();
        let mut evicted = Vec::new();
        if inner.per_ip.get(&ip).copied().unwrap_or(0) >= self.per_address {
            let victim = Self::idlest(&inner, Some(ip)).ok_or(Refusal::PerAddress)?;
            Self::evict(&mut inner, victim);
            evicted.push(Evicted::PerAddress);
        }
        if inner.conns.len() >= self.cap {
            let victim = Self::idlest(&inner, None).ok_or(Refusal::OverCap)?;
            Self::evict(&mut inner, victim);
            evicted.push(Evicted::Global);
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let state = Arc::new(ConnState {
            last: AtomicU64::new(self.millis()),
            phase: AtomicU8::new(Phase::Idle as u8),
            evicted: Notify::new(),
        });
        inner.conns.insert(
            id,
            Entry {
                ip,
                state: state.clone(),
            },
        );
        *inner.per_ip.entry(ip).or_default() += 1;
        Ok((
            ConnGuard {
                table: self.clone(),
                id,
                state,
            },
            evicted,
        ))
    }

    /// The connection to close first (of `ip`'s only, if given): a finished handshake before
    /// anything else, then the one idle longest; never one inside a request. A linear scan,
    /// done only at a cap (bounded by it).
    fn idlest(inner: &Inner, ip: Option<IpAddr>) -> Option<u64> {
        inner
            .conns
            .iter()
            .filter(|(_, e)| ip.is_none_or(|ip| e.ip == ip))
            .filter_map(|(&id, e)| {
                let phase = e.state.phase.load(Ordering::Relaxed);
                let last = e.state.last.load(Ordering::Relaxed);
                match phase {
                    p if p == Phase::Busy as u8 => None,
                    p if p == Phase::Done as u8 => Some(((0u8, last), id)),
                    _ => Some(((1u8, last), id)),
                }
            })
            .min()
            .map(|(_, id)| id)
    }

    /// Take `id` out of the table and tell its task to close it. Its phase may have turned
    /// Busy since it was chosen (a request arriving in between): the request then fails like
    /// any cut connection, which P retries on a new one.
    fn evict(inner: &mut Inner, id: u64) {
        if let Some(e) = Self::take(inner, id) {
            // Stored as a permit: the task sees it even if it is not waiting yet.
            e.state.evicted.notify_one();
        }
    }

    fn take(inner: &mut Inner, id: u64) -> Option<Entry> {
        let e = inner.conns.remove(&id)?;
        if let Some(n) = inner.per_ip.get_mut(&e.ip) {
            *n -= 1;
            if *n == 0 {
                inner.per_ip.remove(&e.ip);
            }
        }
        Some(e)
    }

    fn remove(&self, id: u64) {
        Self::take(&mut self.lock(), id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn the_idlest_goes_first_a_finished_handshake_before_it_and_a_busy_one_never() {
        let t = ConnTable::new(3, 3);
        let (a, _) = t.admit(ip(1)).unwrap();
        let (b, _) = t.admit(ip(1)).unwrap();
        let (c, _) = t.admit(ip(1)).unwrap();
        a.set(Phase::Busy);
        c.set(Phase::Done);
        // Full: c (done) goes before b (idle since before c), a (busy) never.
        let (d, ev) = t.admit(ip(2)).unwrap();
        assert_eq!(ev, vec![Evicted::Global]);
        assert_eq!(t.open(), 3);
        futures::executor::block_on(c.evicted());
        let (_e, _) = t.admit(ip(2)).unwrap();
        futures::executor::block_on(b.evicted());
        d.set(Phase::Busy);
        // a, d busy; e idle: e goes, then nothing is left to evict.
        let (f, _) = t.admit(ip(3)).unwrap();
        f.set(Phase::Busy);
        assert_eq!(t.admit(ip(3)).unwrap_err(), Refusal::OverCap);
        // A closed connection frees its place at once.
        drop(a);
        assert_eq!(t.open(), 2);
        assert!(t.admit(ip(3)).is_ok());
    }

    #[test]
    fn an_address_at_its_share_evicts_its_own_and_no_one_else() {
        let t = ConnTable::new(8, 2);
        let (other, _) = t.admit(ip(9)).unwrap();
        let mut held = vec![];
        for _ in 0..10 {
            let (g, _) = t.admit(ip(1)).unwrap();
            held.push(g);
        }
        assert_eq!(t.open_from(ip(1)), 2);
        assert_eq!(
            t.open_from(ip(9)),
            1,
            "the other address kept its connection"
        );
        for g in &held[2..] {
            g.set(Phase::Busy);
        }
        // Both of ip 1's connections are inside a request: refused, not queued.
        assert_eq!(t.admit(ip(1)).unwrap_err(), Refusal::PerAddress);
        drop(other);
    }
}
