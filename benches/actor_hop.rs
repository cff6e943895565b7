//! What one actix message costs by itself, on the runtime the coordinator uses (a System on a
//! current-thread runtime): the floor under the coordinator's per-request cost, which sends
//! several per request by design (docs/PERFORMANCE.md, "The coordinator alone").
//!
//! `cargo bench --bench actor_hop`: `round_trip` is `send(..).await` of a message whose handler
//! does nothing, from a task to an idle actor and back; `one_way_burst` is `do_send` of a burst
//! of 1,000 such messages, per message (the actor handles them in few polls: a lower bound).
//!
//! `pipeline/*` sends one request's messages through actors whose handlers do nothing else: the
//! floor of a request at batch 1 with one peer, for the design's four stages as built
//! (`pipeline/four_stages`: the host's `load_kv` round trip, the pull, the settles, the
//! completions, three events and the drain; admission, the aggregator's registration and the
//! drain's hand-over are shared state, not messages) and for one where the Receiver, the
//! aggregator and the BlockManager are one actor and the Peer another (`pipeline/two_stages`:
//! the same less `Completions`, the settles and the pull going to and from one actor). A
//! Peer's channel to P is left out of both.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use criterion::{criterion_group, criterion_main, Criterion};

struct Echo(u64);

impl Actor for Echo {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "u64")]
struct Ping(u64);

impl Handler<Ping> for Echo {
    type Result = u64;
    fn handle(&mut self, m: Ping, _: &mut Context<Self>) -> u64 {
        self.0 += 1;
        m.0
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct Note;

impl Handler<Note> for Echo {
    type Result = ();
    fn handle(&mut self, _: Note, _: &mut Context<Self>) {
        self.0 += 1;
    }
}

const BURST: u64 = 1_000;

/// The pipeline's messages: plain ids, as small as a request's own would be.
#[derive(Message)]
#[rtype(result = "()")]
struct Step(u64);

#[derive(Message)]
#[rtype(result = "bool")]
struct Ask(u64);

type Events = tokio::sync::mpsc::UnboundedSender<u64>;
type Outbox = Arc<Mutex<Vec<u64>>>;

/// Where a completed request goes: the drain's outbox, and the release event.
#[derive(Clone)]
struct Release {
    outbox: Outbox,
    events: Events,
}

impl Release {
    fn release(&self, id: u64) {
        self.outbox.lock().unwrap().push(id);
        let _ = self.events.send(id);
    }
}

/// The BlockManager's share: takes completions (outbox + the release event).
struct Manager(Release);
impl Actor for Manager {
    type Context = Context<Self>;
}
impl Handler<Step> for Manager {
    type Result = ();
    fn handle(&mut self, m: Step, _: &mut Context<Self>) {
        self.0.release(m.0);
    }
}

/// A stage that tells the events and passes the request on: a Peer (a pull's settle event,
/// its settles to the aggregator) or the aggregator (the completion event, the completion).
struct Forward {
    next: Recipient<Step>,
    events: Events,
}
impl Actor for Forward {
    type Context = Context<Self>;
}
impl Handler<Step> for Forward {
    type Result = ();
    fn handle(&mut self, m: Step, _: &mut Context<Self>) {
        let _ = self.events.send(m.0);
        self.next.do_send(Step(m.0));
    }
}

/// The Receiver of the four-stage design: admits in place, hands the Peer its pull.
struct Entry {
    peer: Addr<Forward>,
}
impl Actor for Entry {
    type Context = Context<Self>;
}
impl Handler<Ask> for Entry {
    type Result = bool;
    fn handle(&mut self, m: Ask, _: &mut Context<Self>) -> bool {
        self.peer.do_send(Step(m.0));
        true
    }
}

/// Receiver, aggregator and BlockManager in one actor: admission in place, a settle completes
/// in place.
struct Core {
    peer: Option<Addr<Forward>>,
    release: Release,
}
impl Actor for Core {
    type Context = Context<Self>;
}
impl Handler<Ask> for Core {
    type Result = bool;
    fn handle(&mut self, m: Ask, _: &mut Context<Self>) -> bool {
        if let Some(p) = &self.peer {
            p.do_send(Step(m.0));
        }
        true
    }
}
impl Handler<Step> for Core {
    type Result = ();
    fn handle(&mut self, m: Step, _: &mut Context<Self>) {
        // The completion event, then the release.
        let _ = self.release.events.send(m.0);
        self.release.release(m.0);
    }
}

/// `f` as a task on the actors' LocalSet (spawned once the runtime polls this, inside it).
async fn spawned<F: std::future::Future + 'static>(f: F) -> F::Output {
    actix::spawn(f).await.unwrap()
}

/// The host's side of one request: `load_kv`, wait for the release event (the third), drain
/// (in place, the hand-over with it).
async fn one_request(
    id: u64,
    entry: &Recipient<Ask>,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<u64>,
    outbox: &Outbox,
) {
    assert!(entry.send(Ask(id)).await.unwrap());
    for _ in 0..3 {
        events.recv().await.unwrap();
    }
    let out = std::mem::take(&mut *outbox.lock().unwrap());
    assert_eq!(out, [id]);
}

fn bench(c: &mut Criterion) {
    let sys = actix::System::new();
    let echo = sys.block_on(async { Echo(0).start() });
    let mut g = c.benchmark_group("actix");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("round_trip", |b| {
        b.iter_custom(|iters| {
            sys.block_on(async {
                let t0 = Instant::now();
                for i in 0..iters {
                    echo.send(Ping(i)).await.unwrap();
                }
                t0.elapsed()
            })
        })
    });
    g.bench_function("one_way_burst", |b| {
        b.iter_custom(|iters| {
            sys.block_on(async {
                let t0 = Instant::now();
                for _ in 0..iters {
                    for _ in 0..BURST {
                        echo.do_send(Note);
                    }
                    // Handled in order: when this answers, the burst is done.
                    echo.send(Ping(0)).await.unwrap();
                }
                // Per message of the burst (the closing round trip included: an upper bound
                // by one round trip per 1,000).
                t0.elapsed() / BURST as u32
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("pipeline");
    g.measurement_time(Duration::from_secs(3));
    for two in [false, true] {
        let (tx, events) = tokio::sync::mpsc::unbounded_channel();
        let outbox = Outbox::default();
        let release = Release {
            outbox: outbox.clone(),
            events: tx.clone(),
        };
        let entry: Recipient<Ask> = sys.block_on(async {
            if two {
                let core = Core::create(|ctx| Core {
                    peer: Some(
                        Forward {
                            next: ctx.address().recipient(),
                            events: tx.clone(),
                        }
                        .start(),
                    ),
                    release: release.clone(),
                });
                core.recipient()
            } else {
                let manager = Manager(release.clone()).start();
                let aggregator = Forward {
                    next: manager.recipient(),
                    events: tx.clone(),
                }
                .start();
                let peer = Forward {
                    next: aggregator.recipient(),
                    events: tx.clone(),
                }
                .start();
                Entry { peer }.start().recipient()
            }
        });
        let name = if two { "two_stages" } else { "four_stages" };
        let mut next = 0u64;
        let mut events = Some(events);
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                // The host is a task on the actors' thread, as in `benches/core.rs`.
                let (entry, outbox) = (entry.clone(), outbox.clone());
                let mut rx = events.take().expect("returned by the last run");
                let first = next;
                next += iters;
                let (elapsed, rx) = sys.block_on(spawned(async move {
                    let t0 = Instant::now();
                    for i in 1..=iters {
                        one_request(first + i, &entry, &mut rx, &outbox).await;
                    }
                    (t0.elapsed(), rx)
                }));
                events = Some(rx);
                elapsed
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
