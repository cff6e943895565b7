//! The real [`VerbsBackend`], on libibverbs through `ibverbs-sys` (feature `rdma`).
//!
//! Raw bindings rather than the `ibverbs` crate's safe API: that API cannot register caller-owned
//! memory, choose access flags, set Mooncake's RTR attributes (hop limit 16, port, MTU) nor move
//! a QP to ERR, and its pointers are private, so the two cannot be mixed.
//!
//! A binary built with this feature is dynamically linked to `libibverbs.so.1` and does not start
//! without it; "no RDMA here" at run time therefore means no device ([`VerbsError::NoDevice`])
//! or no kernel support ([`VerbsError::Unavailable`]).

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::os::fd::AsRawFd;
use std::ptr;

use ibverbs_sys as ffi;

use super::backend::{AsyncEvent, AsyncEventKind};
use super::backend::{MrAccess, MrKeys, QpId, VerbsBackend, VerbsError};
use super::backend::SkippedDevice;
use super::device_select::{self, describe_port, devices_to_open, PortProbe};
use super::gid::Gid;
use super::gid_rank::{GidEntryInfo, GidKind};
use super::gpudirect::DmaBuf;
use super::nic::LocalNic;
use super::qp_attrs::{QpState, QpTransition};

/// Which devices to open and how (Mooncake's `MC_*` knobs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDeviceConfig {
    /// Device names to use, in this order (Mooncake's device filter); `None` = every device in
    /// libibverbs' order. A listed device that is absent or unusable is skipped.
    pub devices: Option<Vec<String>>,
    /// Port number (`MC_IB_PORT`, default 1).
    pub port: u8,
    /// GID index (`MC_GID_INDEX`); `None` = the best one as Mooncake ranks them
    /// (`gid_rank::select_gid`).
    pub gid_index: Option<u8>,
    /// Completion queue size. D posts no work requests; the CQ exists because a QP needs one.
    pub cq_entries: i32,
}

impl Default for RdmaDeviceConfig {
    fn default() -> Self {
        RdmaDeviceConfig {
            devices: None,
            port: 1,
            gid_index: None,
            cq_entries: 16,
        }
    }
}

/// Per-device resources: context, protection domain, one CQ shared by its QPs.
struct DeviceResources {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
}

/// Opened RDMA devices and everything created on them.
pub struct IbvDevices {
    nics: Vec<LocalNic>,
    devices: Vec<DeviceResources>,
    qps: BTreeMap<QpId, *mut ffi::ibv_qp>,
    /// Registration IOVA → one MR per device.
    mrs: BTreeMap<u64, Vec<*mut ffi::ibv_mr>>,
}

// SAFETY: libibverbs objects may be used from any thread (verbs are thread-safe); the raw
// pointers are owned by this struct and only reached through `&mut self` or `&self` calls.
unsafe impl Send for IbvDevices {}

impl std::fmt::Debug for IbvDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvDevices")
            .field("nics", &self.nics)
            .field("qps", &self.qps.len())
            .finish()
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn os(op: &'static str, errno: i32) -> VerbsError {
    VerbsError::Os { op, errno }
}

/// The network interface with index `ifindex` (0: none), as sysfs `gid_attrs/ndevs` names it.
fn interface_name(ifindex: u32) -> Option<String> {
    if ifindex == 0 {
        return None;
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has the IF_NAMESIZE bytes `if_indextoname` may write.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success `buf` holds a NUL-terminated name.
    Some(
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// sysfs `/sys/class/infiniband/<dev>/device/numa_node` (what Mooncake's topology reads);
/// `None` for -1 (no NUMA affinity) or unreadable.
fn numa_node(device: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/infiniband/{device}/device/numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok())
}

/// From `/proc/self/status`: bytes already pinned (`VmPin`) and whether `CAP_IPC_LOCK` (bit 14)
/// is effective (the kernel then ignores RLIMIT_MEMLOCK for registrations).
fn proc_status() -> (u64, bool) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let pinned = field("VmPin:")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    let cap = field("CapEff:")
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .is_some_and(|bits| bits & (1 << 14) != 0);
    (pinned, cap)
}

impl IbvDevices {
    /// Open the configured devices (every one, or the `devices` list), allocate a PD and a CQ on
    /// each usable one. A device whose port is not ACTIVE, that has no usable GID, or that fails
    /// to open is skipped with a warning (as Mooncake does); [`VerbsError::NoUsableDevice`] when
    /// none is left, naming why each was skipped.
    pub fn open(config: &RdmaDeviceConfig) -> Result<IbvDevices, VerbsError> {
        let mut num = 0;
        // SAFETY: plain libibverbs call; the list is freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut num) };
        if list.is_null() {
            return Err(VerbsError::Unavailable(
                std::io::Error::last_os_error().to_string(),
            ));
        }
        // SAFETY: `list` holds `num` valid device pointers until freed.
        let all: Vec<(String, *mut ffi::ibv_device)> = (0..num.max(0) as usize)
            .map(|i| unsafe {
                let dev = *list.add(i);
                let name = CStr::from_ptr(ffi::ibv_get_device_name(dev))
                    .to_string_lossy()
                    .into_owned();
                (name, dev)
            })
            .collect();
        let result = Self::open_from(config, &all);
        // SAFETY: contexts opened from the list stay valid after the list is freed.
        unsafe { ffi::ibv_free_device_list(list) };
        result
    }

    fn open_from(
        config: &RdmaDeviceConfig,
        all: &[(String, *mut ffi::ibv_device)],
    ) -> Result<IbvDevices, VerbsError> {
        if all.is_empty() {
            return Err(VerbsError::NoDevice(String::new()));
        }
        let present: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
        let (names, mut skipped) = devices_to_open(config.devices.as_deref(), &present);
        let mut me = IbvDevices {
            nics: Vec::new(),
            devices: Vec::new(),
            qps: BTreeMap::new(),
            mrs: BTreeMap::new(),
        };
        for name in names {
            let Some(&(_, dev)) = all.iter().find(|(n, _)| *n == name) else {
                continue;
            };
            match Self::open_one(config, &name, dev) {
                Ok((nic, res)) => {
                    tracing::info!(device = %nic.name, port = nic.port, gid_index = nic.gid_index,
                        gid = %nic.gid, link_layer = ?nic.link_layer, numa_node = ?nic.numa_node,
                        "RDMA device opened");
                    me.nics.push(nic);
                    me.devices.push(res);
                }
                Err(reason) => skipped.push(SkippedDevice { name, reason }),
            }
        }
        // On error `me` is dropped and releases what was opened.
        me.nics = device_select::finish(std::mem::take(&mut me.nics), skipped)?;
        device_select::warn_if_mixed(&me.nics);
        Ok(me)
    }

    fn open_one(
        config: &RdmaDeviceConfig,
        name: &str,
        dev: *mut ffi::ibv_device,
    ) -> Result<(LocalNic, DeviceResources), VerbsError> {
        // SAFETY: `dev` comes from a live device list.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(os("ibv_open_device", last_errno()));
        }
        let mut res = DeviceResources {
            ctx,
            pd: ptr::null_mut(),
            cq: ptr::null_mut(),
        };
        let nic = match Self::probe(config, name, ctx)
            .and_then(|probe| describe_port(name, config.port, config.gid_index, &probe))
        {
            Ok(nic) => nic,
            Err(e) => {
                release(&res);
                return Err(e);
            }
        };
        // Non-blocking, so that `take_async_events` drains without waiting (Mooncake does the
        // same before polling it).
        // SAFETY: `ctx` is open; its `async_fd` is a descriptor it owns.
        let nonblocking = unsafe {
            let fd = (*ctx).async_fd;
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !nonblocking {
            let e = os("fcntl(async_fd, O_NONBLOCK)", last_errno());
            release(&res);
            return Err(e);
        }
        // SAFETY: `ctx` is open.
        res.pd = unsafe { ffi::ibv_alloc_pd(ctx) };
        if res.pd.is_null() {
            let e = os("ibv_alloc_pd", last_errno());
            release(&res);
            return Err(e);
        }
        // SAFETY: `ctx` is open; no completion channel, vector 0.
        res.cq = unsafe {
            ffi::ibv_create_cq(ctx, config.cq_entries, ptr::null_mut(), ptr::null_mut(), 0)
        };
        if res.cq.is_null() {
            let e = os("ibv_create_cq", last_errno());
            release(&res);
            return Err(e);
        }
        Ok((nic, res))
    }

    /// Port state, LID, MTU, link layer, the GID table with each entry's network device, and
    /// the device's NUMA node: what `describe_port` decides on.
    fn probe(
        config: &RdmaDeviceConfig,
        name: &str,
        ctx: *mut ffi::ibv_context,
    ) -> Result<PortProbe, VerbsError> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; `attr` is a valid out-parameter.
        let rc = unsafe { ffi::ibv_query_port(ctx, config.port, &mut attr as *mut _ as *mut _) };
        if rc != 0 {
            return Err(os("ibv_query_port", rc));
        }
        let len = attr.gid_tbl_len.max(0) as usize;
        // SAFETY: all-zero is a valid `ibv_gid_entry` (plain integers and a byte union).
        let mut table: Vec<ffi::ibv_gid_entry> = vec![unsafe { std::mem::zeroed() }; len];
        // SAFETY: `table` has room for `len` entries of the size passed.
        let n = unsafe {
            ffi::_ibv_query_gid_table(
                ctx,
                table.as_mut_ptr(),
                len,
                0,
                std::mem::size_of::<ffi::ibv_gid_entry>(),
            )
        };
        if n < 0 {
            return Err(os("ibv_query_gid_table", (-n) as i32));
        }
        let gids = table[..n as usize]
            .iter()
            .filter(|e| e.port_num == u32::from(config.port) && e.gid_index <= u32::from(u8::MAX))
            .filter_map(|e| {
                let kind = match e.gid_type {
                    ffi::IBV_GID_TYPE_IB => GidKind::Ib,
                    ffi::IBV_GID_TYPE_ROCE_V1 => GidKind::RoceV1,
                    ffi::IBV_GID_TYPE_ROCE_V2 => GidKind::RoceV2,
                    _ => return None,
                };
                Some(GidEntryInfo {
                    index: e.gid_index as u8,
                    // SAFETY: every bit pattern of the union is a valid byte array.
                    gid: Gid(unsafe { e.gid.raw }),
                    kind,
                    ndev: interface_name(e.ndev_ifindex),
                })
            })
            .collect();
        Ok(PortProbe {
            state: attr.state,
            lid: attr.lid,
            active_mtu: attr.active_mtu,
            link_layer: attr.link_layer,
            gids,
            numa_node: numa_node(name),
        })
    }

    fn qp(&self, qp: QpId) -> Result<*mut ffi::ibv_qp, VerbsError> {
        self.qps.get(&qp).copied().ok_or(VerbsError::UnknownQp(qp))
    }
}

/// Destroy CQ, PD and context (whichever exist). Errors are logged: nothing else can be done.
fn release(res: &DeviceResources) {
    // SAFETY: each pointer is either null or a live object created on `res.ctx`, destroyed once,
    // children before parents.
    unsafe {
        if !res.cq.is_null() && ffi::ibv_destroy_cq(res.cq) != 0 {
            tracing::warn!("ibv_destroy_cq failed");
        }
        if !res.pd.is_null() && ffi::ibv_dealloc_pd(res.pd) != 0 {
            tracing::warn!("ibv_dealloc_pd failed");
        }
        if !res.ctx.is_null() && ffi::ibv_close_device(res.ctx) != 0 {
            tracing::warn!("ibv_close_device failed");
        }
    }
}

impl Drop for IbvDevices {
    fn drop(&mut self) {
        for (_, qp) in std::mem::take(&mut self.qps) {
            // SAFETY: live QP owned by us.
            unsafe { ffi::ibv_destroy_qp(qp) };
        }
        for (_, mrs) in std::mem::take(&mut self.mrs) {
            for mr in mrs {
                // SAFETY: live MR owned by us.
                unsafe { ffi::ibv_dereg_mr(mr) };
            }
        }
        for res in &self.devices {
            release(res);
        }
    }
}

fn access_bits(local_write: bool, remote_read: bool, remote_write: bool, atomic: bool) -> u32 {
    let mut a = 0;
    if local_write {
        a |= ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if remote_read {
        a |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if remote_write {
        a |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    if atomic {
        a |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
    }
    a
}

/// The `ibv_qp_attr` and mask of one transition (masks as in Mooncake's `doSetupConnection`).
fn qp_attr(t: &QpTransition) -> (ffi::ibv_qp_attr, u32) {
    use ffi::ibv_qp_attr_mask as m;
    use ffi::ibv_qp_state as s;
    let mut a = ffi::ibv_qp_attr::default();
    let mask = match t {
        QpTransition::ToReset => {
            a.qp_state = s::IBV_QPS_RESET;
            m::IBV_QP_STATE
        }
        QpTransition::ToErr => {
            a.qp_state = s::IBV_QPS_ERR;
            m::IBV_QP_STATE
        }
        QpTransition::ToInit(i) => {
            a.qp_state = s::IBV_QPS_INIT;
            a.port_num = i.port;
            a.pkey_index = i.pkey_index;
            a.qp_access_flags = access_bits(
                i.access.local_write,
                i.access.remote_read,
                i.access.remote_write,
                i.access.remote_atomic,
            );
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS
        }
        QpTransition::ToRtr(r) => {
            a.qp_state = s::IBV_QPS_RTR;
            a.path_mtu = r.path_mtu.code();
            a.dest_qp_num = r.dest_qp_num;
            a.rq_psn = r.rq_psn;
            a.max_dest_rd_atomic = r.max_dest_rd_atomic;
            a.min_rnr_timer = r.min_rnr_timer;
            a.ah_attr.is_global = 1;
            a.ah_attr.dlid = r.dlid;
            a.ah_attr.sl = r.sl;
            a.ah_attr.port_num = r.port;
            a.ah_attr.grh.dgid.raw = r.dgid.0;
            a.ah_attr.grh.sgid_index = r.sgid_index;
            a.ah_attr.grh.hop_limit = r.hop_limit;
            a.ah_attr.grh.traffic_class = r.traffic_class;
            m::IBV_QP_STATE
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_MIN_RNR_TIMER
                | m::IBV_QP_AV
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
        }
        QpTransition::ToRts(r) => {
            a.qp_state = s::IBV_QPS_RTS;
            a.timeout = r.timeout;
            a.retry_cnt = r.retry_cnt;
            a.rnr_retry = r.rnr_retry;
            a.sq_psn = r.sq_psn;
            a.max_rd_atomic = r.max_rd_atomic;
            m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC
        }
    };
    (a, mask.0)
}

/// `ibv_reg_dmabuf_mr`, looked up at run time: it exists from rdma-core v34 (libibverbs
/// 1.12) on, and linking it directly would stop kvrecv from loading against an older
/// libibverbs even where no device memory is registered.
type RegDmabufMr = unsafe extern "C" fn(
    *mut ffi::ibv_pd,
    u64,
    usize,
    u64,
    std::os::raw::c_int,
    std::os::raw::c_int,
) -> *mut ffi::ibv_mr;

fn reg_dmabuf_mr() -> Option<RegDmabufMr> {
    // SAFETY: dlsym with a NUL-terminated name; the symbol, when present, has this C signature
    // (verbs.h).
    unsafe {
        let p = libc::dlsym(libc::RTLD_DEFAULT, c"ibv_reg_dmabuf_mr".as_ptr());
        (!p.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, RegDmabufMr>(p))
    }
}

impl IbvDevices {
    /// One MR per device from `reg(pd)`, kept under `addr`; all or nothing.
    /// `reg` on every device's PD; the registrations are named by `iova` (what P writes to).
    fn register_on_every_device(
        &mut self,
        op: &'static str,
        iova: u64,
        length: u64,
        reg: impl Fn(*mut ffi::ibv_pd) -> *mut ffi::ibv_mr,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        if length == 0 {
            return Err(VerbsError::EmptyRegion(iova));
        }
        if self.mrs.contains_key(&iova) {
            return Err(os(op, libc::EEXIST));
        }
        let mut mrs = Vec::with_capacity(self.devices.len());
        for res in &self.devices {
            let mr = reg(res.pd);
            if mr.is_null() {
                let e = os(op, last_errno());
                for mr in mrs {
                    // SAFETY: registered just above.
                    unsafe { ffi::ibv_dereg_mr(mr) };
                }
                return Err(e);
            }
            mrs.push(mr);
        }
        // SAFETY: every `mr` is live.
        let keys = mrs
            .iter()
            .map(|&mr| unsafe {
                MrKeys {
                    lkey: (*mr).lkey,
                    rkey: (*mr).rkey,
                }
            })
            .collect();
        self.mrs.insert(iova, mrs);
        Ok(keys)
    }
}

impl VerbsBackend for IbvDevices {
    fn nics(&self) -> &[LocalNic] {
        &self.nics
    }

    fn create_rc_qps(&mut self, nic: usize, count: usize) -> Result<Vec<QpId>, VerbsError> {
        let res = self
            .devices
            .get(nic)
            .ok_or_else(|| VerbsError::UnknownDevice(format!("#{nic}")))?;
        let (pd, cq) = (res.pd, res.cq);
        let mut created = Vec::with_capacity(count);
        for _ in 0..count {
            let mut init = ffi::ibv_qp_init_attr {
                qp_context: ptr::null_mut(),
                send_cq: cq,
                recv_cq: cq,
                srq: ptr::null_mut(),
                // D never posts: the smallest queues every device accepts.
                cap: ffi::ibv_qp_cap {
                    max_send_wr: 1,
                    max_recv_wr: 1,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
                qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
                sq_sig_all: 0,
            };
            // SAFETY: `pd` and `cq` are live objects of device `nic`.
            let qp = unsafe { ffi::ibv_create_qp(pd, &mut init) };
            if qp.is_null() {
                let e = os("ibv_create_qp", last_errno());
                for id in created {
                    let _ = self.destroy_qp(id);
                }
                return Err(e);
            }
            // SAFETY: `qp` is live (non-null, just created).
            let qp_num = unsafe { (*qp).qp_num };
            let id = QpId { nic, qp_num };
            self.qps.insert(id, qp);
            created.push(id);
        }
        Ok(created)
    }

    fn modify_qp(&mut self, qp: QpId, transition: &QpTransition) -> Result<(), VerbsError> {
        let raw = self.qp(qp)?;
        let (mut attr, mask) = qp_attr(transition);
        // SAFETY: `raw` is live; `attr` is fully initialised for the bits in `mask`.
        let rc = unsafe { ffi::ibv_modify_qp(raw, &mut attr, mask as i32) };
        if rc != 0 {
            return Err(os("ibv_modify_qp", rc));
        }
        Ok(())
    }

    fn query_qp_state(&self, qp: QpId) -> Result<QpState, VerbsError> {
        let raw = self.qp(qp)?;
        let mut attr = ffi::ibv_qp_attr::default();
        // SAFETY: all-zero is a valid `ibv_qp_init_attr` (integers and null pointers).
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
        // SAFETY: `raw` is live; both out-parameters are valid.
        let rc = unsafe { ffi::ibv_query_qp(raw, &mut attr, mask, &mut init) };
        if rc != 0 {
            return Err(os("ibv_query_qp", rc));
        }
        use ffi::ibv_qp_state as s;
        Ok(match attr.qp_state {
            s::IBV_QPS_RESET => QpState::Reset,
            s::IBV_QPS_INIT => QpState::Init,
            s::IBV_QPS_RTR => QpState::Rtr,
            s::IBV_QPS_RTS => QpState::Rts,
            s::IBV_QPS_ERR => QpState::Err,
            other => QpState::Other(other),
        })
    }

    fn destroy_qp(&mut self, qp: QpId) -> Result<(), VerbsError> {
        let raw = self.qp(qp)?;
        // SAFETY: `raw` is live and removed from the table only on success.
        let rc = unsafe { ffi::ibv_destroy_qp(raw) };
        if rc != 0 {
            return Err(os("ibv_destroy_qp", rc));
        }
        self.qps.remove(&qp);
        Ok(())
    }

    unsafe fn register_memory_iova(
        &mut self,
        addr: u64,
        length: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        // REMOTE_WRITE requires LOCAL_WRITE (verbs rule); never REMOTE_ATOMIC.
        let bits = access_bits(true, access.remote_read, true, false);
        self.register_on_every_device("ibv_reg_mr_iova2", iova, length, |pd| {
            // SAFETY: the caller guarantees the range stays mapped while registered.
            // `ibv_reg_mr_iova2` (libibverbs 1.8+) lets the same bytes be registered once per
            // landing window, each at its own IOVA with its own keys.
            unsafe { ffi::ibv_reg_mr_iova2(pd, addr as *mut _, length as usize, iova, bits) }
        })
    }

    fn take_async_events(&mut self) -> Vec<AsyncEvent> {
        let mut out = Vec::new();
        for (nic, res) in self.devices.iter().enumerate() {
            loop {
                // SAFETY: all-zero is a valid out-parameter (a null pointer in the union).
                let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
                // SAFETY: `res.ctx` is open and its async fd non-blocking: returns -1 (EAGAIN)
                // when nothing is pending.
                if unsafe { ffi::ibv_get_async_event(res.ctx, &mut ev) } != 0 {
                    break;
                }
                // SAFETY: the union member read is the one `event_type` says is set, and a QP
                // named by an event cannot be destroyed before the event is acknowledged.
                let qp_num = || unsafe { (*ev.element.qp).qp_num };
                let kind = match ev.event_type {
                    ffi::IBV_EVENT_QP_FATAL => AsyncEventKind::QpFatal { qp_num: qp_num() },
                    ffi::IBV_EVENT_QP_REQ_ERR => AsyncEventKind::QpReqErr { qp_num: qp_num() },
                    ffi::IBV_EVENT_QP_ACCESS_ERR => {
                        AsyncEventKind::QpAccessErr { qp_num: qp_num() }
                    }
                    ffi::IBV_EVENT_PATH_MIG_ERR => AsyncEventKind::PathMigErr { qp_num: qp_num() },
                    ffi::IBV_EVENT_PORT_ERR => AsyncEventKind::PortErr {
                        // SAFETY: port events set `port_num`.
                        port: u8::try_from(unsafe { ev.element.port_num }).unwrap_or(0),
                    },
                    ffi::IBV_EVENT_DEVICE_FATAL => AsyncEventKind::DeviceFatal,
                    code => AsyncEventKind::Other { code },
                };
                // SAFETY: `ev` came from `ibv_get_async_event` and is acknowledged once.
                unsafe { ffi::ibv_ack_async_event(&mut ev) };
                out.push(AsyncEvent { nic, kind });
            }
        }
        out
    }

    fn async_event_fds(&self) -> Vec<std::os::fd::RawFd> {
        // SAFETY: every `ctx` is open while `self` lives.
        self.devices
            .iter()
            .map(|res| unsafe { (*res.ctx).async_fd })
            .collect()
    }

    fn ensure_memlock(&mut self, bytes_per_nic: u64) -> Result<(), VerbsError> {
        use super::memlock::{pinned_bytes, plan, MemlockPlan};
        use rlimit::Resource;
        let (soft, hard) = Resource::MEMLOCK
            .get()
            .map_err(|e| os("getrlimit(RLIMIT_MEMLOCK)", e.raw_os_error().unwrap_or(0)))?;
        // SAFETY: sysconf has no preconditions.
        let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let nics = self.devices.len();
        let need = pinned_bytes([bytes_per_nic], nics, page);
        let (pinned, cap) = proc_status();
        match plan(soft, hard, pinned, need, cap) {
            MemlockPlan::Enough => Ok(()),
            MemlockPlan::RaiseSoft { to } => {
                Resource::MEMLOCK
                    .set(to, hard)
                    .map_err(|e| os("setrlimit(RLIMIT_MEMLOCK)", e.raw_os_error().unwrap_or(0)))?;
                tracing::info!(
                    from = soft,
                    to,
                    need,
                    "RLIMIT_MEMLOCK soft limit raised for RDMA registration"
                );
                Ok(())
            }
            MemlockPlan::TooLow => Err(VerbsError::MemlockTooLow {
                need,
                nics,
                pinned,
                soft,
                hard,
            }),
        }
    }

    fn deregister_memory(&mut self, iova: u64) -> Result<(), VerbsError> {
        let mrs = self
            .mrs
            .remove(&iova)
            .ok_or(VerbsError::UnknownRegion(iova))?;
        let mut first = None;
        for mr in mrs {
            // SAFETY: live MR owned by us, deregistered once.
            let rc = unsafe { ffi::ibv_dereg_mr(mr) };
            if rc != 0 {
                first.get_or_insert(os("ibv_dereg_mr", rc));
            }
        }
        first.map_or(Ok(()), Err)
    }

    unsafe fn register_dmabuf(
        &mut self,
        buf: &DmaBuf,
        iova: u64,
        length: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        let Some(reg) = reg_dmabuf_mr() else {
            // rdma-core older than v34: no dma-buf registration.
            return Err(os("ibv_reg_dmabuf_mr", libc::ENOSYS));
        };
        let bits = access_bits(true, access.remote_read, true, false);
        let fd = buf.fd.as_raw_fd();
        self.register_on_every_device("ibv_reg_dmabuf_mr", iova, length, |pd| {
            // SAFETY: `fd` is a live dma-buf covering `offset..offset + length` (exporter); the
            // caller keeps the memory allocated while registered.
            unsafe { reg(pd, buf.offset, length as usize, iova, fd, bits as i32) }
        })
    }
}

#[cfg(test)]
#[path = "ibverbs_device_tests.rs"]
mod tests;
