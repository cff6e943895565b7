//! Host memory registered for P's one-sided writes. The registry owns the buffers it allocates,
//! which is what makes registration safe: a buffer cannot be freed while a NIC may write to it.
//! The host's own regions ([`HostRegion`]) are registered in place: their constructor's contract
//! keeps them allocated until the target that registered them is dropped (and deregistered);
//! so are the host's device regions ([`DeviceRegion`]), through GPUDirect RDMA.

use super::backend::{MrAccess, VerbsBackend, VerbsError};
use super::descriptor::RegisteredRegion;
use super::gpudirect::{register_device_region, DeviceMemoryExport, GpuDirectError, GpuDirectPath};
use crate::rdma::memory::{DeviceRegion, HostRegion};

/// Registered host buffers, in registration order (descriptor order): kvrecv's own (`Some`
/// buffer) or the host's (`None`: the host owns the bytes).
#[derive(Debug, Default)]
pub struct MemoryRegistrations {
    entries: Vec<(Option<Box<[u8]>>, RegisteredRegion)>,
}

impl MemoryRegistrations {
    pub fn new() -> Self {
        MemoryRegistrations::default()
    }

    /// Register `buf` on every device of `backend` (REMOTE_WRITE, plus REMOTE_READ if asked)
    /// and keep it. `location` is the descriptor buffer name, `cpu:<numa node>`.
    pub fn register_host<B: VerbsBackend>(
        &mut self,
        backend: &mut B,
        location: impl Into<String>,
        mut buf: Box<[u8]>,
        access: MrAccess,
    ) -> Result<&RegisteredRegion, VerbsError> {
        let addr = buf.as_mut_ptr() as u64;
        let length = buf.len() as u64;
        // SAFETY: `buf` is owned by `self` from here until `deregister_all` has deregistered
        // it (or forever, see Drop), so the range stays mapped while registered.
        let keys = unsafe { backend.register_memory(addr, length, access)? };
        let region = RegisteredRegion {
            location: location.into(),
            addr,
            length,
            keys,
        };
        self.entries.push((Some(buf), region));
        Ok(&self.entries[self.entries.len() - 1].1)
    }

    /// Register the host's own `region` in place on every device of `backend`: kvrecv
    /// allocates nothing, P writes straight into the host's memory.
    pub fn register_host_region<B: VerbsBackend>(
        &mut self,
        backend: &mut B,
        location: impl Into<String>,
        region: &HostRegion,
        access: MrAccess,
    ) -> Result<&RegisteredRegion, VerbsError> {
        let addr = region.as_ptr() as u64;
        let length = region.len() as u64;
        // SAFETY: `HostRegion::new`'s contract keeps the range allocated and pinned until the
        // target holding this registry is dropped, and its Drop deregisters first.
        let keys = unsafe { backend.register_memory(addr, length, access)? };
        let region = RegisteredRegion {
            location: location.into(),
            addr,
            length,
            keys,
        };
        self.entries.push((None, region));
        Ok(&self.entries[self.entries.len() - 1].1)
    }

    /// Register the host's device region `index` in place on every device of `backend`
    /// through GPUDirect RDMA (dma-buf, else nvidia-peermem; [`super::gpudirect`]): P writes
    /// straight into GPU memory. `location` is the descriptor buffer name, `cuda:<ordinal>`.
    pub fn register_device_region<B: VerbsBackend>(
        &mut self,
        backend: &mut B,
        location: impl Into<String>,
        export: &dyn DeviceMemoryExport,
        index: usize,
        region: &DeviceRegion,
        access: MrAccess,
    ) -> Result<GpuDirectPath, GpuDirectError> {
        let (addr, length) = (region.ptr(), region.len());
        // SAFETY: `DeviceRegion::new`'s contract keeps the memory allocated until the target
        // holding this registry is dropped, and its Drop deregisters first.
        let (path, keys) =
            unsafe { register_device_region(backend, export, index, addr, length, addr, access)? };
        tracing::info!(
            region = index,
            ?path,
            length,
            "device memory registered for GPUDirect RDMA"
        );
        self.entries.push((
            None,
            RegisteredRegion {
                location: location.into(),
                addr,
                length,
                keys,
            },
        ));
        Ok(path)
    }

    /// The regions, for `SegmentDescriptor::build`.
    pub fn regions(&self) -> Vec<RegisteredRegion> {
        self.entries.iter().map(|(_, r)| r.clone()).collect()
    }

    /// Read access to a kvrecv-owned buffer's bytes (what P wrote); `None` for the host's
    /// regions (the host reads its own memory).
    pub fn bytes(&self, index: usize) -> Option<&[u8]> {
        self.entries.get(index).and_then(|(b, _)| b.as_deref())
    }

    /// Deregister every buffer and free it. A buffer whose deregistration fails is leaked, not
    /// freed, since the NIC may still write to it.
    pub fn deregister_all<B: VerbsBackend>(&mut self, backend: &mut B) -> Result<(), VerbsError> {
        let mut first_err = None;
        for (buf, region) in self.entries.drain(..) {
            if let Err(e) = backend.deregister_memory(region.addr) {
                std::mem::forget(buf);
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for MemoryRegistrations {
    /// Dropped while still registered (no backend at hand to deregister): leak the buffers
    /// rather than hand memory a NIC can write to back to the allocator.
    fn drop(&mut self) {
        for (buf, _) in self.entries.drain(..) {
            std::mem::forget(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::verbs::fake::{test_nic, FakeVerbs, VerbsCall};

    fn fake(n: usize) -> FakeVerbs {
        FakeVerbs::new((0..n).map(|i| test_nic(&format!("mlx5_{i}"), Default::default())).collect())
    }

    #[test]
    fn registers_write_only_by_default_with_one_key_pair_per_device() {
        let mut b = fake(2);
        let mut mem = MemoryRegistrations::new();
        let r = mem
            .register_host(
                &mut b,
                "cpu:0",
                vec![0u8; 4096].into_boxed_slice(),
                MrAccess::default(),
            )
            .unwrap()
            .clone();
        assert_eq!(
            (r.location.as_str(), r.length, r.keys.len()),
            ("cpu:0", 4096, 2)
        );
        assert_ne!(r.addr, 0);
        assert_eq!(
            b.calls,
            vec![VerbsCall::Register {
                addr: r.addr,
                length: 4096,
                access: MrAccess { remote_read: false }
            }]
        );
        assert_eq!(mem.regions(), vec![r.clone()]);
        assert_eq!(mem.bytes(0).map(<[u8]>::len), Some(4096));
        mem.deregister_all(&mut b).unwrap();
        assert_eq!(
            b.calls.last(),
            Some(&VerbsCall::Deregister { addr: r.addr })
        );
        assert!(mem.regions().is_empty());
    }

    #[test]
    fn empty_buffer_is_a_typed_error() {
        let mut b = fake(1);
        let mut mem = MemoryRegistrations::new();
        let err = mem
            .register_host(&mut b, "cpu:0", Box::new([]), MrAccess::default())
            .unwrap_err();
        assert!(matches!(err, VerbsError::EmptyRegion(_)));
        assert!(mem.regions().is_empty());
    }
}
