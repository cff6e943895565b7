//! An inference server's D side, as a server author would write it: a plain tokio program (no
//! actix) with its own KV cache memory, its own block allocator and a scheduler step, that
//! receives prefilled KV through kvrecv, retries failed loads and aborts cancelled requests.
//!
//! ```text
//! cargo run --example inference_host
//! ```
//! `main` starts a simulated prefill engine (TP2, one rank failing 20% of its requests, the
//! other slow) so the example runs on its own; a real server points `bootstrap`/`engine_id` at
//! its router's P. `tests/inference_host.rs` runs the same [`InferenceHost`] with a P restart.
//! It hands kvrecv memory it owns: no `unsafe` anywhere in it.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use kvrecv::{BatchError, HostMemory, KvRecv, KvRecvBuilder, KvRecvConfig, KvRequest, LoadTicket};

/// A request that needs its prompt's KV from a prefill engine.
#[derive(Debug, Clone)]
pub struct Prefilled {
    pub id: String,
    pub engine_id: String,
    pub bootstrap: String,
    pub blocks: usize,
}

/// What a step tells the server about its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The KV is in `blocks` (ours until the request finishes decoding: here, the next step).
    Loaded {
        id: String,
        attempt: String,
        transfer_id: String,
        blocks: Vec<u32>,
    },
    /// An attempt failed; a new one is queued.
    Retrying { id: String, attempt: String },
    /// Every attempt failed.
    GaveUp { id: String },
    /// Cancelled by its client; its blocks are back.
    Cancelled { id: String },
}

/// The host's block allocator: a LIFO free list (a freed block is the next one handed out).
pub struct Allocator {
    free: Vec<u32>,
}

impl Allocator {
    fn new(n: u32) -> Self {
        Allocator {
            free: (0..n).rev().collect(),
        }
    }
    fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        (self.free.len() >= n).then(|| self.free.split_off(self.free.len() - n))
    }
    fn give_back(&mut self, blocks: &[u32]) {
        self.free.extend(blocks.iter().rev());
    }
    /// Free blocks now.
    pub fn free(&self) -> usize {
        self.free.len()
    }
}

struct Attempt {
    req: Prefilled,
    n: u32,
    transfer_id: String,
    blocks: Vec<u32>,
    failed: bool,
    cancelled: bool,
}

/// The D side of an inference server: KV memory, allocator, scheduler state and kvrecv.
pub struct InferenceHost {
    pub kv: KvRecv,
    pub alloc: Allocator,
    queue: VecDeque<(Prefilled, u32)>,
    live: HashMap<String, Attempt>,
    /// Requests loaded last step, decoding now; freed at the next step.
    decoding: Vec<Vec<u32>>,
    /// Last step's batch: its reply is read at this step (no wake-up of ours for it).
    submitted: Option<LoadTicket>,
    max_attempts: u32,
    /// Attempts handed to kvrecv, and completions for an attempt we were not waiting for
    /// (kvrecv promises none).
    pub attempts: usize,
    pub unexpected_completions: usize,
    /// Requests kvrecv refused at `load_kv` for a reason other than backpressure (a host bug).
    pub refused: usize,
}

impl InferenceHost {
    /// Allocate the KV cache, register it with kvrecv and start kvrecv's worker.
    pub fn start(config: KvRecvConfig, max_attempts: u32) -> Result<Self, kvrecv::StartError> {
        let l = config.layout.clone();
        // One buffer per layer: the model runner's KV cache, handed to kvrecv (which owns it
        // while it is registered; the host reads released blocks through `read_block`).
        let cache = HostMemory::owned(
            l.regions
                .iter()
                .map(|r| vec![0u8; r.block_len as usize * l.num_blocks as usize]),
        )?;
        let kv = KvRecvBuilder::new(config).host_memory(cache).start()?;
        Ok(InferenceHost {
            kv,
            alloc: Allocator::new(l.num_blocks),
            queue: VecDeque::new(),
            live: HashMap::new(),
            decoding: Vec::new(),
            submitted: None,
            max_attempts,
            attempts: 0,
            unexpected_completions: 0,
            refused: 0,
        })
    }

    /// A new request from the router.
    pub fn submit(&mut self, req: Prefilled) {
        self.queue.push_back((req, 1));
    }

    /// The client went away: drop it if still queued, else stop waiting (kvrecv releases its
    /// blocks once no prefill peer can write into them; the next drains hand them back).
    pub async fn cancel(&mut self, id: &str) -> Result<(), kvrecv::KvRecvError> {
        self.queue.retain(|(r, _)| r.id != id);
        let live: Vec<String> = self
            .live
            .iter()
            .filter(|(_, a)| a.req.id == id)
            .map(|(k, _)| k.clone())
            .collect();
        for attempt in live {
            self.live.get_mut(&attempt).expect("listed").cancelled = true;
            self.kv.abort(&attempt).await?;
        }
        Ok(())
    }

    /// Nothing queued, loading or decoding, and no reply unread.
    pub fn idle(&self) -> bool {
        self.queue.is_empty()
            && self.live.is_empty()
            && self.decoding.is_empty()
            && self.submitted.is_none()
    }

    /// One scheduler step: finish last step's decodes, load what fits, drain kvrecv.
    pub async fn step(&mut self) -> Result<Vec<Report>, kvrecv::KvRecvError> {
        for blocks in self.decoding.drain(..) {
            self.alloc.give_back(&blocks);
        }
        let mut out = Vec::new();
        // Last step's reply: there by now (kvrecv answers a batch before its pulls go out);
        // awaited in the rare case it is not.
        if let Some(ticket) = self.submitted.take() {
            let reply = match ticket.try_reply() {
                Ok(reply) => reply?,
                Err(not_yet) => not_yet.await?,
            };
            self.refused_at_load(reply.rejected, &mut out);
        }
        let mut batch = Vec::new();
        while let Some((req, n)) = self.queue.front().cloned() {
            let Some(blocks) = self.alloc.take(req.blocks) else {
                break;
            };
            self.queue.pop_front();
            // Each attempt is a fresh request id (a drained id could be reused, a fresh one
            // keeps the logs unambiguous) and a fresh prefill (the router re-prefills).
            let attempt = format!("{}#{n}", req.id);
            let transfer_id = format!("{}-t{n}", req.id);
            batch.push(KvRequest {
                req_id: attempt.clone(),
                transfer_id: Some(transfer_id.clone()),
                remote_engine_id: Some(req.engine_id.clone()),
                remote_bootstrap_addr: Some(req.bootstrap.clone()),
                block_ids: vec![blocks.clone()],
            });
            self.live.insert(
                attempt,
                Attempt {
                    req,
                    n,
                    transfer_id,
                    blocks,
                    failed: false,
                    cancelled: false,
                },
            );
        }
        if !batch.is_empty() {
            self.attempts += batch.len();
            // As vLLM's start_load_kv: handed over now, its reply read at the next step.
            self.submitted = Some(self.kv.submit(batch));
        }
        let step = self.kv.drain().await?;
        // Failures come no later than their completion: mark first, then complete.
        for b in &step.invalid_block_ids {
            if let Some(a) = self.live.values_mut().find(|a| a.blocks.contains(b)) {
                a.failed = true;
            }
        }
        for r in &step.failed_recving {
            if let Some(a) = self.live.get_mut(&**r) {
                a.failed = true;
            }
        }
        for r in step.finished_recving {
            let Some(a) = self.live.remove(&*r) else {
                self.unexpected_completions += 1;
                continue;
            };
            if a.cancelled {
                self.alloc.give_back(&a.blocks);
                out.push(Report::Cancelled { id: a.req.id });
            } else if a.failed {
                self.alloc.give_back(&a.blocks);
                if a.n < self.max_attempts {
                    out.push(Report::Retrying {
                        id: a.req.id.clone(),
                        attempt: r.to_string(),
                    });
                    self.queue.push_back((a.req, a.n + 1));
                } else {
                    out.push(Report::GaveUp { id: a.req.id });
                }
            } else {
                self.decoding.push(a.blocks.clone());
                out.push(Report::Loaded {
                    id: a.req.id,
                    attempt: r.to_string(),
                    transfer_id: a.transfer_id,
                    blocks: a.blocks,
                });
            }
        }
        Ok(out)
    }

    /// A refused request never completes: its blocks are ours again at once.
    fn refused_at_load(&mut self, rejected: Vec<BatchError>, out: &mut Vec<Report>) {
        for e in rejected {
            let Some(a) = self.live.remove(e.req_id()) else {
                continue;
            };
            self.alloc.give_back(&a.blocks);
            self.attempts -= 1;
            if matches!(e, BatchError::Backpressure { .. }) {
                self.queue.push_front((a.req, a.n)); // too much in flight: next step
            } else {
                // Anything else is a bug of ours (a block twice, a block still in use).
                self.refused += 1;
                eprintln!("load_kv refused: {e}");
                out.push(Report::GaveUp { id: a.req.id });
            }
        }
    }

    /// What the model runner sees in `block` of layer `region`: a block this host owns (kvrecv
    /// released it, or never had it). kvrecv refuses one a request still holds.
    pub fn read_block(&self, region: usize, block: u32) -> Result<Vec<u8>, kvrecv::BlockReadError> {
        Ok(self.kv.read_block(0, block)?.swap_remove(region))
    }

    /// Stop kvrecv: the report says which requests it abandoned and whether their blocks are
    /// safe to reuse now (the KV cache goes with the last handle).
    pub async fn shutdown(self) -> kvrecv::PauseReport {
        self.kv.shutdown().await
    }
}

#[allow(dead_code)] // `tests/inference_host.rs` includes this file as a module
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The simulated P is this crate's test tool (`testing` feature, on for its examples); the
    // host above uses only kvrecv's public interface.
    use kvrecv::sim::initiator::InitiatorConfig;
    use kvrecv::sim::{te_writer::TeWriter, Faults, PrefillSim, SimConfig};
    let sim = PrefillSim::start_with_writer(
        SimConfig {
            tp_size: 2,
            ..SimConfig::default()
        },
        std::sync::Arc::new(TeWriter::new(InitiatorConfig::default())),
    )
    .await?;
    sim.set_faults(
        0,
        0,
        Faults {
            failure_rate: 0.2,
            ..Faults::default()
        },
    );
    sim.set_faults(
        1,
        0,
        Faults {
            write_delay_ms: (0, 50),
            ..Faults::default()
        },
    );
    let config = KvRecvConfig {
        layout: kvrecv::KvLayout::uniform(4, 16 * 1024, 256),
        ..KvRecvConfig::default()
    };
    let mut host = InferenceHost::start(config, 5)?;
    for i in 0..64 {
        host.submit(Prefilled {
            id: format!("req-{i}"),
            engine_id: sim.engine_id().to_owned(),
            bootstrap: sim.bootstrap_url(),
            blocks: 1 + i % 8,
        });
    }
    let mut tick = tokio::time::interval(Duration::from_millis(2)); // the model's step
    let mut counts: HashMap<&'static str, usize> = HashMap::new();
    let mut steps = 0;
    while !host.idle() {
        tick.tick().await;
        steps += 1;
        if steps == 2 {
            host.cancel("req-7").await?; // its client disconnected while it was loading
        }
        for r in host.step().await? {
            let kind = match r {
                Report::Loaded { .. } => "loaded",
                Report::Retrying { .. } => "retried",
                Report::GaveUp { .. } => "gave up",
                Report::Cancelled { .. } => "cancelled",
            };
            *counts.entry(kind).or_default() += 1;
        }
    }
    println!("{counts:?}, free blocks {}", host.alloc.free());
    host.shutdown().await;
    Ok(())
}
