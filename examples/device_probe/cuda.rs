//! The few CUDA driver calls the probe makes as the *host* would (PyTorch's side of the
//! process): its own retained primary context or a non-primary one, its own allocations, a
//! non-blocking stream and pinned buffer to read what landed without queueing behind anything,
//! and a long kernel on the legacy default stream. Raw `cudarc::driver::sys` calls (dynamic
//! loading: this compiles without CUDA), wrapped in owners that free what they made.

use std::ffi::c_void;
use std::time::Duration;

use cudarc::driver::sys;

/// The spin kernel (PTX, JIT-compiled by the driver for whatever GPU is there).
const SPIN_PTX: &str = concat!(include_str!("spin.ptx"), "\0");

/// `CU_STREAM_LEGACY`: the legacy default stream, whatever the thread's default is.
const LEGACY_STREAM: sys::CUstream = 0x1 as sys::CUstream;

fn ok(r: sys::CUresult, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

/// Loads libcuda and initialises the driver; `Err` says why the GPU checks cannot run.
pub fn init() -> Result<String, String> {
    // SAFETY: only probes for the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda.so)".into());
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        ok(sys::cuInit(0), "cuInit")?;
        let mut v = 0;
        ok(sys::cuDriverGetVersion(&mut v), "cuDriverGetVersion")?;
        let mut dev = 0;
        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet")?;
        let mut name = [0 as std::ffi::c_char; 128];
        ok(
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
            "cuDeviceGetName",
        )?;
        let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy();
        Ok(format!("{name}, driver API {}.{}", v / 1000, v % 1000 / 10))
    }
}

/// A context the probe holds: the device's primary context retained by the probe itself (as
/// PyTorch does), or a context of its own (`cuCtxCreate`), which kvrecv's copier does not use.
pub struct Ctx {
    raw: sys::CUcontext,
    dev: sys::CUdevice,
    primary: bool,
}

impl Ctx {
    /// Retain GPU `ordinal`'s primary context and make it current on this thread.
    pub fn retain_primary(ordinal: i32) -> Result<Ctx, String> {
        let mut dev = 0;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the retain is released in `Drop`.
        unsafe {
            ok(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            ok(
                sys::cuDevicePrimaryCtxRetain(&mut raw, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
        }
        let c = Ctx {
            raw,
            dev,
            primary: true,
        };
        c.bind()?;
        Ok(c)
    }

    /// A new (non-primary) context on GPU `ordinal`, current on this thread.
    pub fn create(ordinal: i32) -> Result<Ctx, String> {
        let mut dev = 0;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointers; destroyed in `Drop`.
        unsafe {
            ok(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            ok(sys::cuCtxCreate_v2(&mut raw, 0, dev), "cuCtxCreate")?;
        }
        Ok(Ctx {
            raw,
            dev,
            primary: false,
        })
    }

    /// Make this context current on the calling thread.
    pub fn bind(&self) -> Result<(), String> {
        // SAFETY: a live context.
        ok(unsafe { sys::cuCtxSetCurrent(self.raw) }, "cuCtxSetCurrent")
    }

    /// Wait for everything queued in this context (every stream).
    pub fn synchronize(&self) -> Result<(), String> {
        self.bind()?;
        // SAFETY: plain driver call.
        ok(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the retain or creation of `new`; nothing of ours uses it after this.
        unsafe {
            if self.primary {
                sys::cuDevicePrimaryCtxRelease_v2(self.dev);
            } else {
                sys::cuCtxDestroy_v2(self.raw);
            }
        }
    }
}

/// Device memory allocated by the probe in a given context (the host's KV tensor).
pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub len: usize,
}

impl DevBuf {
    /// `len` zeroed bytes in the current context.
    pub fn alloc_zeroed(len: usize) -> Result<DevBuf, String> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; freed in `Drop`; the memset covers exactly the allocation
        // and is synchronous with respect to the host for device memory.
        unsafe {
            ok(sys::cuMemAlloc_v2(&mut ptr, len), "cuMemAlloc")?;
            let buf = DevBuf { ptr, len };
            ok(sys::cuMemsetD8_v2(ptr, 0, len), "cuMemsetD8")?;
            ok(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
            Ok(buf)
        }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc_zeroed`; its context is current (owners are dropped
        // before their context, on the thread that made them).
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Page-locked host memory: the target of device reads that must not wait for other streams.
pub struct Pinned {
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    pub fn alloc(len: usize) -> Result<Pinned, String> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; freed in `Drop`.
        let rc = unsafe { sys::cuMemAllocHost_v2(&mut p, len.max(1)) };
        ok(rc, "cuMemAllocHost")?;
        Ok(Pinned { ptr: p.cast(), len })
    }

    /// A copy of the first `n` bytes: a copy, not a view, because [`Stream::read`] writes the
    /// buffer through `&Pinned`, which a live `&[u8]` over it would not allow.
    pub fn to_vec(&self, n: usize) -> Vec<u8> {
        assert!(n <= self.len, "read past the pinned buffer");
        let mut v = vec![0u8; n];
        // SAFETY: `n` bytes of our allocation, written only by copies we synchronised with
        // (`Stream::read` returns after its stream did); a raw copy into a fresh Vec.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr(), n) };
        v
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`.
        unsafe {
            sys::cuMemFreeHost(self.ptr.cast());
        }
    }
}

/// A stream created with `CU_STREAM_NON_BLOCKING`: it never waits for the legacy stream.
pub struct Stream(sys::CUstream);

impl Stream {
    pub fn non_blocking() -> Result<Stream, String> {
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; destroyed in `Drop`.
        let rc = unsafe { sys::cuStreamCreate(&mut s, flags) };
        ok(rc, "cuStreamCreate")?;
        Ok(Stream(s))
    }

    /// Copy `n` bytes at `src` into `dst` on this stream and wait for that copy alone.
    pub fn read(&self, dst: &Pinned, src: sys::CUdeviceptr, n: usize) -> Result<(), String> {
        assert!(n <= dst.len, "read past the pinned buffer");
        // SAFETY: `dst` holds `n` bytes; `src..src + n` is device memory the caller owns.
        unsafe {
            ok(
                sys::cuMemcpyDtoHAsync_v2(dst.ptr.cast(), src, n, self.0),
                "cuMemcpyDtoHAsync",
            )?;
            ok(sys::cuStreamSynchronize(self.0), "cuStreamSynchronize")
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `non_blocking`.
        unsafe {
            sys::cuStreamDestroy_v2(self.0);
        }
    }
}

/// Host work on the legacy default stream: a kernel that spins until released (a host-mapped
/// flag the probe sets `release_after` after the launch, or sooner with [`Busy::release`]),
/// then an event behind it. A released flag, not a timer on the GPU, decides how long it runs.
pub struct Busy {
    event: sys::CUevent,
    module: sys::CUmodule,
    /// Page-locked, mapped into the device: word 0 the release flag (the host writes it), word 1
    /// why the kernel stopped (1 released, 2 its cap), words 2-3 the ns it spun (it writes them).
    flag: *mut u32,
    /// Dropped to release the kernel early; the thread releases it at the deadline otherwise.
    release_tx: Option<std::sync::mpsc::Sender<()>>,
    releaser: Option<std::thread::JoinHandle<()>>,
    /// The kernel was queued (whatever failed after it).
    launched: bool,
}

/// The flag's address, handed to the releasing thread (joined before the memory is freed).
struct FlagPtr(*mut u32);
// SAFETY: the thread only writes word 0, volatile, and is joined before the memory is freed.
unsafe impl Send for FlagPtr {}

/// Why the busy kernel stopped, and after how long by the GPU's own timer.
#[derive(Debug, Clone, Copy)]
pub struct BusyOutcome {
    pub released: bool,
    pub spun: Duration,
}

/// A kernel that is never released stops after this, so a lost release cannot hang the GPU.
const SPIN_CAP: Duration = Duration::from_secs(120);

impl Busy {
    /// Queue the spin kernel on the legacy default stream of the current context, then an
    /// event behind it; release it `release_after` from now. Returns at once.
    pub fn start(release_after: Duration) -> Result<Busy, String> {
        let mut module = std::ptr::null_mut();
        let mut func = std::ptr::null_mut();
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; everything made here is owned by `busy` at once and
        // freed in its `Drop`.
        unsafe {
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            ok(
                sys::cuMemHostAlloc(&mut host, 16, flags),
                "cuMemHostAlloc (flag)",
            )?;
            std::ptr::write_bytes(host.cast::<u8>(), 0, 16);
        }
        let mut busy = Busy {
            event: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            flag: host.cast(),
            release_tx: None,
            releaser: None,
            launched: false,
        };
        let mut dflag: sys::CUdeviceptr = 0;
        let mut cap: u64 = SPIN_CAP.as_nanos().try_into().unwrap_or(u64::MAX);
        // SAFETY: a NUL-terminated PTX image; the kernel takes two u64s, each passed by pointer
        // as `cuLaunchKernel` wants; the module is unloaded in `Drop` after the work finished.
        unsafe {
            ok(
                sys::cuMemHostGetDevicePointer_v2(&mut dflag, host, 0),
                "cuMemHostGetDevicePointer",
            )?;
            ok(
                sys::cuModuleLoadData(&mut module, SPIN_PTX.as_ptr().cast()),
                "cuModuleLoadData (spin kernel)",
            )?;
            busy.module = module;
            ok(
                sys::cuModuleGetFunction(&mut func, module, c"kvrecv_spin".as_ptr()),
                "cuModuleGetFunction",
            )?;
            let mut event = std::ptr::null_mut();
            ok(
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
                ),
                "cuEventCreate",
            )?;
            busy.event = event;
            let mut params = [
                (&mut dflag as *mut u64).cast::<c_void>(),
                (&mut cap as *mut u64).cast::<c_void>(),
            ];
            ok(
                sys::cuLaunchKernel(
                    func,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    LEGACY_STREAM,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel (spin)",
            )?;
            busy.launched = true;
            ok(sys::cuEventRecord(event, LEGACY_STREAM), "cuEventRecord")?;
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let flag = FlagPtr(busy.flag);
        busy.release_tx = Some(tx);
        busy.releaser = Some(std::thread::spawn(move || {
            let flag = flag;
            // Released at the deadline, or at once when the sender is dropped.
            let _ = rx.recv_timeout(release_after);
            // SAFETY: word 0 of the live mapped buffer (joined before it is freed).
            unsafe { std::ptr::write_volatile(flag.0, 1) };
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }));
        Ok(busy)
    }

    /// Release the kernel now (if the deadline has not already) and wait for the releaser.
    pub fn release(&mut self) {
        self.release_tx.take();
        if let Some(t) = self.releaser.take() {
            let _ = t.join();
        }
    }

    /// Whether the queued work has finished (the event is complete).
    pub fn done(&self) -> Result<bool, String> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(format!("cuEventQuery: {r:?}")),
        }
    }

    /// Release the kernel, wait for it, and say why it stopped and after how long.
    pub fn finish(&mut self) -> Result<BusyOutcome, String> {
        self.release();
        // SAFETY: a live event.
        let rc = unsafe { sys::cuEventSynchronize(self.event) };
        ok(rc, "cuEventSynchronize")?;
        // SAFETY: words the finished kernel wrote (the event orders them before this).
        let (why, ns) = unsafe {
            (
                std::ptr::read_volatile(self.flag.add(1)),
                std::ptr::read_volatile(self.flag.add(2).cast::<u64>()),
            )
        };
        Ok(BusyOutcome {
            released: why == 1,
            spun: Duration::from_nanos(ns),
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.release();
        // SAFETY: made in `start`. The flag is set here too (`start` may have failed after the
        // launch, before the releaser existed) and the legacy stream waited for, so neither the
        // module nor the flag the kernel reads is freed under it.
        unsafe {
            std::ptr::write_volatile(self.flag, 1);
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            if self.launched {
                sys::cuStreamSynchronize(LEGACY_STREAM);
            }
            if !self.event.is_null() {
                sys::cuEventDestroy_v2(self.event);
            }
            if !self.module.is_null() {
                sys::cuModuleUnload(self.module);
            }
            sys::cuMemFreeHost(self.flag.cast());
        }
    }
}
