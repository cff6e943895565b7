//! The narrow trait every verbs call goes through. The handshake and fence logic only ever talk
//! to this trait, so they are tested with `FakeVerbs` and run with `IbvDevices` (feature `rdma`).

use std::os::fd::OwnedFd;

use thiserror::Error;

use super::nic::LocalNic;
use super::qp_attrs::{QpState, QpTransition};

/// A queue pair: QP numbers are unique per device only, so the device index is part of the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId {
    /// The device, as an index into the backend's list of NICs.
    pub nic: usize,
    /// The QP's number on that device.
    pub qp_num: u32,
}

/// Access rights of a memory registration. P only writes into D (PROTOCOL.md §6), so remote
/// write is the default and remote read is opt-in; remote atomics are never granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrAccess {
    /// Also allow one-sided READs (interop tests that read back; vLLM never reads from D).
    pub remote_read: bool,
}

/// The keys of one region on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    pub lkey: u32,
    pub rkey: u32,
}

/// Why a verbs operation failed. Carries errno (not `io::Error`) so errors compare in tests.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// libibverbs is present but reports no RDMA device (or none passed the configured filter).
    #[error("no RDMA device found{0}")]
    NoDevice(String),
    /// The kernel side is missing (no `ib_uverbs`, no provider library): the device list itself
    /// could not be read.
    #[error("RDMA is not available on this host: {0}")]
    Unavailable(String),
    /// A configured device name is not present.
    #[error("RDMA device {0:?} not found")]
    UnknownDevice(String),
    /// A device's port is not active.
    #[error("RDMA device {nic}: port {port} is not active (state {state})")]
    PortNotActive {
        /// The device.
        nic: String,
        /// Its port.
        port: u8,
        /// The port's state (`ibv_port_state`).
        state: u32,
    },
    /// A device's port has no GID Mooncake's ranking accepts.
    #[error("RDMA device {nic}: no usable GID on port {port}{detail}")]
    NoGid {
        /// The device.
        nic: String,
        /// Its port.
        port: u8,
        /// What its GIDs were.
        detail: String,
    },
    /// Every device was skipped (port down, no usable GID, not present, open failed); each
    /// entry says why.
    #[error("no usable RDMA device: {}", describe_skipped(.0))]
    NoUsableDevice(Vec<SkippedDevice>),
    /// `RLIMIT_MEMLOCK` (even raised to the hard limit) is below what registering needs.
    #[error(
        "memory registration needs {need} bytes locked ({nics} NIC(s), plus {pinned} bytes \
         already pinned) but RLIMIT_MEMLOCK is {} (hard {}): raise it (`ulimit -l unlimited`, \
         systemd LimitMEMLOCK=infinity, docker --ulimit memlock=-1) or give kvrecv CAP_IPC_LOCK",
        super::memlock::show(*.soft), super::memlock::show(*.hard)
    )]
    MemlockTooLow {
        /// Bytes the registrations lock.
        need: u64,
        /// NICs registered on.
        nics: usize,
        /// Bytes already pinned by this process.
        pinned: u64,
        /// The soft limit.
        soft: u64,
        /// The hard limit.
        hard: u64,
    },
    /// A queue pair that is not (or no longer) there.
    #[error("no such queue pair {0:?}")]
    UnknownQp(QpId),
    /// No registration at this address.
    #[error("no memory registration at IOVA {0:#x}")]
    UnknownRegion(u64),
    /// A region of length 0.
    #[error("cannot register an empty region at {0:#x}")]
    EmptyRegion(u64),
    /// A verbs call returned an error.
    #[error("{op} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The call.
        op: &'static str,
        /// Its `errno`.
        errno: i32,
    },
}

/// The verbs operations D needs. Implementations: `FakeVerbs` (tests), `IbvDevices` (feature
/// `rdma`). Every method is a short synchronous syscall, so callers may hold a lock across it.
pub trait VerbsBackend: Send {
    /// The opened devices, in descriptor order (the order of every lkey/rkey array).
    fn nics(&self) -> &[LocalNic];

    /// Create `count` RC queue pairs on device `nic` (state RESET).
    fn create_rc_qps(&mut self, nic: usize, count: usize) -> Result<Vec<QpId>, VerbsError>;

    /// One `ibv_modify_qp`.
    fn modify_qp(&mut self, qp: QpId, transition: &QpTransition) -> Result<(), VerbsError>;

    /// `ibv_query_qp` for the state only: how a fence is confirmed.
    fn query_qp_state(&self, qp: QpId) -> Result<QpState, VerbsError>;

    /// Destroy a queue pair (after which its number is invalid).
    fn destroy_qp(&mut self, qp: QpId) -> Result<(), VerbsError>;

    /// Register `[addr, addr + length)` on every device; keys come back in device order. P
    /// addresses the bytes at their own virtual address (`iova == addr`).
    ///
    /// # Safety
    /// As [`register_memory_iova`](Self::register_memory_iova).
    unsafe fn register_memory(
        &mut self,
        addr: u64,
        length: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        // SAFETY: the caller's contract is this method's.
        unsafe { self.register_memory_iova(addr, length, addr, access) }
    }

    /// Register `[addr, addr + length)` on every device so that remote writes address it as
    /// `[iova, iova + length)` (`ibv_reg_mr_iova2`). The same bytes may be registered several
    /// times at different IOVAs, each with its own rkey: that is how a landing window gets keys
    /// of its own, which a fence can destroy without touching the others (DESIGN.md §5).
    /// Registrations are named by their IOVA, unique per backend.
    ///
    /// # Safety
    /// The range must be memory of this process that stays mapped until
    /// [`deregister_memory`](Self::deregister_memory) returns, and nothing else may rely on its
    /// contents while registered: any peer holding an rkey can write to it at any time.
    unsafe fn register_memory_iova(
        &mut self,
        addr: u64,
        length: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError>;

    /// Drop the registration whose IOVA is `iova` on every device. Once this returns, no write
    /// with its rkeys can reach memory (the NIC answers a remote access error).
    fn deregister_memory(&mut self, iova: u64) -> Result<(), VerbsError>;

    /// Before registering `bytes_per_nic` (page-rounded) on every device: make sure
    /// `RLIMIT_MEMLOCK` allows it, raising the soft limit to the hard one if that is enough
    /// ([`super::memlock::plan`]), else [`VerbsError::MemlockTooLow`]. Default: nothing to check
    /// (a backend that pins nothing).
    fn ensure_memlock(&mut self, bytes_per_nic: u64) -> Result<(), VerbsError> {
        let _ = bytes_per_nic;
        Ok(())
    }

    /// The async events pending now, without blocking (libibverbs: `ibv_get_async_event` on
    /// each device's non-blocking async fd until EAGAIN, each acknowledged). Default: none.
    fn take_async_events(&mut self) -> Vec<AsyncEvent> {
        Vec::new()
    }

    /// File descriptors that turn readable when an async event is pending (libibverbs: each
    /// device's `async_fd`). Owned by the backend and open for as long as it lives. Default:
    /// none.
    fn async_event_fds(&self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }

    /// Register `length` bytes of device memory from the dma-buf `buf` (starting
    /// `buf.offset` into it) on every device, with `iova` as the address
    /// P writes to; keys in device order, deregistered by `iova` through
    /// [`deregister_memory`](Self::deregister_memory). `ibv_reg_dmabuf_mr`. By default (a
    /// backend without it): `EOPNOTSUPP`.
    ///
    /// # Safety
    /// As [`register_memory`](Self::register_memory): the dma-buf's memory stays allocated
    /// until deregistered, and any peer holding an rkey can write to it at any time.
    unsafe fn register_dmabuf(
        &mut self,
        buf: &DmaBuf,
        iova: u64,
        length: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        let _ = (buf, iova, length, access);
        Err(VerbsError::Os {
            op: "ibv_reg_dmabuf_mr",
            errno: libc::EOPNOTSUPP,
        })
    }
}

// The vocabulary of the trait's calls and errors, here so that the modules using the backend
// (device selection, GPUDirect, async events) import it and it imports none of them.

/// A device left out, and why (a [`VerbsError`] naming it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedDevice {
    /// The device's name (`mlx5_0`).
    pub name: String,
    /// Why it was left out.
    pub reason: VerbsError,
}

impl SkippedDevice {
    /// The metric label of the reason.
    pub fn reason_label(&self) -> &'static str {
        match self.reason {
            VerbsError::UnknownDevice(_) => "not_present",
            VerbsError::PortNotActive { .. } => "port_not_active",
            VerbsError::NoGid { .. } => "no_gid",
            _ => "open_failed",
        }
    }
}

/// `name: reason; name: reason` (the `NoUsableDevice` message).
pub fn describe_skipped(skipped: &[SkippedDevice]) -> String {
    skipped
        .iter()
        .map(|s| format!("{}: {}", s.name, s.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A dma-buf exported for a device region: `fd` covers the allocation holding it, the region
/// starts `offset` bytes into it.
#[derive(Debug)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // built under rdma and cuda, and for tests
pub struct DmaBuf {
    /// The dma-buf; closed once registered (the registration holds its own reference).
    pub fd: OwnedFd,
    /// Where the region starts inside the dma-buf.
    pub offset: u64,
}

/// One async event of device `nic` (index into `VerbsBackend::nics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    pub nic: usize,
    pub kind: AsyncEventKind,
}

/// What happened (`ibv_event_type`), with the QP number or port it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // built under rdma and cuda, and for tests
pub enum AsyncEventKind {
    /// `IBV_EVENT_QP_FATAL`: the QP is in ERR.
    QpFatal { qp_num: u32 },
    /// `IBV_EVENT_QP_REQ_ERR`: invalid request; the QP is in ERR.
    QpReqErr { qp_num: u32 },
    /// `IBV_EVENT_QP_ACCESS_ERR`: an access violation (e.g. a bad rkey); the QP is in ERR.
    QpAccessErr { qp_num: u32 },
    /// `IBV_EVENT_PATH_MIG_ERR`.
    PathMigErr { qp_num: u32 },
    /// `IBV_EVENT_PORT_ERR`: the port went down.
    PortErr { port: u8 },
    /// `IBV_EVENT_DEVICE_FATAL`: the device is unusable.
    DeviceFatal,
    /// Anything else (`COMM_EST`, `PORT_ACTIVE`, `LID_CHANGE`, `GID_CHANGE`, ...): logged only.
    Other { code: u32 },
}

impl AsyncEventKind {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            AsyncEventKind::QpFatal { .. } => "qp_fatal",
            AsyncEventKind::QpReqErr { .. } => "qp_req_err",
            AsyncEventKind::QpAccessErr { .. } => "qp_access_err",
            AsyncEventKind::PathMigErr { .. } => "path_mig_err",
            AsyncEventKind::PortErr { .. } => "port_err",
            AsyncEventKind::DeviceFatal => "device_fatal",
            AsyncEventKind::Other { .. } => "other",
        }
    }

    /// The QP this event says failed, if it is one.
    pub fn failed_qp(&self) -> Option<u32> {
        match *self {
            AsyncEventKind::QpFatal { qp_num }
            | AsyncEventKind::QpReqErr { qp_num }
            | AsyncEventKind::QpAccessErr { qp_num }
            | AsyncEventKind::PathMigErr { qp_num } => Some(qp_num),
            _ => None,
        }
    }
}
