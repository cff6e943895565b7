//! Which prefill workers one D worker pulls from (PROTOCOL.md §3), and where the topology comes
//! from (the HTTP bootstrap client in `control`, or a fixed table).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::LocalBoxFuture;
use thiserror::Error;

pub use crate::config::DRank;

use crate::messages::bootstrap::QueryResponse;
use crate::messages::PeerId;

/// One P engine (one DP rank): TP rank -> PP rank -> side-channel address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineTopology {
    /// P's engine id, as the bootstrap server knows it.
    pub engine_id: String,
    /// P's tensor-parallel size.
    pub tp_size: u32,
    /// P's pipeline-parallel size.
    pub pp_size: u32,
    /// `workers[tp][pp]`.
    pub workers: Vec<Vec<PeerId>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
/// Why no writer can be found for a batch: its awaited requests fail at once (DESIGN.md §4 rule 7).
pub enum TopologyError {
    #[error("engine {engine_id} is not registered at {bootstrap}")]
    /// The bootstrap server does not know the engine.
    UnknownEngine {
        /// The engine asked for.
        engine_id: String,
        /// The bootstrap server asked.
        bootstrap: String,
    },
    #[error("bootstrap {bootstrap} failed: {reason}")]
    /// The bootstrap server could not be queried or answered nonsense.
    Bootstrap {
        /// The bootstrap server.
        bootstrap: String,
        /// Why.
        reason: String,
    },
    #[error("engine {engine_id} topology incomplete: {reason}")]
    /// The engine has not registered all its ranks (yet).
    Incomplete {
        /// The engine.
        engine_id: String,
        /// What is missing.
        reason: String,
    },
    #[error(
        "engine {engine_id} lists {workers} P workers (TP x PP), more than the {max} accepted \
         without configured P sizes; refused (configure P's TP and PP sizes if it is real)"
    )]
    /// `/query` lists more workers than a real engine plausibly has (`max_p_workers`), and no
    /// P sizes were configured to vouch for them.
    Implausible {
        /// The engine.
        engine_id: String,
        /// TP x PP ranks listed.
        workers: u64,
        /// The cap.
        max: u32,
    },
    #[error("engine {engine_id} lists worker address {addr:?}, which cannot be dialled: {reason}")]
    /// A worker address no ZMQ connect can take (empty, or with a NUL or control character).
    BadWorkerAddress {
        /// The engine.
        engine_id: String,
        /// The address as listed.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    #[error("TP sizes do not divide: P TP {p_tp}, D TP {d_tp}")]
    /// P's and D's TP sizes do not divide each other.
    TpRatio {
        /// P's TP size.
        p_tp: u32,
        /// D's TP size.
        d_tp: u32,
    },
    #[error("engine {engine_id} has no worker for this D rank")]
    /// No P rank serves this D rank.
    NoPeers {
        /// The engine.
        engine_id: String,
    },
}

/// A rank key as vLLM writes it (`str(rank)`): digits, no sign, no leading zero. `"+0"` or
/// `"00"` would otherwise parse as rank 0 and silently collapse with `"0"`.
fn rank_key(k: &str) -> Option<u32> {
    let canonical =
        !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) && (k == "0" || !k.starts_with('0'));
    canonical.then(|| k.parse().ok()).flatten()
}

/// Why `addr` cannot be a P worker's endpoint, if it cannot. It comes from a bootstrap
/// server's `/query`, i.e. from the network: libzmq takes a C string (a NUL would cut it, and
/// the `zmq` crate panics on one), P's workers listen on TCP (`tcp://host:port`, vLLM's
/// `make_zmq_path`), and anything else would have D dial what the answer chose: an `inproc://`
/// endpoint of kvrecv's own ZMQ context (its socket monitors), an `ipc://` path on D's host, or
/// (`tcp://src;dst`) a source address D binds before connecting.
pub fn undialable(addr: &str) -> Option<&'static str> {
    if addr.is_empty() {
        return Some("empty");
    }
    if addr.contains('\0') {
        return Some("contains a NUL byte");
    }
    if addr.chars().any(char::is_control) {
        return Some("contains a control character");
    }
    let Some(host_port) = addr.strip_prefix("tcp://") else {
        return Some("not a tcp:// address (P's workers listen on TCP)");
    };
    if host_port.contains(';') {
        return Some("a tcp:// address with a source part (src;dst) is not dialled");
    }
    let Some((host, port)) = host_port.rsplit_once(':') else {
        return Some("a tcp:// address needs a port in 1..=65535");
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Some("a tcp:// address needs a host (no spaces)");
    }
    // Digits only: `u16::from_str` also takes a leading `+`.
    let port_ok = !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p != 0);
    if !port_ok {
        return Some("a tcp:// address needs a port in 1..=65535");
    }
    None
}

impl EngineTopology {
    /// Build from one `GET /query` answer, refusing a partial view (PROTOCOL.md §3 hazards): TP
    /// keys exactly `0..N-1`, every TP rank with the PP set `0..M-1`, sizes agreeing with
    /// `tp_size`/`pp_size` when the server sends them.
    pub fn from_query(
        bootstrap: &str,
        engine_id: &str,
        query: &QueryResponse,
    ) -> Result<Self, TopologyError> {
        let entry = query
            .values()
            .find(|e| e.engine_id == engine_id)
            .ok_or_else(|| TopologyError::UnknownEngine {
                engine_id: engine_id.into(),
                bootstrap: bootstrap.into(),
            })?;
        let incomplete = |reason: String| TopologyError::Incomplete {
            engine_id: engine_id.into(),
            reason,
        };
        let tp: BTreeMap<u32, &BTreeMap<String, String>> = entry
            .worker_addr
            .iter()
            .map(|(k, v)| rank_key(k).map(|k| (k, v)))
            .collect::<Option<_>>()
            .ok_or_else(|| incomplete("TP rank key not a plain integer".into()))?;
        let tp_size = tp.len() as u32;
        if tp_size == 0 || tp.keys().copied().ne(0..tp_size) {
            return Err(incomplete(format!(
                "TP ranks {:?} are not 0..{tp_size}",
                tp.keys()
            )));
        }
        if let Some(expected) = entry.tp_size {
            if expected != tp_size {
                return Err(incomplete(if tp_size < expected {
                    format!("{tp_size} of {expected} TP ranks registered")
                } else {
                    format!("{tp_size} TP ranks listed, but tp_size is {expected}")
                }));
            }
        }
        let mut workers = Vec::with_capacity(tp.len());
        let mut pp_size = None;
        for (rank, stages) in &tp {
            let pp: BTreeMap<u32, &String> = stages
                .iter()
                .map(|(k, v)| rank_key(k).map(|k| (k, v)))
                .collect::<Option<_>>()
                .ok_or_else(|| incomplete("PP rank key not a plain integer".into()))?;
            let n = pp.len() as u32;
            if n == 0 || pp.keys().copied().ne(0..n) {
                return Err(incomplete(format!(
                    "TP rank {rank}: PP stages {:?}",
                    pp.keys()
                )));
            }
            if *pp_size.get_or_insert(n) != n {
                return Err(incomplete(format!(
                    "TP rank {rank} has {n} PP stages, others differ"
                )));
            }
            for a in pp.values() {
                if let Some(reason) = undialable(a) {
                    return Err(TopologyError::BadWorkerAddress {
                        engine_id: engine_id.into(),
                        addr: a.chars().take(200).collect(),
                        reason: reason.into(),
                    });
                }
            }
            workers.push(pp.values().map(|a| PeerId::new(a.as_str())).collect());
        }
        let pp_size = pp_size.unwrap_or(1);
        if let Some(expected) = entry.pp_size {
            if expected != pp_size {
                return Err(incomplete(if pp_size < expected {
                    format!("{pp_size} of {expected} PP stages registered")
                } else {
                    format!("{pp_size} PP stages listed, but pp_size is {expected}")
                }));
            }
        }
        Ok(EngineTopology {
            engine_id: engine_id.into(),
            tp_size,
            pp_size,
            workers,
        })
    }

    /// The peers of one D worker, in protocol order (PROTOCOL.md §3 rules 1-3).
    ///
    /// ```
    /// use kvrecv::actors::topology::{DRank, EngineTopology};
    /// use kvrecv::messages::PeerId;
    /// let t = EngineTopology {
    ///     engine_id: "e".into(), tp_size: 2, pp_size: 1,
    ///     workers: vec![vec![PeerId::new("tcp://a:1")], vec![PeerId::new("tcp://b:1")]],
    /// };
    /// assert_eq!(t.peers_for(DRank::default()).unwrap().len(), 2); // P TP2 -> D TP1
    /// ```
    pub fn peers_for(&self, d: DRank) -> Result<Vec<PeerId>, TopologyError> {
        let p_tp = self.tp_size;
        let ratio_err = TopologyError::TpRatio {
            p_tp,
            d_tp: d.tp_size,
        };
        if p_tp == 0 || d.tp_size == 0 || d.tp_rank >= d.tp_size {
            return Err(ratio_err);
        }
        let tp_ranks: Vec<u32> = if d.tp_size >= p_tp {
            if d.tp_size % p_tp != 0 {
                return Err(ratio_err);
            }
            vec![d.tp_rank / (d.tp_size / p_tp)]
        } else {
            if p_tp % d.tp_size != 0 {
                return Err(ratio_err);
            }
            let r = p_tp / d.tp_size;
            (d.tp_rank * r..d.tp_rank * r + r).collect()
        };
        let mut peers = Vec::new();
        for t in tp_ranks {
            let stages = self
                .workers
                .get(t as usize)
                .ok_or_else(|| TopologyError::NoPeers {
                    engine_id: self.engine_id.clone(),
                })?;
            if d.pp_size as usize == stages.len() && (d.pp_rank as usize) < stages.len() {
                peers.push(stages[d.pp_rank as usize].clone());
            } else {
                peers.extend(stages.iter().cloned());
            }
        }
        if peers.is_empty() {
            return Err(TopologyError::NoPeers {
                engine_id: self.engine_id.clone(),
            });
        }
        Ok(peers)
    }
}

/// Where engine topologies come from.
pub trait TopologySource: 'static {
    /// Look up `engine_id` at `bootstrap` (`http://host:port`). Implementations cache; after an
    /// error the next call must ask again.
    fn lookup(
        &self,
        bootstrap: &str,
        engine_id: &str,
    ) -> LocalBoxFuture<'static, Result<EngineTopology, TopologyError>>;

    /// The topology `lookup` would answer at once, shared rather than copied, if there is one
    /// (the Receiver asks this first: it keeps the peers it derived from the same `Arc`).
    /// `None` (the default) sends every batch through `lookup`.
    fn cached(&self, _bootstrap: &str, _engine_id: &str) -> Option<Arc<EngineTopology>> {
        None
    }

    /// Forget a cached topology (called after a topology failure, DESIGN.md §4 rule 7).
    fn invalidate(&self, bootstrap: &str, engine_id: &str);
}

#[cfg(any(test, feature = "testing"))]
/// A fixed table of engines (tests, and hosts that know their peers).
#[derive(Debug, Default, Clone)]
pub struct StaticTopology {
    engines: BTreeMap<String, Arc<EngineTopology>>,
}

#[cfg(any(test, feature = "testing"))]
impl StaticTopology {
    /// A fixed set of engines (tests, and hosts that know P's topology).
    pub fn new(engines: impl IntoIterator<Item = EngineTopology>) -> Self {
        StaticTopology {
            engines: engines
                .into_iter()
                .map(|e| (e.engine_id.clone(), Arc::new(e)))
                .collect(),
        }
    }

    /// An engine of `tp` x `pp` workers at `tcp://<prefix>-<tp>-<pp>` (for scripted transports).
    pub fn grid(engine_id: &str, tp: u32, pp: u32) -> EngineTopology {
        EngineTopology {
            engine_id: engine_id.into(),
            tp_size: tp,
            pp_size: pp,
            workers: (0..tp)
                .map(|t| {
                    (0..pp)
                        .map(|p| PeerId::new(format!("tcp://{engine_id}-{t}-{p}")))
                        .collect()
                })
                .collect(),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
impl TopologySource for StaticTopology {
    fn lookup(
        &self,
        bootstrap: &str,
        engine_id: &str,
    ) -> LocalBoxFuture<'static, Result<EngineTopology, TopologyError>> {
        let r = self
            .engines
            .get(engine_id)
            .map(|t| EngineTopology::clone(t))
            .ok_or_else(|| TopologyError::UnknownEngine {
                engine_id: engine_id.into(),
                bootstrap: bootstrap.into(),
            });
        Box::pin(async move { r })
    }

    fn cached(&self, _bootstrap: &str, engine_id: &str) -> Option<Arc<EngineTopology>> {
        self.engines.get(engine_id).cloned()
    }

    fn invalidate(&self, _bootstrap: &str, _engine_id: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::bootstrap::DpEntry;

    fn d(tp_size: u32, tp_rank: u32, pp_size: u32, pp_rank: u32) -> DRank {
        DRank {
            tp_size,
            tp_rank,
            pp_size,
            pp_rank,
        }
    }

    fn names(p: Vec<PeerId>) -> Vec<String> {
        p.iter()
            .map(|p| p.addr().trim_start_matches("tcp://e-").to_string())
            .collect()
    }

    #[test]
    fn fan_out_table_of_protocol_section_3() {
        let g = StaticTopology::grid;
        assert_eq!(
            names(g("e", 2, 1).peers_for(d(1, 0, 1, 0)).unwrap()),
            ["0-0", "1-0"]
        );
        assert_eq!(
            names(g("e", 4, 1).peers_for(d(2, 1, 1, 0)).unwrap()),
            ["2-0", "3-0"]
        );
        assert_eq!(
            names(g("e", 2, 1).peers_for(d(2, 1, 1, 0)).unwrap()),
            ["1-0"]
        );
        assert_eq!(
            names(g("e", 1, 1).peers_for(d(2, 1, 1, 0)).unwrap()),
            ["0-0"]
        );
        assert_eq!(
            names(g("e", 2, 1).peers_for(d(4, 3, 1, 0)).unwrap()),
            ["1-0"]
        );
        assert_eq!(
            names(g("e", 1, 2).peers_for(d(1, 0, 1, 0)).unwrap()),
            ["0-0", "0-1"]
        );
        assert_eq!(
            names(g("e", 2, 2).peers_for(d(1, 0, 1, 0)).unwrap()),
            ["0-0", "0-1", "1-0", "1-1"]
        );
        assert_eq!(
            names(g("e", 2, 2).peers_for(d(2, 1, 2, 1)).unwrap()),
            ["1-1"]
        );
        assert_eq!(
            names(g("e", 1, 1).peers_for(d(1, 0, 2, 1)).unwrap()),
            ["0-0"]
        );
        assert!(g("e", 3, 1).peers_for(d(2, 0, 1, 0)).is_err());
    }

    fn entry(tp: &[(&str, &[&str])], tp_size: Option<u32>) -> QueryResponse {
        let worker_addr = tp
            .iter()
            .map(|(t, pps)| {
                (
                    t.to_string(),
                    pps.iter()
                        .map(|p| (p.to_string(), format!("tcp://x:1{t}{p}")))
                        .collect(),
                )
            })
            .collect();
        [(
            "0".to_string(),
            DpEntry {
                engine_id: "e0".into(),
                worker_addr,
                tp_size,
                pp_size: None,
            },
        )]
        .into_iter()
        .collect()
    }

    #[test]
    fn partial_topologies_are_refused() {
        let ok =
            EngineTopology::from_query("b", "e0", &entry(&[("0", &["0"]), ("1", &["0"])], None));
        assert_eq!(ok.unwrap().tp_size, 2);
        // only rank 1 registered
        assert!(EngineTopology::from_query("b", "e0", &entry(&[("1", &["0"])], None)).is_err());
        // server says TP2, only rank 0 registered
        assert!(matches!(
            EngineTopology::from_query("b", "e0", &entry(&[("0", &["0"])], Some(2))),
            Err(TopologyError::Incomplete { .. })
        ));
        // PP stage missing on rank 1
        assert!(EngineTopology::from_query(
            "b",
            "e0",
            &entry(&[("0", &["0", "1"]), ("1", &["0"])], None)
        )
        .is_err());
        assert!(matches!(
            EngineTopology::from_query("b", "e9", &entry(&[("0", &["0"])], None)),
            Err(TopologyError::UnknownEngine { .. })
        ));
    }

    /// Rank keys are `str(rank)`: `"+0"` or `"00"` would collapse into rank 0.
    #[test]
    fn rank_keys_must_be_plain_integers() {
        for bad in ["+0", "00", "01", " 0", "-1", "", "0x1"] {
            let r = EngineTopology::from_query("b", "e0", &entry(&[(bad, &["0"])], None));
            assert!(
                matches!(&r, Err(TopologyError::Incomplete { reason, .. }) if reason.contains("plain integer")),
                "{bad:?}: {r:?}"
            );
            let r = EngineTopology::from_query("b", "e0", &entry(&[("0", &[bad])], None));
            assert!(r.is_err(), "PP key {bad:?}");
        }
        assert_eq!(rank_key("10"), Some(10));
    }

    /// A worker address libzmq cannot take is refused with the topology, never dialled (the
    /// `zmq` crate panics on a NUL: a Peer died and its request never completed).
    #[test]
    fn p_worker_addresses_as_vllm_writes_them_are_dialled() {
        for addr in [
            "tcp://127.0.0.1:5555",
            "tcp://[::1]:1",
            "tcp://p-node-3.example:65535",
        ] {
            assert_eq!(undialable(addr), None, "{addr}");
        }
    }

    #[test]
    fn undialable_worker_addresses_are_refused() {
        for (addr, why) in [
            ("tcp://127.0.0.1:5\0x", "NUL"),
            ("", "empty"),
            ("tcp://a:1\n", "control"),
            ("tcp://127.0.0.1:65536", "port"),
            ("tcp://127.0.0.1", "port"),
            ("tcp://127.0.0.1:+5555", "port"),
            ("tcp://127.0.0.1:0", "port"),
            ("tcp://:5555", "host"),
            ("tcp://127.0.0.1:6000;127.0.0.1:5555", "source part"),
            ("inproc://kvrecv-monitor-1", "not a tcp://"),
            ("ipc:///tmp/p.sock", "not a tcp://"),
            ("TCP://127.0.0.1:5555", "not a tcp://"),
        ] {
            let mut q = entry(&[("0", &["0"])], None);
            let e = q.get_mut("0").unwrap();
            e.worker_addr
                .get_mut("0")
                .unwrap()
                .insert("0".into(), addr.into());
            let r = EngineTopology::from_query("b", "e0", &q);
            assert!(
                matches!(&r, Err(TopologyError::BadWorkerAddress { reason, .. }) if reason.contains(why)),
                "{addr:?}: {r:?}"
            );
        }
    }
}
