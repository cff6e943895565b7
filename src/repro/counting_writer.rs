//! Wraps the simulator's writer to record which P rank wrote which request, and how many writes
//! are in progress.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use crate::sim::writer::{KvWriter, WriteJob};

/// (tp, pp) rank -> requests it wrote.
type WrittenBy = BTreeMap<(u32, u32), HashSet<String>>;

/// Records, per P TP rank, the requests whose bytes it wrote successfully.
pub struct CountingWriter<W> {
    inner: W,
    written: Arc<Mutex<WrittenBy>>,
    in_flight: Arc<AtomicUsize>,
}

impl<W: KvWriter> CountingWriter<W> {
    pub fn new(inner: W) -> Self {
        CountingWriter {
            inner,
            written: Arc::default(),
            in_flight: Arc::default(),
        }
    }

    /// Requests that every one of `ranks` (tp, pp) wrote.
    pub fn written_by_all(&self, ranks: &[(u32, u32)]) -> usize {
        let w = self.written.lock().unwrap_or_else(|e| e.into_inner());
        let Some((first, rest)) = ranks.split_first() else {
            return 0;
        };
        let Some(base) = w.get(first) else { return 0 };
        base.iter()
            .filter(|r| {
                rest.iter()
                    .all(|k| w.get(k).is_some_and(|s| s.contains(*r)))
            })
            .count()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

impl<W: KvWriter> KvWriter for CountingWriter<W> {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let key = (job.rank.tp_rank, job.rank.pp_rank);
        let reqs = job.req_ids.clone();
        let written = self.written.clone();
        let in_flight = self.in_flight.clone();
        in_flight.fetch_add(1, Ordering::AcqRel);
        let fut = self.inner.write(job);
        Box::pin(async move {
            let r = fut.await;
            if r.is_ok() {
                written
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(key)
                    .or_default()
                    .extend(reqs);
            }
            in_flight.fetch_sub(1, Ordering::AcqRel);
            r
        })
    }
}
