//! The destination memory registered once per landing window ([`super::key_windows`]): every
//! layout region of window `w` at the IOVA the window map gives it, each registration with rkeys
//! of its own. The bytes exist once; only keys and advertised addresses differ per window.

use std::collections::BTreeMap;
use std::sync::Arc;

use thiserror::Error;

use super::backend::{MrAccess, VerbsBackend, VerbsError};
use super::descriptor::RegisteredRegion;
use super::gpudirect::{register_device_region, DeviceMemoryExport, GpuDirectError};
use crate::layout::KvLayout;
use crate::rdma::tcp::windows::{WindowError, WindowMap};
use crate::rdma::RegionBases;

/// One layout region's bytes: `(address, length)` in this process, or on the GPU (a device
/// pointer) when the registrations have a [`DeviceMemoryExport`].
pub type HostSpan = (u64, u64);

/// Why a window could not be registered.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WindowRegisterError {
    /// The verbs call failed (`RLIMIT_MEMLOCK`, a NIC error).
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// Device memory the NIC cannot take.
    #[error(transparent)]
    GpuDirect(#[from] GpuDirectError),
}

/// The registrations of every live window.
#[derive(Debug)]
pub struct WindowRegistrations {
    map: WindowMap,
    /// Per layout region, where its bytes are.
    host: Vec<HostSpan>,
    location: String,
    access: MrAccess,
    /// Device memory: registered through GPUDirect RDMA (dma-buf, else nvidia-peermem).
    device: Option<Arc<dyn DeviceMemoryExport>>,
    /// Live slot → its regions (addr = IOVA) and its bases (shared with every pull).
    live: BTreeMap<u32, (Vec<RegisteredRegion>, RegionBases)>,
}

impl WindowRegistrations {
    /// `slots` IOVA slots of `layout` above `base`, backed by `host` (one span per layout region,
    /// each at least as long as the region; checked by the caller). One slot more is laid out
    /// and never registered ([`unregistered_bases`](Self::unregistered_bases)).
    pub fn new(
        layout: &KvLayout,
        host: Vec<HostSpan>,
        base: u64,
        slots: u32,
        location: String,
        access: MrAccess,
        device: Option<Arc<dyn DeviceMemoryExport>>,
    ) -> Result<Self, WindowError> {
        Ok(WindowRegistrations {
            map: WindowMap::new(layout, base, slots.saturating_add(1))?,
            host,
            location,
            access,
            device,
            live: BTreeMap::new(),
        })
    }

    /// Number of IOVA slots windows may use.
    pub fn slots(&self) -> u32 {
        self.map.windows() - 1
    }

    /// Register every layout region of window `slot` on every device. All or nothing: on an
    /// error, what this call registered is deregistered again.
    pub fn register<B: VerbsBackend>(
        &mut self,
        b: &mut B,
        slot: u32,
    ) -> Result<(), WindowRegisterError> {
        let bases = self.map.region_bases(slot);
        let mut regions = Vec::with_capacity(self.host.len());
        for (i, (&(addr, length), &iova)) in self.host.iter().zip(bases.iter()).enumerate() {
            // The spans are memory the target keeps mapped (its own buffer, the host's regions
            // under `HostRegion::new`'s contract, or device regions under `DeviceRegion::new`'s)
            // until every window is deregistered (`deregister_all`, run before the memory is
            // released).
            let keys = match &self.device {
                // SAFETY: a span kept mapped until deregistered (above).
                None => unsafe { b.register_memory_iova(addr, length, iova, self.access) }
                    .map_err(WindowRegisterError::from),
                // SAFETY: as above, device memory.
                Some(export) => unsafe {
                    register_device_region(b, &**export, i, addr, length, iova, self.access)
                }
                .map(|(_, keys)| keys)
                .map_err(WindowRegisterError::from),
            };
            match keys {
                Ok(keys) => regions.push(RegisteredRegion {
                    location: self.location.clone(),
                    addr: iova,
                    length,
                    keys,
                }),
                Err(e) => {
                    for r in &regions {
                        if let Err(e2) = b.deregister_memory(r.addr) {
                            tracing::warn!(error = %e2, iova = r.addr, "undoing a window registration failed");
                        }
                    }
                    return Err(e);
                }
            }
        }
        self.live.insert(slot, (regions, bases));
        Ok(())
    }

    /// Deregister window `slot` on every device. On an error the slot stays live (its keys may
    /// still work) with the regions that could not be deregistered.
    pub fn deregister<B: VerbsBackend>(&mut self, b: &mut B, slot: u32) -> Result<(), VerbsError> {
        let Some((regions, bases)) = self.live.remove(&slot) else {
            return Ok(());
        };
        let mut left = Vec::new();
        let mut first = None;
        for r in regions {
            if let Err(e) = b.deregister_memory(r.addr) {
                first.get_or_insert(e);
                left.push(r);
            }
        }
        match first {
            None => Ok(()),
            Some(e) => {
                self.live.insert(slot, (left, bases));
                Err(e)
            }
        }
    }

    /// Deregister every window (the target stops); the first error, if any.
    pub fn deregister_all<B: VerbsBackend>(&mut self, b: &mut B) -> Result<(), VerbsError> {
        let mut first = None;
        for slot in self.live.keys().copied().collect::<Vec<_>>() {
            if let Err(e) = self.deregister(b, slot) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Whether the spans are device memory (registered through GPUDirect).
    pub fn is_device(&self) -> bool {
        self.device.is_some()
    }

    /// Bytes of every layout region, in layout order (what each span must hold).
    pub fn region_lens(&self) -> Vec<u64> {
        self.map
            .region_spans()
            .iter()
            .map(|&(_, len)| len)
            .collect()
    }

    /// Back every window registered from now on with `host` (one span per layout region,
    /// each long enough; checked by the caller). Only with no window live: the old spans'
    /// registrations are all gone, so no key reaches them.
    pub fn replace_memory(&mut self, host: Vec<HostSpan>) {
        debug_assert!(self.live.is_empty(), "a window on the old memory is live");
        self.host = host;
    }

    /// Whether anything is still registered.
    pub fn any_live(&self) -> bool {
        !self.live.is_empty()
    }

    /// The advertised base of every region of live window `slot`.
    pub fn bases(&self, slot: u32) -> Option<RegionBases> {
        self.live.get(&slot).map(|(_, b)| b.clone())
    }

    /// Bases no registration covers: what a pull gets when no window is clean, so that P's
    /// writes fail with a remote access error instead of landing anywhere.
    pub fn unregistered_bases(&self) -> RegionBases {
        self.map.region_bases(self.map.windows() - 1)
    }

    /// Every live registration, for the descriptor (slot order, then region order).
    pub fn regions(&self) -> Vec<RegisteredRegion> {
        self.live
            .values()
            .flat_map(|(r, _)| r.iter().cloned())
            .collect()
    }
}
