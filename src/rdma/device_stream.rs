//! Ordered copies into device memory. A bounded pool of staging slots, each a page-locked host
//! buffer of [`STAGING_CHUNK`] bytes and a copy queue of its own on the device (with CUDA: a
//! stream kvrecv creates with `CU_STREAM_NON_BLOCKING`, so it neither waits behind the host's
//! work on the legacy default stream nor makes that work wait). A copy is enqueued
//! asynchronously and then the queue is synchronised: [`DeviceCopy::upload`] returns only once
//! the device holds the bytes, which is what lets the data server count a write landed
//! (permit `landed`, the v2 ack, `released`) after it and never before. A driver's
//! "synchronous" copy from pageable memory may return before its DMA finished; a
//! synchronisation cannot.
//!
//! Every call here blocks its thread (a copy, a stream synchronisation, waiting for a free
//! slot): the data server makes them on tokio's blocking pool, never on a runtime worker.

// The copier is built by the CUDA device and the fake device only; a library built with
// neither keeps the slot count the data server sizes its semaphore with.
#![cfg_attr(
    not(any(test, feature = "cuda", feature = "testing")),
    allow(dead_code)
)]

use std::sync::{Condvar, Mutex};

use super::memory_error::MemoryError;

/// Copies into and out of memory the data server cannot address directly (device memory). TCP
/// payloads reach it through a bounded staging buffer ([`STAGING_CHUNK`]), each copy inside the
/// write's permit gate. Both calls block their thread: callers on the async runtime make them
/// on its blocking pool.
pub(crate) trait DeviceCopy: Send + Sync {
    /// Host -> device: returns once the device holds the bytes (the copy's stream was
    /// synchronised), never merely once the copy was queued.
    fn upload(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError>;
    /// Device -> host, likewise complete on return.
    fn download(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError>;
    /// Nothing copies any more (the data server stopped): wait for copies in flight, then let
    /// go of every slot (its stream, event and page-locked buffer live in the host's context,
    /// which the host may destroy once shutdown returned). Later copies fail.
    fn close(&self);
}

/// Largest staging buffer one write uses on its way to device memory.
pub const STAGING_CHUNK: usize = 1 << 20;

/// Staging slots per device destination: copies in flight at once, across all connections
/// (each slot pins [`STAGING_CHUNK`] bytes of host memory).
pub const STAGING_SLOTS: usize = 8;

/// One staging slot: a page-locked buffer and the device queue its copies go through.
/// Implementations: the CUDA stream (feature `cuda`) and a fake whose copies complete only when
/// synchronised (tests).
pub(crate) trait DeviceStream: Send {
    /// The slot's staging bytes ([`STAGING_CHUNK`] long). Never touched by the caller while a
    /// copy from or into them is enqueued and not yet synchronised.
    fn staging(&mut self) -> &mut [u8];

    /// Enqueue a copy of `staging()[..len]` to device address `dst`; returns before the copy
    /// completed.
    ///
    /// # Safety
    /// `dst..dst + len` lies inside device memory kvrecv may write; `len <= STAGING_CHUNK`.
    unsafe fn enqueue_upload(&mut self, dst: u64, len: usize) -> Result<(), MemoryError>;

    /// Enqueue a copy of `len` device bytes at `src` into `staging()[..len]`.
    ///
    /// # Safety
    /// As [`Self::enqueue_upload`], for reading.
    unsafe fn enqueue_download(&mut self, src: u64, len: usize) -> Result<(), MemoryError>;

    /// Block until every copy enqueued on this slot completed.
    fn synchronize(&mut self) -> Result<(), MemoryError>;
}

/// A device destination reached through staging slots: the layout's regions `(start, device
/// address, length)`, contiguous in kvrecv's offsets, and the slot pool.
pub(crate) struct StagedCopier {
    segs: Vec<(u64, u64, u64)>,
    pool: Mutex<Pool>,
    freed: Condvar,
    /// Whatever keeps the device memory and its context alive (kvrecv's own allocation).
    _keep: Option<Box<dyn Send + Sync>>,
}

struct Pool {
    free: Vec<Box<dyn DeviceStream>>,
    /// Slots not lost to a failed synchronisation (free or leased).
    live: usize,
    /// [`DeviceCopy::close`] ran: no slot is handed out again.
    closed: bool,
}

impl StagedCopier {
    /// `segs`: `(start, device address, length)` per layout region; `slots`: at least one.
    pub(crate) fn new(
        segs: Vec<(u64, u64, u64)>,
        slots: Vec<Box<dyn DeviceStream>>,
        keep: Option<Box<dyn Send + Sync>>,
    ) -> Self {
        StagedCopier {
            segs,
            pool: Mutex::new(Pool {
                live: slots.len(),
                free: slots,
                closed: false,
            }),
            freed: Condvar::new(),
            _keep: keep,
        }
    }

    /// The device address of `[offset, offset + len)`, which lies inside one region.
    fn locate(&self, offset: u64, len: u64) -> Result<u64, MemoryError> {
        self.segs
            .iter()
            .find(|&&(start, _, l)| {
                offset >= start && offset.checked_add(len).is_some_and(|end| end - start <= l)
            })
            .map(|&(start, addr, _)| addr + (offset - start))
            .ok_or(MemoryError::OutOfBounds {
                offset,
                len,
                size: self.segs.last().map_or(0, |&(s, _, l)| s + l),
            })
    }

    /// A free slot, waiting (blocking) while every slot is in use.
    fn lease(&self) -> Result<Lease<'_>, MemoryError> {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if pool.closed {
                return Err(MemoryError::Cuda(
                    "the device destination was closed (kvrecv shut down)".into(),
                ));
            }
            if let Some(slot) = pool.free.pop() {
                return Ok(Lease {
                    owner: self,
                    slot: Some(slot),
                });
            }
            if pool.live == 0 {
                return Err(MemoryError::Cuda(
                    "every staging slot was lost to failed device copies".into(),
                ));
            }
            pool = self.freed.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// On one slot: `enqueue` copies, synchronise, then `done` (which may read the staging
    /// bytes a download filled). A slot whose synchronisation failed may still have a copy
    /// reading or writing its staging bytes: it is leaked, never reused.
    fn on_slot<T>(
        &self,
        enqueue: impl FnOnce(&mut dyn DeviceStream) -> Result<(), MemoryError>,
        done: impl FnOnce(&mut dyn DeviceStream) -> T,
    ) -> Result<T, MemoryError> {
        let mut lease = self.lease()?;
        let slot = lease.slot.as_deref_mut().expect("a lease holds its slot");
        let queued = enqueue(slot);
        // Even after a failed enqueue: an earlier piece may be in flight.
        if let Err(e) = slot.synchronize() {
            lease.lose();
            return Err(e);
        }
        queued?;
        Ok(done(slot))
    }
}

/// A leased slot, back in the pool on drop.
struct Lease<'a> {
    owner: &'a StagedCopier,
    slot: Option<Box<dyn DeviceStream>>,
}

impl Lease<'_> {
    fn lose(&mut self) {
        if let Some(slot) = self.slot.take() {
            tracing::error!("device copy failed to synchronise; its staging slot is retired");
            std::mem::forget(slot);
            let mut pool = self.owner.pool.lock().unwrap_or_else(|e| e.into_inner());
            pool.live -= 1;
            drop(pool);
            // Waiters re-check `live`.
            self.owner.freed.notify_all();
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let mut pool = self.owner.pool.lock().unwrap_or_else(|e| e.into_inner());
            pool.free.push(slot);
            drop(pool);
            // All: `close` waits on the same condition as copies waiting for a slot.
            self.owner.freed.notify_all();
        }
    }
}

impl DeviceCopy for StagedCopier {
    fn close(&self) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.closed = true;
        // Leased slots come back when their copy synchronised; lost ones never do.
        while pool.free.len() < pool.live {
            pool = self.freed.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
        let slots = std::mem::take(&mut pool.free);
        // None is leased any more: a second close has nothing to wait for.
        pool.live = 0;
        drop(pool);
        // Waiters for a slot see `closed`.
        self.freed.notify_all();
        drop(slots);
    }

    fn upload(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        let dst = self.locate(offset, src.len() as u64)?;
        let mut pos = 0u64;
        for chunk in src.chunks(STAGING_CHUNK) {
            self.on_slot(
                |s| {
                    s.staging()[..chunk.len()].copy_from_slice(chunk);
                    // SAFETY: inside one region (located above); at most STAGING_CHUNK bytes.
                    unsafe { s.enqueue_upload(dst + pos, chunk.len()) }
                },
                |_| (),
            )?;
            pos += chunk.len() as u64;
        }
        Ok(())
    }

    fn download(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        let size = self.segs.last().map_or(0, |&(s, _, l)| s + l);
        let oob = MemoryError::OutOfBounds {
            offset,
            len: dst.len() as u64,
            size,
        };
        if offset
            .checked_add(dst.len() as u64)
            .is_none_or(|end| end > size)
        {
            return Err(oob);
        }
        // A read may span regions: region by region, a staging chunk at a time.
        let mut done = 0usize;
        while done < dst.len() {
            let at = offset + done as u64;
            let Some(&(start, _, l)) = self.segs.iter().find(|&&(s, _, l)| at >= s && at - s < l)
            else {
                return Err(oob);
            };
            let n = ((start + l - at) as usize)
                .min(dst.len() - done)
                .min(STAGING_CHUNK);
            let src = self.locate(at, n as u64)?;
            let out = &mut dst[done..done + n];
            self.on_slot(
                // SAFETY: inside one region (located above); at most STAGING_CHUNK bytes.
                |s| unsafe { s.enqueue_download(src, n) },
                |s| out.copy_from_slice(&s.staging()[..n]),
            )?;
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::*;
    use crate::rdma::fake_device::FakeDevice;

    /// Two regions of 3 staging chunks + 100 bytes each, at device addresses 0 and `GAP` (not
    /// contiguous on the device, contiguous in kvrecv's offsets).
    const REGION: u64 = 3 * STAGING_CHUNK as u64 + 100;
    const GAP: u64 = REGION + 4096;

    fn copier(slots: usize) -> (StagedCopier, Arc<FakeDevice>) {
        let dev = FakeDevice::new((GAP + REGION) as usize);
        let c = StagedCopier::new(
            vec![(0, 0, REGION), (REGION, GAP, REGION)],
            dev.streams(slots),
            None,
        );
        (c, dev)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// The ordering promise: `upload` returns only once the device holds every byte. The fake's
    /// copies complete only when their slot is synchronised, so an upload that only enqueued
    /// (the old `memcpy_htod_sync` from pageable memory may return before its DMA finished)
    /// leaves the device without the bytes here.
    #[test]
    fn upload_returns_only_once_the_device_holds_every_byte() {
        let (c, dev) = copier(2);
        let src = pattern(2 * STAGING_CHUNK + 7, 0x5a);
        c.upload(REGION + 10, &src).unwrap();
        assert_eq!(dev.snapshot((GAP + 10) as usize, src.len()), src);
        assert_eq!(dev.uploads.load(Ordering::Relaxed), 3, "one copy per chunk");
        assert_eq!(
            dev.largest_upload.load(Ordering::Relaxed),
            STAGING_CHUNK as u64
        );
        // One slot, reused: every chunk's copy completed before the next overwrote the staging.
        let (c, dev) = copier(1);
        c.upload(0, &src).unwrap();
        assert_eq!(dev.snapshot(0, src.len()), src);
    }

    #[test]
    fn downloads_span_regions_and_writes_do_not() {
        let (c, dev) = copier(1);
        let a = pattern(REGION as usize, 1);
        let b = pattern(REGION as usize, 2);
        c.upload(0, &a).unwrap();
        c.upload(REGION, &b).unwrap();
        assert!(
            dev.snapshot(REGION as usize, 4096).iter().all(|&x| x == 0),
            "the gap"
        );
        let mut back = vec![0u8; 2 * STAGING_CHUNK];
        c.download(REGION - STAGING_CHUNK as u64, &mut back)
            .unwrap();
        assert_eq!(back[..STAGING_CHUNK], a[a.len() - STAGING_CHUNK..]);
        assert_eq!(back[STAGING_CHUNK..], b[..STAGING_CHUNK]);
        // A write across the regions' boundary, or past the end, is refused before any copy.
        let before = dev.uploads.load(Ordering::Relaxed);
        assert!(matches!(
            c.upload(REGION - 1, &[0; 2]),
            Err(MemoryError::OutOfBounds { .. })
        ));
        assert!(c.upload(2 * REGION - 1, &[0; 2]).is_err());
        assert!(c.download(2 * REGION - 1, &mut [0; 2]).is_err());
        assert_eq!(dev.uploads.load(Ordering::Relaxed), before);
    }

    /// Closing lets go of every slot (on CUDA: what lives in the host's context), but only once
    /// a copy in flight completed; after it copies fail instead of waiting for a slot.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn close_waits_for_copies_in_flight_then_drops_every_slot() {
        let (c, dev) = copier(2);
        let c = Arc::new(c);
        assert_eq!(dev.live_slots.load(Ordering::SeqCst), 2);
        dev.hold();
        let held = dev.sync_held();
        let up = tokio::task::spawn_blocking({
            let c = Arc::clone(&c);
            move || c.upload(0, &[7; 16])
        });
        held.await;
        let close = tokio::task::spawn_blocking({
            let (c, dev) = (Arc::clone(&c), Arc::clone(&dev));
            move || {
                c.close();
                dev.live_slots.load(Ordering::SeqCst)
            }
        });
        // Once close marked the pool closed it waits for the held copy's slot.
        while !c.pool.lock().unwrap().closed {
            tokio::task::yield_now().await;
        }
        assert!(!close.is_finished(), "close returned under a copy in flight");
        dev.release();
        up.await.unwrap().unwrap();
        assert_eq!(close.await.unwrap(), 0, "a slot outlived close");
        assert_eq!(dev.snapshot(0, 16), vec![7; 16], "the copy in flight landed");
        assert_eq!(dev.live_slots.load(Ordering::SeqCst), 0);
        // Later copies fail at once (a copier that waited for a slot would hang here), and a
        // second close returns.
        let after = tokio::task::spawn_blocking({
            let c = Arc::clone(&c);
            move || {
                let up = c.upload(0, &[1; 8]);
                let down = c.download(0, &mut [0; 8]);
                c.close();
                (up, down)
            }
        });
        let (up, down) = tokio::time::timeout(std::time::Duration::from_secs(30), after)
            .await
            .expect("a copy after close waited for a slot, or a second close hung")
            .unwrap();
        assert!(matches!(up, Err(MemoryError::Cuda(_))));
        assert!(down.is_err());
        assert_eq!(dev.snapshot(0, 16), vec![7; 16]);
    }

    /// A copy already waiting for a slot when close runs gets an error, not a slot.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_waiting_for_a_slot_fails_when_closed() {
        let (c, dev) = copier(1);
        let c = Arc::new(c);
        dev.hold();
        let held = dev.sync_held();
        let first = tokio::task::spawn_blocking({
            let c = Arc::clone(&c);
            move || c.upload(0, &[3; 8])
        });
        held.await;
        // The only slot is leased: this one waits in `lease`.
        let waiting = tokio::task::spawn_blocking({
            let c = Arc::clone(&c);
            move || c.upload(8, &[4; 8])
        });
        let close = tokio::task::spawn_blocking({
            let c = Arc::clone(&c);
            move || c.close()
        });
        while !c.pool.lock().unwrap().closed {
            tokio::task::yield_now().await;
        }
        dev.release();
        first.await.unwrap().unwrap();
        close.await.unwrap();
        assert!(waiting.await.unwrap().is_err(), "got a slot after close");
        assert_eq!(dev.snapshot(8, 8), vec![0; 8]);
        assert_eq!(dev.live_slots.load(Ordering::SeqCst), 0);
    }

    /// A slot whose synchronisation failed may still be copying from its staging bytes: it is
    /// never reused, and once every slot is lost a copy fails instead of waiting forever.
    #[test]
    fn a_slot_whose_sync_failed_is_retired() {
        let (c, dev) = copier(1);
        dev.fail_next_sync.store(true, Ordering::SeqCst);
        assert!(matches!(c.upload(0, &[1; 8]), Err(MemoryError::Cuda(_))));
        assert_eq!(
            dev.snapshot(0, 8),
            vec![0; 8],
            "the failed copy never landed"
        );
        assert!(matches!(c.upload(0, &[1; 8]), Err(MemoryError::Cuda(_))));
        let (c, dev) = copier(2);
        dev.fail_next_sync.store(true, Ordering::SeqCst);
        assert!(c.upload(0, &[1; 8]).is_err());
        c.upload(0, &[2; 8]).unwrap();
        assert_eq!(
            dev.snapshot(0, 8),
            vec![2; 8],
            "the other slot still copies"
        );
    }
}
