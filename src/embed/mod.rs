//! The front door: one builder that starts a whole D worker (the data target: TCP with landing
//! permits, or RDMA when configured; control plane; coordinator) on kvrecv's own thread, and one
//! handle ([`KvRecv`]) a host calls from any tokio runtime, with no actix in the host.
//!
//! kvrecv's thread runs its own actix `System` on a current-thread tokio runtime that polls the
//! actors' sockets itself; the data plane's listeners (handshake daemon, data server) run on a
//! multi-thread runtime of its own ([`KvRecvBuilder::worker_threads`]) and the data
//! connections on threads of their own
//! ([`TargetConfig::data_threads`](crate::TargetConfig::data_threads)). The host's runtime
//! only awaits replies (actix mailboxes and tokio channels work across runtimes).
//!
//! Hosts that run actix themselves can still wire the actors directly
//! ([`Coordinator::start`](crate::actors::Coordinator::start), the advanced path); [`KvRecv::from_parts`] puts
//! such custom parts (a scripted transport, a static topology) behind the same handle.

#![forbid(unsafe_code)]

mod builder;
mod errors;
mod worker;

pub use builder::KvRecvBuilder;
pub use errors::{KvRecvError, PauseError, StartError};
#[cfg(feature = "cli")]
pub(crate) use builder::Wiring;
#[cfg(feature = "cli")]
pub(crate) use worker::{data_runtime, DataPlaneHandle};
use errors::stopped;
use worker::{spawn_worker, HostBlocks, Inner};
#[cfg(test)]
use worker::forward_burst;


use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use std::collections::VecDeque;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::oneshot;


use crate::actors::{Coordinator, CoordinatorParts};
use crate::block_read::{copy_block, BlockReadError};
use crate::config::{KvRecvConfig, LoadFailurePolicy, MooncakeProtocol};
use crate::messages::{AbandonedRequest, BeginPause, NewRegistration, PauseReport};
use crate::messages::{
    Abort, AbortReply, BatchError, GetLedgerStats, KvEvent, KvRequest, LedgerStats, LoadKv,
    LoadKvReply, LoadKvTo, Queued, ReqId, StepOutput,
};
use crate::rdma::memory::HostMemory;
use crate::rdma::{Landing, LandingPauseError};

/// The memory a [`KvRecv::resume`] lands in.
#[derive(Debug, Clone)]
pub enum ResumeMemory {
    /// The memory the worker started with, at the same addresses (vLLM 0.33's
    /// `restore_kv_caches`: the same base addresses and lengths). It must be valid again
    /// before `resume` is called.
    Same,
    /// Other host memory: the host's own regions, one per layout region (checked like at
    /// start: [`PauseError::MemoryDoesNotFit`]), under [`HostRegion::new`]'s contract from
    /// the call on. From `resume`'s return every write lands in it and none in the old
    /// memory, which the host may then free. A worker on device memory refuses it
    /// ([`PauseError::NewMemoryUnsupported`]).
    ///
    /// [`HostRegion::new`]: crate::rdma::memory::HostRegion::new
    Host(HostMemory),
}


/// A running D worker. `Send + Sync + Clone`: every clone talks to the same worker; the worker
/// stops at [`KvRecv::shutdown`] or when the last clone is dropped (the drop then waits, a few
/// milliseconds, until kvrecv's thread and its data target stopped: nothing writes into host
/// memory after it returns).
///
/// ```no_run
/// # async fn host() -> Result<(), Box<dyn std::error::Error>> {
/// use kvrecv::KvRecvBuilder;
/// let kv = KvRecvBuilder::from_kv_transfer_config(r#"{"kv_role":"kv_consumer",
///     "kv_connector_extra_config":{"kvrecv":{"layout":{"num_blocks":1024,"num_groups":1,
///       "regions":[{"layer_name":"l0","layer_index":0,"group_index":0,
///                   "block_len":16384,"kv_block_len":16384}]}}}}"#)?
///     .start()?;
/// let reply = kv.load_kv(vec![/* KvRequest { req_id, transfer_id, .. } */]).await?;
/// let step = kv.drain().await?; // once per scheduler step
/// kv.abort("req-7").await?;     // the client went away
/// # let _ = (reply, step);
/// kv.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KvRecv {
    inner: Arc<Inner>,
}

/// Counters of a running worker, for an operator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Blocks held for a fence, and the built-in pool's free count.
    pub ledger: LedgerStats,
    /// Data-plane counters (`None` for a handle started [`KvRecv::from_parts`]).
    pub data: Option<DataPlaneStats>,
}

/// Data-plane counters (a snapshot). On RDMA the NICs write without D's CPU, so only the
/// handshakes are counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataPlaneStats {
    /// The data target's transport.
    pub protocol: MooncakeProtocol,
    /// Data connections accepted.
    pub connections: u64,
    /// Bytes written into destination memory.
    pub bytes_landed: u64,
    /// Writes landed.
    pub writes_landed: u64,
    /// Late writes refused because their request was revoked (the fence at work).
    pub rejected_revoked: u64,
    /// Writes refused because no permit covered them.
    pub rejected_no_permit: u64,
    /// Writes refused because the worker was paused ([`KvRecv::pause`]).
    pub rejected_paused: u64,
    /// Writes refused because they fell outside the advertised windows.
    pub rejected_out_of_range: u64,
    /// Mooncake handshakes served (segment metadata requests and RDMA endpoint connections).
    pub handshakes: u64,
    /// Landing permits open now.
    pub live_permits: u64,
    /// Landing windows poisoned now (their writer may still write).
    pub poisoned_windows: usize,
}

/// The reply to a [`KvRecv::submit`]: await it, or check it without waiting
/// ([`LoadTicket::try_reply`]). Dropping it leaves the batch loaded (its refusals unread).
#[must_use = "a refused request never completes: read the ticket's reply"]
#[derive(Debug)]
pub struct LoadTicket {
    reply: oneshot::Receiver<LoadKvReply>,
}

impl LoadTicket {
    /// The reply if it is there; else the ticket back, to check again or await.
    pub fn try_reply(mut self) -> Result<Result<LoadKvReply, KvRecvError>, LoadTicket> {
        match self.reply.try_recv() {
            Ok(reply) => Ok(Ok(reply)),
            Err(oneshot::error::TryRecvError::Closed) => Ok(Err(KvRecvError::Stopped)),
            Err(oneshot::error::TryRecvError::Empty) => Err(self),
        }
    }
}

impl std::future::Future for LoadTicket {
    type Output = Result<LoadKvReply, KvRecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.reply)
            .poll(cx)
            .map(|r| r.map_err(|_| KvRecvError::Stopped))
    }
}

/// An asynchronous stream of [`KvEvent`]s (settles, first failures, completions, releases).
pub struct EventStream {
    bursts: UnboundedReceiver<Vec<KvEvent>>,
    /// The rest of the burst being read.
    ready: VecDeque<KvEvent>,
}

impl futures::Stream for EventStream {
    type Item = KvEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<KvEvent>> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Poll::Ready(Some(ev));
            }
            match self.bursts.poll_recv(cx) {
                Poll::Ready(Some(burst)) => self.ready = burst.into(),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl EventStream {
    /// The next event (`None` once the worker stopped).
    pub async fn recv(&mut self) -> Option<KvEvent> {
        futures::StreamExt::next(self).await
    }
}

impl KvRecv {
    /// A builder from typed configuration ([`KvRecvBuilder::new`]).
    pub fn builder(config: KvRecvConfig) -> KvRecvBuilder {
        KvRecvBuilder::new(config)
    }

    /// The advanced path behind the same handle: `make` runs on kvrecv's thread, inside its
    /// actix System, and returns the coordinator's parts (custom transport, topology, landing;
    /// they need not be `Send`). No data-plane target is started. Events go to the parts' own
    /// sink.
    pub fn from_parts<F>(make: F) -> Result<KvRecv, StartError>
    where
        F: FnOnce() -> CoordinatorParts + Send + 'static,
    {
        spawn_worker(
            LoadFailurePolicy::default(),
            1,
            None,
            HostBlocks::default(),
            || async { Ok(((), None, Box::new(()) as Box<dyn std::any::Any>)) },
            move |()| Coordinator::start(make()),
        )
    }

    /// Hand a batch over (after allocating its blocks). Refused requests come back in
    /// [`LoadKvReply::rejected`]; the rest of the batch goes on. Not cancel-safe: dropped
    /// after its first poll, the batch may or may not have been loaded (a loaded request
    /// still completes through [`KvRecv::drain`]); await it to the end.
    pub async fn load_kv(&self, requests: Vec<KvRequest>) -> Result<LoadKvReply, KvRecvError> {
        if self.inner.coord.is_paused() {
            return Err(KvRecvError::Paused);
        }
        self.inner
            .coord
            .load_kv(LoadKv { requests })
            .await
            .map_err(stopped)
    }

    /// Hand a batch over now and read its reply later: the batch is queued before this
    /// returns (batches keep the order of `submit` and [`KvRecv::load_kv`] calls); the ticket
    /// holds the reply once the batch was validated. A step-driven host (vLLM's
    /// `start_load_kv`, then `get_finished` at the next step) checks the ticket when it comes
    /// round ([`LoadTicket::try_reply`]) and is not woken for the reply, which awaiting
    /// [`KvRecv::load_kv`] costs it once per batch (`kvrecv bench --via handle`,
    /// docs/PERFORMANCE.md). A refused request never completes: read every ticket. Unlike
    /// `load_kv`, `submit` does not wait for room in kvrecv's mailbox: requests submitted and
    /// not yet taken by kvrecv count against `max_live_requests`, and a batch that would go
    /// over it is refused at once, every request as [`BatchError::Backpressure`], or as
    /// [`BatchError::BatchOverLimit`] when the batch alone is larger than the limit (its ticket
    /// holds the reply; nothing of it is loaded). Pace it with the completions, as a
    /// scheduler's step does.
    ///
    /// ```no_run
    /// # async fn host(kv: kvrecv::KvRecv, batch: Vec<kvrecv::messages::KvRequest>)
    /// # -> Result<(), kvrecv::KvRecvError> {
    /// let mut ticket = kv.submit(batch);
    /// // ... the rest of the step; at the next one:
    /// ticket = match ticket.try_reply() {
    ///     Ok(reply) => {
    ///         for refused in reply?.rejected { /* give its blocks back */ let _ = refused; }
    ///         return Ok(());
    ///     }
    ///     Err(not_yet) => not_yet, // or `not_yet.await`
    /// };
    /// # let _ = ticket; Ok(()) }
    /// ```
    pub fn submit(&self, requests: Vec<KvRequest>) -> LoadTicket {
        let (reply, rx) = oneshot::channel();
        let limit = self.inner.coord.max_live;
        let queued = match Queued::try_add(&self.inner.queued, requests.len(), limit) {
            Ok(q) => q,
            Err(live) => {
                // A host that submits faster than kvrecv takes batches is told, as `load_kv`
                // tells one over the live limit, instead of growing the mailbox without end.
                let batch = requests.len();
                let rejected = requests
                    .into_iter()
                    .map(|r| match batch > limit {
                        true => BatchError::BatchOverLimit {
                            req_id: r.req_id,
                            batch,
                            limit,
                        },
                        false => BatchError::Backpressure {
                            req_id: r.req_id,
                            live,
                            limit,
                        },
                    })
                    .collect();
                let _ = reply.send(LoadKvReply {
                    rejected,
                    ..LoadKvReply::default()
                });
                return LoadTicket { reply: rx };
            }
        };
        // `do_send`: queued now, whatever the mailbox's fill (`send` would hold the batch in
        // its future until polled when the mailbox is full). A stopped Receiver drops the
        // message and `reply` with it: the ticket then reads `Stopped`.
        self.inner.coord.receiver.do_send(LoadKvTo {
            batch: LoadKv { requests },
            reply,
            queued,
        });
        LoadTicket { reply: rx }
    }

    /// Once per scheduler step: vLLM's `get_finished` (`finished_recving`: the blocks may be
    /// reused) and `get_block_ids_with_load_errors` (`invalid_block_ids`, or `failed_recving`
    /// for multi-group caches) in one call. A failure is never drained after its completion.
    /// It waits for nothing (kvrecv leaves the step's output where the handle takes it), so it
    /// never wakes the host's thread (one that finds nothing yields to the host's runtime once),
    /// and it is cancel-safe: in `select!` or under `timeout`, a drain dropped before it
    /// returned took nothing.
    pub async fn drain(&self) -> Result<StepOutput, KvRecvError> {
        self.inner.coord.drain().await.map_err(stopped)
    }

    /// Stop waiting for `req_id` (the client went away). P still has its block addresses, so
    /// each peer that owes it settles it ("aborted by the host") on P's answer, which proves P
    /// stopped writing (its landing window stays in rotation), or Uncertain if no answer came
    /// within [`KvRecvConfig::abort_grace`](crate::config::KvRecvConfig::abort_grace) once its
    /// pull owed nothing else (fenced: the window poisoned). The request fails either way, and
    /// its blocks appear in `finished_recving` only once no peer can write into them - never
    /// early. A request still in its bootstrap lookup is never sent: it completes Failed at
    /// once. Aborting an unknown or completed request does nothing.
    pub async fn abort(&self, req_id: &str) -> Result<AbortReply, KvRecvError> {
        self.inner
            .coord
            .receiver
            .send(Abort {
                req_id: ReqId::from(req_id),
            })
            .await
            .map_err(stopped)
    }

    /// Sleep mode (vLLM 0.33's `unregister_kv_caches`; DESIGN.md §7): take kvrecv off the
    /// destination memory. Admission closes at once (a later `load_kv` fails with
    /// [`KvRecvError::Paused`], a submitted request is refused as [`BatchError::Paused`]);
    /// every request holding blocks is aborted ([`KvRecv::abort`]: it settles on P's answer,
    /// or Uncertain after `abort_grace`) and no request survives: each completes failed
    /// ("aborted by the host") and reaches [`KvRecv::drain`] as usual. This resolves once every
    /// block is released (fenced, or at the last-resort deadline, never early), then closes
    /// the landing: TCP refuses every write (`paused`), RDMA deregisters every landing window
    /// and publishes an empty descriptor. From its return until [`KvRecv::resume`] nothing
    /// lands, and the host may release or reuse the memory. The report lists the requests
    /// it waited for and how each one's blocks came back. Pauses and resumes are serialised.
    /// Dropped midway, admission stays closed: call it again (it is idempotent).
    pub async fn pause(&self) -> Result<PauseReport, PauseError> {
        let _one = self.inner.sleep.lock().await;
        let started = self
            .inner
            .coord
            .block_manager
            .send(BeginPause)
            .await
            .map_err(|_| PauseError::Stopped)?;
        tracing::info!(
            holders = started.holders.len(),
            "pause: aborting the requests that hold blocks"
        );
        for req_id in started.holders {
            // One that already completed (quarantined) ignores it.
            self.inner
                .coord
                .receiver
                .send(Abort { req_id })
                .await
                .map_err(|_| PauseError::Stopped)?;
        }
        let report = started.report.await.map_err(|_| PauseError::Stopped)?;
        self.on_landing(|l| l.pause()).await?;
        tracing::info!(
            abandoned = report.abandoned.len(),
            "paused: no block held, the landing admits nothing"
        );
        Ok(report)
    }

    /// Wake from [`KvRecv::pause`]: the landing admits again (RDMA: windows registered at
    /// fresh IOVA slots, with fresh rkeys), pulls carry layout ids of a new nonce (P learns
    /// the layout again), and admission reopens. With [`ResumeMemory::Same`] the memory must
    /// be valid again before this is called; with [`ResumeMemory::Host`] writes land in the
    /// new regions from now on (TCP: the data server's memory is swapped; RDMA: windows are
    /// registered on the new regions) and the old memory may be freed once this returned.
    /// On an error the worker stays paused.
    pub async fn resume(&self, memory: ResumeMemory) -> Result<(), PauseError> {
        let _one = self.inner.sleep.lock().await;
        if !self.inner.coord.block_manager.connected() {
            return Err(PauseError::Stopped);
        }
        if !self.inner.coord.is_paused() {
            return Err(PauseError::NotPaused);
        }
        match memory {
            ResumeMemory::Same => self.on_landing(|l| l.resume()).await?,
            ResumeMemory::Host(host) => {
                let kept = host.clone();
                self.on_landing(move |l| l.resume_on(&host))
                    .await
                    .map_err(|e| match e {
                        PauseError::Landing(LandingPauseError::DoesNotFit(e)) => e.into(),
                        PauseError::Landing(LandingPauseError::InUse) => PauseError::MemoryInUse,
                        PauseError::Landing(LandingPauseError::Unsupported(why)) => {
                            PauseError::NewMemoryUnsupported(why)
                        }
                        e => e,
                    })?;
                // `read_block` reads the new memory from now on: the host may free the old
                // once this returns (the write lock waits for a copy from the old in flight).
                self.inner
                    .host_blocks
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .memory = Some(kept);
            }
        }
        self.inner
            .coord
            .receiver
            .send(NewRegistration)
            .await
            .map_err(|_| PauseError::Stopped)?;
        self.inner.coord.reopen_admission();
        tracing::info!("resumed: admitting requests again");
        Ok(())
    }

    /// Whether the worker is paused (or pausing): admission is closed.
    pub fn is_paused(&self) -> bool {
        self.inner.coord.is_paused()
    }

    /// Close or reopen the landing off the runtime's workers (RDMA's are firmware calls).
    async fn on_landing(
        &self,
        f: impl FnOnce(&dyn Landing) -> Result<(), LandingPauseError> + Send + 'static,
    ) -> Result<(), PauseError> {
        let landing = Arc::clone(&self.inner.coord.landing);
        if tokio::runtime::Handle::try_current().is_err() {
            return Ok(f(&*landing)?);
        }
        tokio::task::spawn_blocking(move || f(&*landing))
            .await
            .unwrap_or_else(|e| Err(LandingPauseError::Failed(format!("task failed: {e}"))))?;
        Ok(())
    }

    /// The event stream. There is one: the first call takes it.
    pub fn events(&self) -> Result<EventStream, KvRecvError> {
        self.inner
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|bursts| EventStream {
                bursts,
                ready: VecDeque::new(),
            })
            .ok_or(KvRecvError::NoEvents)
    }

    /// Counters for an operator.
    pub async fn stats(&self) -> Result<Stats, KvRecvError> {
        let ledger = self
            .inner
            .coord
            .block_manager
            .send(GetLedgerStats)
            .await
            .map_err(stopped)?;
        let data = self.inner.data.as_ref().map(|d| {
            let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            let handshakes = n(&d.handshake.metadata) + n(&d.handshake.connection);
            match &d.tcp {
                Some(t) => DataPlaneStats {
                    protocol: MooncakeProtocol::Tcp,
                    connections: n(&t.stats.connections),
                    bytes_landed: n(&t.stats.bytes_landed),
                    writes_landed: n(&t.stats.writes_landed),
                    rejected_revoked: n(&t.stats.rejected_revoked),
                    rejected_no_permit: n(&t.stats.rejected_no_permit),
                    rejected_paused: n(&t.stats.rejected_paused),
                    rejected_out_of_range: n(&t.stats.rejected_out_of_range),
                    handshakes,
                    live_permits: t.landing.permits().live(),
                    poisoned_windows: t.landing.permits().poisoned_windows(),
                },
                None => DataPlaneStats {
                    protocol: MooncakeProtocol::Rdma,
                    handshakes,
                    ..DataPlaneStats::default()
                },
            }
        });
        Ok(Stats { ledger, data })
    }

    /// The segment P's transfer engine writes into (`host:port` of the handshake daemon).
    pub fn segment_name(&self) -> Option<&str> {
        self.inner.data.as_ref().map(|d| d.segment_name.as_str())
    }

    /// Where the TCP target's handshake daemon and data server listen (`None` on RDMA: see
    /// [`Self::handshake_addr`]).
    pub fn listen_addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        let d = self.inner.data.as_ref()?;
        Some((d.handshake_addr, d.tcp.as_ref()?.data_addr))
    }

    /// Where the handshake daemon listens (TCP and RDMA).
    pub fn handshake_addr(&self) -> Option<SocketAddr> {
        self.inner.data.as_ref().map(|d| d.handshake_addr)
    }

    /// vLLM's `kv_load_failure_policy` from the configuration: what the host's scheduler does
    /// with a failed load ([`LoadFailurePolicy`] says how kvrecv's signals serve each).
    pub fn load_failure_policy(&self) -> LoadFailurePolicy {
        self.inner.load_failure_policy
    }

    /// The running actors, for hosts that also talk to them directly (advanced).
    pub fn coordinator(&self) -> &Coordinator {
        &self.inner.coord
    }

    /// Stop the worker (every clone) and wait until its thread has stopped its actors and
    /// listeners. Calls after this fail with [`KvRecvError::Stopped`].
    ///
    /// The report lists the requests abandoned: each one that still held blocks when the
    /// worker stopped (in flight, or completed and held for a fence), with its blocks (per
    /// KV-cache group, ascending). `fenced`: kvrecv's own data plane is closed (TCP: its
    /// server and connections are gone; RDMA: every window deregistered), so no peer can
    /// write those blocks any more and they are the host's to reuse now. `forced` instead (a
    /// handle of [`KvRecv::from_parts`], whose landing is the host's): kvrecv could not close
    /// it, the host's landing decides when they are safe. Requests that completed and
    /// were released but not yet drained are not in it (their blocks were released: drain
    /// before shutting down to learn of them). Every clone gets the same report. A handle
    /// dropped without `shutdown` cannot report: it logs how many requests it abandoned.
    pub async fn shutdown(&self) -> PauseReport {
        self.inner.system.stop();
        // Every clone waits for the same end, however many call this.
        let _ = self.inner.done.clone().await;
        // kvrecv's threads ended: who holds which block no longer changes.
        let fenced = self.inner.data.is_some();
        PauseReport {
            abandoned: self
                .inner
                .coord
                .holdings()
                .into_iter()
                .map(|(req_id, blocks)| AbandonedRequest {
                    req_id,
                    blocks,
                    fenced,
                    forced: !fenced,
                })
                .collect(),
        }
    }

    /// Whether kvrecv's thread has ended (after [`KvRecv::shutdown`], or a start that failed
    /// later): nothing of the worker writes any more.
    fn ended(&self) -> bool {
        self.inner.done.peek().is_some()
    }

    /// A copy of `block` of KV-cache `group` from the host's memory
    /// ([`KvRecvBuilder::host_memory`]): one `Vec` per layout region of the group, in layout
    /// order, each the block's whole stride (`block_len`; its KV bytes, `kv_block_len`,
    /// first). Safe and bounds-checked: only a block no request holds is read (one the host
    /// never loaded, or one its request released: in a drain's `finished_recving`, or due
    /// in the next one), and no request can take it while it is copied; a held block is refused ([`BlockReadError::Held`]). Once
    /// the worker stopped ([`KvRecv::shutdown`]) nothing writes, and any block is read. Memory
    /// given by pointer ([`HostRegion::new`](crate::HostRegion::new)) is not read while the worker is paused
    /// or after it stopped ([`BlockReadError::NotValid`]: the host may have released it).
    pub fn read_block(&self, group: u32, block: u32) -> Result<Vec<Vec<u8>>, BlockReadError> {
        let blocks = self
            .inner
            .host_blocks
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let (Some(memory), Some(layout)) = (&blocks.memory, &blocks.layout) else {
            return Err(BlockReadError::NoHostMemory);
        };
        crate::block_read::check_in_range(layout, group, block)?;
        let owned = memory
            .regions()
            .iter()
            .all(crate::rdma::memory::HostRegion::is_owned);
        // Every check under the live set's lock, which a pause takes to close admission and a
        // shutdown takes before it returns: neither completes (and lets the host release
        // memory given by pointer) while a copy runs.
        self.inner
            .coord
            .with_block_owner(group, block, |owner, paused| {
                let ended = self.ended();
                if !owned && (paused || ended) {
                    return Err(BlockReadError::NotValid);
                }
                match owner {
                    Some(req_id) if !ended => Err(BlockReadError::Held {
                        group,
                        block,
                        req_id: req_id.clone(),
                    }),
                    _ => copy_block(memory, layout, group, block),
                }
            })
    }
}

impl std::fmt::Debug for KvRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRecv")
            .field("listen", &self.listen_addrs())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::worker::forward_events;
    use super::*;
    use std::cell::RefCell;
    use std::net::{IpAddr, Ipv4Addr};
    use std::rc::Rc;
    use tokio::sync::mpsc::unbounded_channel;

    /// The unspecified IPv4 address, for [`KvRecvBuilder::bind`] on every interface.
    const ANY_IPV4: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);

    fn assert_send_sync_clone<T: Send + Sync + Clone + 'static>() {}

    fn released(id: &str) -> KvEvent {
        KvEvent::Released {
            req_id: ReqId::from(id),
            blocks: vec![],
            fenced: true,
            forced: false,
        }
    }

    fn id(ev: &KvEvent) -> &str {
        match ev {
            KvEvent::Released { req_id, .. } => req_id,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn once_the_host_dropped_its_stream_events_are_no_longer_queued() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        let (sink_tx, rx) = unbounded_channel();
        let (tx, bursts) = unbounded_channel();
        drop(bursts);
        // kvrecv's thread keeps a reference too (for the flush after a stop).
        let rx = Rc::new(RefCell::new(rx));
        let kept = rx.clone();
        let forwarder = local.spawn_local(forward_events(rx, tx));
        sink_tx.send(released("r0")).unwrap();
        local.block_on(&rt, forwarder).unwrap();
        assert!(
            sink_tx.send(released("r1")).is_err(),
            "the actors' channel is closed: later events are dropped, not kept"
        );
        assert!(kept.borrow_mut().try_recv().is_err(), "nothing queued");
    }

    #[test]
    fn a_burst_is_everything_queued_in_order_and_stops_once_the_host_is_gone() {
        let (sink_tx, mut rx) = unbounded_channel();
        let (tx, mut bursts) = unbounded_channel();
        for i in 1..4 {
            sink_tx.send(released(&format!("r{i}"))).unwrap();
        }
        assert!(forward_burst(released("r0"), &mut rx, &tx));
        let burst = bursts.try_recv().expect("one burst");
        let ids: Vec<&str> = burst.iter().map(id).collect();
        assert_eq!(ids, ["r0", "r1", "r2", "r3"]);
        assert!(bursts.try_recv().is_err(), "one burst, not one per event");
        drop(bursts);
        assert!(
            !forward_burst(released("r4"), &mut rx, &tx),
            "the host dropped the stream"
        );
    }

    #[test]
    fn the_handle_is_send_sync_clone() {
        assert_send_sync_clone::<KvRecv>();
    }

    /// The typed configuration has no layout of its own, as the JSON one has none: a start
    /// without one is refused, never served on a made-up layout P would write into.
    #[test]
    fn a_start_without_a_layout_is_refused() {
        let e = KvRecvBuilder::new(KvRecvConfig::default())
            .start()
            .unwrap_err();
        assert!(
            matches!(e, StartError::Config(crate::config::ConfigError::NoLayout)),
            "{e}"
        );
    }

    /// Settings every pull would fail on are refused at start, not found out pull by pull.
    #[test]
    fn settings_no_pull_could_work_with_are_refused_at_start() {
        let cfg = || KvRecvConfig {
            layout: crate::layout::KvLayout::uniform(1, 64, 4),
            ..KvRecvConfig::default()
        };
        for bad in ["not a host!", "", "a..b", "-"] {
            let e = KvRecvBuilder::new(cfg())
                .advertise_host(bad)
                .start()
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    StartError::BadAdvertiseHost(_) | StartError::NoAdvertiseHost(_)
                ),
                "{bad:?}: {e}"
            );
        }
        for good in ["10.0.0.5", "::1", "d-node-3.cluster.local"] {
            let kv = KvRecvBuilder::new(cfg())
                .advertise_host(good)
                .start()
                .unwrap_or_else(|e| panic!("{good:?}: {e}"));
            drop(kv);
        }
        let e = KvRecvBuilder::new(cfg())
            .zmq(crate::ZmqTransportConfig {
                max_sockets: 0,
                ..crate::ZmqTransportConfig::default()
            })
            .start()
            .unwrap_err();
        assert!(e.to_string().contains("max_sockets"), "{e}");
        // A key kvrecv does not know inside its own layout is refused, as any under `kvrecv`.
        let e = KvRecvConfig::from_kv_transfer_config(
            r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"kvrecv":{"layout":
               {"num_blocks":4,"num_groups":1,"regions":[{"layer_name":"l0","layer_index":0,
               "group_index":0,"block_len":64,"kv_block_len":64,"dtype":"fp8"}]}}}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("dtype"), "{e}");
    }

    /// The advertised host the host named stays, whether `bind` comes before or after it.
    #[test]
    fn bind_never_undoes_a_named_advertised_host() {
        let cfg = || KvRecvConfig {
            layout: crate::layout::KvLayout::uniform(1, 64, 4),
            ..KvRecvConfig::default()
        };
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        for b in [
            KvRecvBuilder::new(cfg())
                .advertise_host("localhost")
                .bind(loopback),
            KvRecvBuilder::new(cfg())
                .target(|t| t.advertise_host = "localhost".into())
                .bind(loopback),
            KvRecvBuilder::new(cfg())
                .bind(loopback)
                .advertise_host("localhost"),
        ] {
            let kv = b.start().unwrap();
            assert_eq!(
                kv.segment_name().map(|s| s.starts_with("localhost:")),
                Some(true),
                "{:?}",
                kv.segment_name()
            );
        }
    }

    #[test]
    fn a_wildcard_bind_needs_an_advertised_host() {
        let cfg = KvRecvConfig {
            layout: crate::layout::KvLayout::uniform(1, 64, 4),
            ..KvRecvConfig::default()
        };
        let e = KvRecvBuilder::new(cfg.clone())
            .bind(ANY_IPV4)
            .start()
            .unwrap_err();
        assert!(matches!(e, StartError::NoAdvertiseHost(_)), "{e}");
        let kv = KvRecvBuilder::new(cfg)
            .bind(ANY_IPV4)
            .advertise_host("127.0.0.1")
            .start()
            .unwrap();
        assert_eq!(
            kv.segment_name().map(|s| s.starts_with("127.0.0.1:")),
            Some(true)
        );
    }
}

