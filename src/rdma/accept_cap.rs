//! Connection caps of the data plane's listeners (data server, handshake daemon, metrics): what
//! happens at accept when a cap is reached, counted and logged. The data server and the
//! handshake daemon first evict their idlest connection (`conn_table.rs`); a connection is
//! refused (closed at accept, never queued) only when nothing in its way could be evicted.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::conn_table::{ConnGuard, ConnTable, Evicted, Refusal};
use crate::telemetry::{self as m, Labels};

/// Refuse a connection over a listener's cap: close it at once, count it, and warn (on the
/// 1st, 2nd, 4th, 8th... refusal, so a connection flood does not also flood the log).
pub(crate) fn refuse_over_cap(
    labels: &Labels,
    listener: &'static str,
    cap: usize,
    refused: &AtomicU64,
) {
    let n = refused.fetch_add(1, Ordering::Relaxed) + 1;
    labels
        .counter_by(m::CONNECTIONS_REFUSED, "listener", listener)
        .increment(1);
    if n.is_power_of_two() {
        tracing::warn!(
            listener,
            cap,
            refused_total = n,
            "connection refused: too many open connections"
        );
    }
}

/// A listener's caps and their counters.
#[derive(Debug)]
pub(crate) struct Caps<'a> {
    /// The listener's open connections.
    pub table: &'a Arc<ConnTable>,
    /// Its metric labels.
    pub labels: &'a Labels,
    /// `"data"` or `"handshake"`.
    pub listener: &'static str,
    /// The listener's cap (logs).
    pub cap: usize,
    /// Idle connections closed to make room.
    pub evicted: &'a AtomicU64,
    /// Refused: the address held its share, all inside a request.
    pub refused_per_address: &'a AtomicU64,
    /// Refused: the listener was full, all inside a request.
    pub refused_over_cap: &'a AtomicU64,
}

impl Caps<'_> {
    /// Admit a connection from `peer` (evicting the idlest in its way), or count and log why
    /// not; `None`: the caller closes it at once. Logs are rate-limited like refusals.
    pub(crate) fn admit(&self, peer: SocketAddr) -> Option<ConnGuard> {
        let ip: IpAddr = peer.ip();
        match self.table.admit(ip) {
            Ok((guard, evicted)) => {
                for why in evicted {
                    let n = self.evicted.fetch_add(1, Ordering::Relaxed) + 1;
                    self.labels
                        .counter_by(m::CONNECTIONS_EVICTED, "listener", self.listener)
                        .increment(1);
                    if n.is_power_of_two() {
                        tracing::warn!(
                            listener = self.listener,
                            cap = self.cap,
                            per_address = self.table.per_address(),
                            %peer,
                            at = match why {
                                Evicted::PerAddress => "per_address",
                                Evicted::Global => "global",
                            },
                            evicted_total = n,
                            "connection cap reached: the idlest connection was closed to make room"
                        );
                    }
                }
                Some(guard)
            }
            Err(Refusal::OverCap) => {
                refuse_over_cap(self.labels, self.listener, self.cap, self.refused_over_cap);
                None
            }
            Err(Refusal::PerAddress) => {
                let n = self.refused_per_address.fetch_add(1, Ordering::Relaxed) + 1;
                self.labels
                    .counter_by(
                        m::CONNECTIONS_REFUSED_PER_ADDRESS,
                        "listener",
                        self.listener,
                    )
                    .increment(1);
                if n.is_power_of_two() {
                    tracing::warn!(
                        listener = self.listener,
                        per_address = self.table.per_address(),
                        %peer,
                        refused_total = n,
                        "connection refused: its address holds its share of connections, all busy"
                    );
                }
                None
            }
        }
    }
}
