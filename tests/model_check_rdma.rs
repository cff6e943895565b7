//! Exhaustive model check of the RDMA fence under Mooncake's retries (DESIGN.md §5,
//! docs/RDMA.md "The fence"), with `stateright`, driving kvrecv's own window core
//! (`KeyWindows`: which registration each pull lands through, which ones a fence retires).
//!
//! Environment: P peers on hosts of their own, each with requests pulled one slice each, one
//! block per request. The NIC (D's side) is modelled as the verbs spec has it: a write lands
//! only through a QP in RTS and with an rkey naming a live registration covering its address;
//! a QP in ERR drops it (the writer sees retry-exceeded), a dead rkey NAKs it. P behaves as
//! Mooncake's TE: a failed slice is redispatched after reloading D's descriptor (the address
//! must still be in a buffer, whose rkey it takes) — or, as a stale worker would, with the rkey
//! it had — and a QP that failed is re-handshaken. D may give up on any pulled request (peer
//! Uncertain, deadline): it revokes (the suspect's windows poisoned), fences (the suspect's QPs
//! to ERR; its poisoned windows deregistered and replaced) and releases the block when the
//! fence held. Every write may arrive at any later point.
//!
//! Property: no write lands in a released block. With the rule before issue 41 (one
//! registration, the fence = QPs to ERR) the checker finds the write-after-free: fence, release,
//! re-handshake, retry with the reloaded rkey. With landing windows of their own keys it does
//! not.

use std::collections::BTreeMap;
use std::time::Instant;

use kvrecv::rdma::verbs::key_windows::KeyWindows;
#[path = "model_check/discoveries.rs"]
mod discoveries;
use discoveries::discoveries;
use stateright::{Checker, Model, Property};

/// The fence rule under check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Rule {
    /// Before issue 41: one registration for every pull, the fence moves QPs to ERR only.
    QpOnly,
    /// Landing windows with keys of their own, retired by the fence.
    KeyWindows,
}

#[derive(Clone, Debug)]
struct Cfg {
    rule: Rule,
    peers: u8,
    requests_per_peer: u8,
    windows: usize,
    /// Redispatches of one slice at most (Mooncake: `MC_RETRY_CNT`, 9; 2 shows the hazard).
    retries: u8,
    /// Re-handshakes per peer at most.
    handshakes: u8,
}

/// A slice's address: an IOVA slot, or none registered (no clean window was left).
const UNREGISTERED: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum SliceState {
    /// Posted: its packets may arrive at D any time.
    Posted,
    /// The write failed (dropped or NAKed): Mooncake will redispatch it.
    Lost,
    Landed,
    /// Given up (no buffer for the address after reloading, or out of retries).
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Slice {
    slot: u32,
    rkey: u16,
    /// The peer's handshake its packets were posted on: D gives every handshake fresh QPs, so
    /// a packet of an earlier one reaches no QP.
    qp_gen: u8,
    state: SliceState,
    retries: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Req {
    Idle,
    Pulled(Slice),
    /// Completed; its block is released (and may hold another request's data).
    Released(Slice),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Qp {
    Rts,
    Err,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    windows: KeyWindows,
    /// Live registrations: slot → rkey (device 0).
    registered: BTreeMap<u32, u16>,
    next_rkey: u16,
    qps: Vec<Qp>,
    handshakes: Vec<u8>,
    reqs: Vec<Req>,
    write_after_free: Option<usize>,
    some_write_landed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Pull(usize),
    Deliver(usize),
    /// D gives up on the request with its peer as the suspect.
    GiveUp(usize),
    /// The slice landed and P answered ok: released without a fence.
    Complete(usize),
    Rehandshake(usize),
    /// Mooncake's redispatch: reload the descriptor, take the address's rkey from it.
    Redispatch(usize),
    /// A worker re-posting with the rkey it had.
    RepostStale(usize),
}

struct Fence {
    cfg: Cfg,
}

fn peer_addr(p: usize) -> String {
    format!("tcp://10.0.0.{}:5600", p + 1)
}

fn peer_host(p: usize) -> String {
    format!("10.0.0.{}", p + 1)
}

impl Fence {
    fn peer_of(&self, r: usize) -> usize {
        r / self.cfg.requests_per_peer as usize
    }

    fn register(s: &mut State, slot: u32) {
        s.next_rkey += 1;
        s.registered.insert(slot, s.next_rkey);
        s.windows.added(slot);
    }

    /// What `RdmaLanding::fence` does after the QPs: retire every poisoned window, register
    /// clean ones in their place.
    fn retire_and_replenish(s: &mut State) {
        for slot in s.windows.to_retire() {
            s.registered.remove(&slot);
            s.windows.retired(slot);
        }
        while s.windows.missing() > 0 {
            let Some(slot) = s.windows.fresh_slot() else {
                break;
            };
            Self::register(s, slot);
        }
    }
}

impl Model for Fence {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let n = self.cfg.peers as usize * self.cfg.requests_per_peer as usize;
        // Slots: enough that the model never wraps (a wrap takes `MAX_SLOTS` fences).
        let mut s = State {
            windows: KeyWindows::new(16, self.cfg.windows, 0),
            registered: BTreeMap::new(),
            next_rkey: 0,
            qps: vec![Qp::Rts; self.cfg.peers as usize],
            handshakes: vec![0; self.cfg.peers as usize],
            reqs: vec![Req::Idle; n],
            write_after_free: None,
            some_write_landed: false,
        };
        match self.cfg.rule {
            Rule::QpOnly => {
                s.next_rkey = 1;
                s.registered.insert(0, 1);
            }
            Rule::KeyWindows => {
                while s.windows.missing() > 0 {
                    let slot = s.windows.fresh_slot().unwrap();
                    Self::register(&mut s, slot);
                }
            }
        }
        vec![s]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for (r, req) in s.reqs.iter().enumerate() {
            match req {
                Req::Idle => out.push(Action::Pull(r)),
                Req::Pulled(sl) | Req::Released(sl) => {
                    if sl.state == SliceState::Posted {
                        out.push(Action::Deliver(r));
                    }
                    if sl.state == SliceState::Lost && sl.retries < self.cfg.retries {
                        out.push(Action::Redispatch(r));
                        out.push(Action::RepostStale(r));
                    }
                    if let Req::Pulled(sl) = req {
                        out.push(Action::GiveUp(r));
                        if sl.state == SliceState::Landed {
                            out.push(Action::Complete(r));
                        }
                    }
                }
            }
        }
        for p in 0..self.cfg.peers as usize {
            if s.qps[p] == Qp::Err && s.handshakes[p] < self.cfg.handshakes {
                out.push(Action::Rehandshake(p));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Pull(r) => {
                let p = self.peer_of(r);
                let slot = match self.cfg.rule {
                    Rule::QpOnly => Some(0),
                    Rule::KeyWindows => s.windows.assign(&peer_addr(p), &peer_host(p)),
                }
                .unwrap_or(UNREGISTERED);
                // P's TE loads D's descriptor for an address it does not know.
                let rkey = s.registered.get(&slot).copied().unwrap_or(0);
                s.reqs[r] = Req::Pulled(Slice {
                    slot,
                    rkey,
                    qp_gen: s.handshakes[p],
                    state: SliceState::Posted,
                    retries: 0,
                });
            }
            Action::Deliver(r) => {
                let p = self.peer_of(r);
                let released = matches!(s.reqs[r], Req::Released(_));
                let (Req::Pulled(sl) | Req::Released(sl)) = &mut s.reqs[r] else {
                    return None;
                };
                if s.qps[p] != Qp::Rts || sl.qp_gen != s.handshakes[p] {
                    sl.state = SliceState::Lost; // dropped: retry-exceeded
                } else if s.registered.get(&sl.slot) == Some(&sl.rkey) {
                    sl.state = SliceState::Landed;
                    s.some_write_landed = true;
                    if released {
                        s.write_after_free = Some(r);
                    }
                } else {
                    // Remote access error: NAK, and the QP fails on both sides.
                    sl.state = SliceState::Lost;
                    s.qps[p] = Qp::Err;
                }
            }
            Action::GiveUp(r) => {
                let p = self.peer_of(r);
                let Req::Pulled(sl) = s.reqs[r] else {
                    return None;
                };
                // Revoke (poison the suspect's windows), then fence.
                if self.cfg.rule == Rule::KeyWindows {
                    s.windows.poison(&[peer_addr(p)]);
                }
                s.qps[p] = Qp::Err;
                let fenced = match self.cfg.rule {
                    Rule::QpOnly => true,
                    Rule::KeyWindows => {
                        Self::retire_and_replenish(&mut s);
                        s.windows.fenced(&peer_addr(p))
                    }
                };
                if !fenced {
                    return None; // held to the last-resort deadline: not released here
                }
                s.reqs[r] = Req::Released(sl);
            }
            Action::Complete(r) => {
                let Req::Pulled(sl) = s.reqs[r] else {
                    return None;
                };
                s.reqs[r] = Req::Released(sl);
            }
            Action::Rehandshake(p) => {
                s.qps[p] = Qp::Rts;
                s.handshakes[p] += 1;
            }
            Action::Redispatch(r) | Action::RepostStale(r) => {
                let gen = s.handshakes[self.peer_of(r)];
                let (Req::Pulled(sl) | Req::Released(sl)) = &mut s.reqs[r] else {
                    return None;
                };
                sl.retries += 1;
                sl.qp_gen = gen;
                if matches!(action, Action::Redispatch(_)) {
                    match s.registered.get(&sl.slot) {
                        Some(&rkey) => sl.rkey = rkey,
                        None => {
                            // "Cannot redispatch slice": no buffer holds the address any more.
                            sl.state = SliceState::Failed;
                            return Some(s);
                        }
                    }
                }
                sl.state = SliceState::Posted;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no write lands in a released block", |_, s: &State| {
                s.write_after_free.is_none()
            }),
            Property::sometimes("a write lands", |_, s: &State| s.some_write_landed),
        ]
    }
}

fn check(cfg: Cfg) -> (usize, Vec<(String, String)>) {
    let model = Fence { cfg };
    let checker = model.checker().spawn_bfs().join();
    let states = checker.unique_state_count();
    (states, discoveries(&checker))
}

fn cfg(rule: Rule, windows: usize, peers: u8, requests_per_peer: u8) -> Cfg {
    Cfg {
        rule,
        peers,
        requests_per_peer,
        windows,
        retries: 2,
        handshakes: 2,
    }
}

/// Landing windows hold under retries: two hosts with a window each and sharing one, and one
/// host whose next request follows the one D gave up on.
#[test]
fn with_landing_windows_no_retried_write_lands_after_the_fence() {
    for (windows, peers, per_peer) in [(1, 2, 1), (2, 2, 1), (1, 1, 2)] {
        let t = Instant::now();
        let (states, found) = check(cfg(Rule::KeyWindows, windows, peers, per_peer));
        println!(
            "RDMA fence model, {windows} window(s), {peers} peer(s) x {per_peer} request(s): \
             {states} states in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        assert!(states > 100, "the model explores something: {states}");
        let violated: Vec<_> = found.iter().filter(|(p, _)| p != "a write lands").collect();
        assert!(violated.is_empty(), "violations: {violated:#?}");
        assert!(
            found.iter().any(|(p, _)| p == "a write lands"),
            "writes land at all"
        );
    }
}

/// The rule before issue 41: the checker finds fence → release → re-handshake → redispatch
/// with the reloaded rkey → the write lands in the released block.
#[test]
fn with_the_qp_fence_alone_a_retried_write_lands_after_release() {
    let (states, found) = check(cfg(Rule::QpOnly, 1, 1, 1));
    let (_, trace) = found
        .iter()
        .find(|(p, _)| p == "no write lands in a released block")
        .unwrap_or_else(|| panic!("no counterexample ({states} states): {found:?}"));
    println!("counterexample ({states} states):\n  {trace}");
    assert!(
        trace.contains("Rehandshake") && trace.contains("Redispatch"),
        "{trace}"
    );
}
