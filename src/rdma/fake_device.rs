//! A device without a GPU, to test the staged path: host bytes reached only through copies,
//! whose copies complete only when their slot is synchronised (as a DMA on a CUDA stream does
//! not complete when `cuMemcpyHtoDAsync` returns). A test can also hold synchronisations, to
//! catch a copy in flight.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::device_stream::DeviceStream;
use super::device_stream::STAGING_CHUNK;
use super::memory_error::MemoryError;

/// See [`DeviceMemory::fake`](super::memory::DeviceMemory::fake).
#[derive(Debug)]
pub struct FakeDevice {
    bytes: Mutex<Vec<u8>>,
    /// Copies into the device that completed.
    pub uploads: AtomicU64,
    /// The largest single copy, in bytes (bounded by [`STAGING_CHUNK`]).
    pub largest_upload: AtomicU64,
    /// Fail the next synchronisation (its copies never complete), as a device fault would.
    pub fail_next_sync: AtomicBool,
    /// Staging slots alive (made and not yet dropped): what a CUDA slot holds in the host's
    /// context (stream, event, page-locked buffer).
    pub live_slots: AtomicUsize,
    held: Mutex<bool>,
    unheld: Condvar,
    sync_waiting: tokio::sync::Notify,
}

impl FakeDevice {
    pub(crate) fn new(len: usize) -> Arc<Self> {
        Arc::new(FakeDevice {
            bytes: Mutex::new(vec![0; len]),
            uploads: AtomicU64::new(0),
            largest_upload: AtomicU64::new(0),
            fail_next_sync: AtomicBool::new(false),
            live_slots: AtomicUsize::new(0),
            held: Mutex::new(false),
            unheld: Condvar::new(),
            sync_waiting: tokio::sync::Notify::new(),
        })
    }

    /// Device bytes.
    pub fn len(&self) -> usize {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the device has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of `len` device bytes at `offset` (what copies completed so far).
    pub fn snapshot(&self, offset: usize, len: usize) -> Vec<u8> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())[offset..offset + len].to_vec()
    }

    /// From now on every synchronisation waits, its copies pending, until [`Self::release`].
    pub fn hold(&self) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// Let held synchronisations (and later ones) complete their copies.
    pub fn release(&self) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.unheld.notify_all();
    }

    /// Resolves once a synchronisation is waiting on [`Self::hold`].
    pub async fn sync_held(&self) {
        self.sync_waiting.notified().await;
    }

    /// `n` staging slots onto this device (device addresses are offsets into its bytes).
    pub(crate) fn streams(self: &Arc<Self>, n: usize) -> Vec<Box<dyn DeviceStream>> {
        self.live_slots.fetch_add(n, Ordering::SeqCst);
        (0..n)
            .map(|_| {
                Box::new(FakeStream {
                    dev: Arc::clone(self),
                    staging: vec![0; STAGING_CHUNK],
                    queued: Vec::new(),
                }) as Box<dyn DeviceStream>
            })
            .collect()
    }
}

enum Op {
    Upload { dst: u64, len: usize },
    Download { src: u64, len: usize },
}

/// One fake slot: enqueued copies wait in `queued` until [`DeviceStream::synchronize`].
struct FakeStream {
    dev: Arc<FakeDevice>,
    staging: Vec<u8>,
    queued: Vec<Op>,
}

impl FakeStream {
    fn range(&self, at: u64, len: usize) -> Result<std::ops::Range<usize>, MemoryError> {
        let size = self.dev.len();
        let start = usize::try_from(at).unwrap_or(usize::MAX);
        match start.checked_add(len) {
            Some(end) if end <= size && len <= self.staging.len() => Ok(start..end),
            _ => Err(MemoryError::OutOfBounds {
                offset: at,
                len: len as u64,
                size: size as u64,
            }),
        }
    }
}

impl Drop for FakeStream {
    fn drop(&mut self) {
        self.dev.live_slots.fetch_sub(1, Ordering::SeqCst);
    }
}

impl DeviceStream for FakeStream {
    fn staging(&mut self) -> &mut [u8] {
        &mut self.staging
    }

    unsafe fn enqueue_upload(&mut self, dst: u64, len: usize) -> Result<(), MemoryError> {
        self.range(dst, len)?;
        self.queued.push(Op::Upload { dst, len });
        Ok(())
    }

    unsafe fn enqueue_download(&mut self, src: u64, len: usize) -> Result<(), MemoryError> {
        self.range(src, len)?;
        self.queued.push(Op::Download { src, len });
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), MemoryError> {
        {
            let mut held = self.dev.held.lock().unwrap_or_else(|e| e.into_inner());
            if *held {
                self.dev.sync_waiting.notify_one();
            }
            while *held {
                held = self
                    .dev
                    .unheld
                    .wait(held)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
        if self.dev.fail_next_sync.swap(false, Ordering::SeqCst) {
            return Err(MemoryError::Cuda("fake device fault".into()));
        }
        for op in std::mem::take(&mut self.queued) {
            match op {
                Op::Upload { dst, len } => {
                    let r = self.range(dst, len)?;
                    let mut b = self.dev.bytes.lock().unwrap_or_else(|e| e.into_inner());
                    b[r].copy_from_slice(&self.staging[..len]);
                    self.dev.uploads.fetch_add(1, Ordering::Relaxed);
                    self.dev
                        .largest_upload
                        .fetch_max(len as u64, Ordering::Relaxed);
                }
                Op::Download { src, len } => {
                    let r = self.range(src, len)?;
                    let b = self.dev.bytes.lock().unwrap_or_else(|e| e.into_inner());
                    self.staging[..len].copy_from_slice(&b[r]);
                }
            }
        }
        Ok(())
    }
}
