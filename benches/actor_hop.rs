//! What one actix message costs by itself, on the runtime the coordinator uses (a System on a
//! current-thread runtime): the floor under the coordinator's per-request cost, which sends
//! several per request by design (docs/PERFORMANCE.md, "The coordinator alone").
//!
//! `cargo bench --bench actor_hop`: `round_trip` is `send(..).await` of a message whose handler
//! does nothing, from a task to an idle actor and back; `one_way_burst` is `do_send` of a burst
//! of 1,000 such messages, per message (the actor handles them in few polls: a lower bound).

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
}

criterion_group!(benches, bench);
criterion_main!(benches);
