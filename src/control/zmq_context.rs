//! A libzmq context whose socket cap kvrecv sets. libzmq refuses a context's 1024th socket with
//! EMFILE ("Too many open files", `ZMQ_MAX_SOCKETS` defaults to 1023) whatever the process's fd
//! limit, and each pull held three sockets (its DEALER and the monitor pair; now until its request
//! is taken, its DEALER alone after), so 256 requests in flight from a TP2 prefill engine hit it
//! and failed requests at random. The `zmq` crate has
//! no setter for that option, so the context is created here through `zmq-sys`, and its sockets
//! are handed to the `zmq` crate's safe wrapper.

use std::ffi::c_void;
use std::sync::Arc;

/// Sockets one context may hold by default: 16384 pulls connecting at once at three sockets each
/// (a pull whose request was taken holds one). Each socket also holds file descriptors, so the
/// process's `RLIMIT_NOFILE` bounds it too.
pub const DEFAULT_MAX_SOCKETS: i32 = 49_152;

struct Raw(*mut c_void);

// SAFETY: a libzmq context is thread safe (zmq_ctx_new(3)); only sockets are not.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

impl Drop for Raw {
    fn drop(&mut self) {
        // Every socket holds a clone of the `Arc` around this, so none is open any more; term
        // waits for libzmq's reaper to finish closing them (linger 0: at once).
        // SAFETY: the pointer came from zmq_ctx_new and is terminated exactly once.
        while unsafe { zmq_sys::zmq_ctx_term(self.0) } == -1 {
            // SAFETY: reads the calling thread's errno; no preconditions.
            if zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }) != zmq::Error::EINTR {
                break;
            }
        }
    }
}

/// A shared libzmq context with a raised socket cap.
#[derive(Clone)]
pub struct ZmqContext {
    raw: Arc<Raw>,
}

impl ZmqContext {
    /// A new context allowing `max_sockets` sockets.
    pub fn new(max_sockets: i32) -> Result<Self, zmq::Error> {
        // SAFETY: plain FFI constructor; null means failure.
        let ptr = unsafe { zmq_sys::zmq_ctx_new() };
        if ptr.is_null() {
            // SAFETY: reads the calling thread's errno; no preconditions.
            return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
        }
        let raw = Arc::new(Raw(ptr));
        // SAFETY: a live context; ZMQ_MAX_SOCKETS takes an int and must be set before the
        // first socket is created, which is the case here.
        let rc = unsafe {
            zmq_sys::zmq_ctx_set(raw.0, zmq_sys::ZMQ_MAX_SOCKETS as _, max_sockets.max(1))
        };
        if rc == -1 {
            // SAFETY: reads the calling thread's errno; no preconditions.
            return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
        }
        Ok(ZmqContext { raw })
    }

    /// Run the context's I/O thread on `cpu` (`ZMQ_THREAD_AFFINITY_CPU_ADD`). Takes effect
    /// only before the context's first socket, which starts the thread.
    pub fn set_io_thread_cpu(&self, cpu: usize) -> Result<(), zmq::Error> {
        let cpu = i32::try_from(cpu).map_err(|_| zmq::Error::EINVAL)?;
        // SAFETY: a live context; the option takes an int (a CPU number).
        let rc = unsafe {
            zmq_sys::zmq_ctx_set(self.raw.0, zmq_sys::ZMQ_THREAD_AFFINITY_CPU_ADD as _, cpu)
        };
        if rc == -1 {
            // SAFETY: reads the calling thread's errno; no preconditions.
            return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
        }
        Ok(())
    }

    /// Run the context's I/O thread under `SCHED_BATCH` (`ZMQ_THREAD_SCHED_POLICY`), so that
    /// waking it never preempts the thread that woke it: on the actors' CPU, a pull's send
    /// then costs the actors' thread no switch to the I/O thread and back before it has
    /// finished its turn (which may send more). Set only while the calling thread is
    /// `SCHED_OTHER`: libzmq's thread applies the policy with the priority it inherited and
    /// aborts the process if the kernel refuses (a real-time priority would be refused).
    /// Returns whether it was set. Takes effect only before the context's first socket.
    pub fn set_io_thread_batch(&self) -> Result<bool, zmq::Error> {
        // SAFETY: plain query of the calling thread's policy.
        if unsafe { libc::sched_getscheduler(0) } != libc::SCHED_OTHER {
            return Ok(false);
        }
        // SAFETY: a live context; the option takes an int (a policy).
        let rc = unsafe {
            zmq_sys::zmq_ctx_set(
                self.raw.0,
                zmq_sys::ZMQ_THREAD_SCHED_POLICY as _,
                libc::SCHED_BATCH,
            )
        };
        if rc == -1 {
            // SAFETY: reads the calling thread's errno; no preconditions.
            return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
        }
        Ok(true)
    }

    /// Start the context's threads (its I/O thread and its reaper) now, from a short-lived
    /// thread named `name`: libzmq (as built here) does not name its threads, so they carry
    /// the name of the thread that created the context's first socket. Their placement and
    /// policy ([`Self::set_io_thread_cpu`], [`Self::set_io_thread_batch`]) must be set before;
    /// the creating thread's CPU mask is the calling thread's (inherited), as it would be if
    /// the caller made the first socket itself.
    pub fn start_threads(&self, name: &str) -> std::io::Result<()> {
        let ctx = self.clone();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || ctx.socket(zmq::PAIR).map(drop))?
            .join()
            .map_err(|_| std::io::Error::other("the thread starting libzmq's threads panicked"))?
            .map_err(std::io::Error::from)
    }

    /// The socket cap in force.
    pub fn max_sockets(&self) -> i32 {
        // SAFETY: a live context.
        unsafe { zmq_sys::zmq_ctx_get(self.raw.0, zmq_sys::ZMQ_MAX_SOCKETS as _) }
    }

    /// Create a socket of type `ty`. Drop it before the last clone of this context: the
    /// context's drop waits for every socket to close (zmq_ctx_term), as `zmq::Context` does.
    pub fn socket(&self, ty: zmq::SocketType) -> Result<zmq::Socket, zmq::Error> {
        let ty = match ty {
            zmq::PAIR => zmq_sys::ZMQ_PAIR,
            zmq::DEALER => zmq_sys::ZMQ_DEALER,
            zmq::ROUTER => zmq_sys::ZMQ_ROUTER,
            _ => return Err(zmq::Error::EINVAL),
        };
        // SAFETY: a live context; null means failure (EMFILE when the cap is reached).
        let ptr = unsafe { zmq_sys::zmq_socket(self.raw.0, ty as _) };
        if ptr.is_null() {
            // SAFETY: reads the calling thread's errno; no preconditions.
            return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
        }
        // SAFETY: `ptr` is a fresh socket nobody else owns, as one from `Socket::into_raw`
        // would be; the wrapper closes it exactly once, on drop.
        Ok(unsafe { zmq::Socket::from_raw(ptr) })
    }
}

/// ZMTP engine buffers of kvrecv's DEALERs, in and out. Each pull in flight holds one
/// DEALER, and libzmq's 8 KiB buffers were a third of its resident memory (the decoder's with
/// its reference counts, 18 KB allocated). Measured in docs/PERFORMANCE.md ("libzmq's engine
/// buffers"): 256 in / 1,024 out took a DEALER from 36 to about 22 KB and the control plane's
/// CPU per request did not move; 256 out cost serve 28% more CPU per request at batch 1 (a
/// request no longer fits the encoder's buffer, and goes out in two writes).
pub const ENGINE_BATCH: EngineBatch = EngineBatch {
    input: 256,
    output: 1024,
};

/// A socket's ZMTP engine buffer sizes, bytes (libzmq's default is 8192 each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineBatch {
    /// `ZMQ_IN_BATCH_SIZE`: the decoder reads up to this much per `recv`.
    pub input: i32,
    /// `ZMQ_OUT_BATCH_SIZE`: the encoder gathers up to this much per `send`.
    pub output: i32,
}

/// libzmq 4.3's `ZMQ_IN_BATCH_SIZE` and `ZMQ_OUT_BATCH_SIZE` (draft options, `zmq.h`).
const ZMQ_IN_BATCH_SIZE: i32 = 101;
const ZMQ_OUT_BATCH_SIZE: i32 = 102;

/// Size a socket's ZMTP engine buffers (each size at least one byte, else `EINVAL`).
///
/// A message larger than a buffer still goes whole: libzmq reads and writes the rest of its
/// body straight into and from the message. `Ok(false)` when this libzmq was built without
/// its draft API, which holds these options (the crate's `.cargo/config.toml` builds it with
/// them; a dependent crate's build may not): the socket keeps the defaults.
pub fn set_engine_batch(socket: &mut zmq::Socket, sizes: EngineBatch) -> Result<bool, zmq::Error> {
    // libzmq refuses a size below one with EINVAL too, which would read as "no draft API".
    if sizes.input < 1 || sizes.output < 1 {
        return Err(zmq::Error::EINVAL);
    }
    for (option, bytes) in [
        (ZMQ_IN_BATCH_SIZE, sizes.input),
        (ZMQ_OUT_BATCH_SIZE, sizes.output),
    ] {
        // SAFETY: a live socket owned by the caller, an `int` option passed by pointer with
        // its size, as zmq_setsockopt(3) asks.
        let rc = unsafe {
            zmq_sys::zmq_setsockopt(
                socket.as_mut_ptr(),
                option,
                (&bytes as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )
        };
        if rc != 0 {
            // SAFETY: reads the calling thread's errno; no preconditions.
            return match zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }) {
                zmq::Error::EINVAL => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| {
                        tracing::info!(
                            "libzmq built without its draft API: DEALERs keep 8 KiB engine buffers"
                        )
                    });
                    Ok(false)
                }
                e => Err(e),
            };
        }
    }
    Ok(true)
}

/// A socket's `ZMQ_IN_BATCH_SIZE` and `ZMQ_OUT_BATCH_SIZE` (`None` without the draft API).
#[cfg(test)]
pub fn engine_batch(socket: &mut zmq::Socket) -> Option<EngineBatch> {
    let mut get = |option| {
        let mut v: i32 = 0;
        let mut len = std::mem::size_of::<i32>();
        // SAFETY: a live socket, an `int` out-parameter with its size (zmq_getsockopt(3)).
        let rc = unsafe {
            zmq_sys::zmq_getsockopt(
                socket.as_mut_ptr(),
                option,
                (&mut v as *mut i32).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(v)
    };
    Some(EngineBatch {
        input: get(ZMQ_IN_BATCH_SIZE)?,
        output: get(ZMQ_OUT_BATCH_SIZE)?,
    })
}

impl std::fmt::Debug for ZmqContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqContext")
            .field("max_sockets", &self.max_sockets())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine buffers take the size asked (this crate builds libzmq with the options),
    /// and messages larger and smaller than them still go through whole, both ways.
    #[test]
    fn small_engine_buffers_carry_every_message_whole() {
        let ctx = ZmqContext::new(8).unwrap();
        let mut d = ctx.socket(zmq::DEALER).unwrap();
        let default = EngineBatch {
            input: 8192,
            output: 8192,
        };
        assert_eq!(
            engine_batch(&mut d),
            Some(default),
            "libzmq built without its draft API: a CXXFLAGS in the environment overrides \
             .cargo/config.toml's (force = false), which defines ZMQ_BUILD_DRAFT_API"
        );
        let zero = EngineBatch {
            input: 0,
            output: 1024,
        };
        assert_eq!(set_engine_batch(&mut d, zero), Err(zmq::Error::EINVAL));
        let small = EngineBatch {
            input: 256,
            output: 300,
        };
        assert!(set_engine_batch(&mut d, small).unwrap());
        assert_eq!(engine_batch(&mut d), Some(small));
        let mut r = ctx.socket(zmq::ROUTER).unwrap();
        assert!(set_engine_batch(&mut r, small).unwrap());
        r.bind("tcp://127.0.0.1:*").unwrap();
        d.connect(&r.get_last_endpoint().unwrap().unwrap()).unwrap();
        let sizes = [0usize, 1, 255, 256, 257, 1000, 70_000, 3];
        let body = |n: usize, k: usize| (0..n).map(|i| (i * 7 + k) as u8).collect::<Vec<u8>>();
        for (k, n) in sizes.iter().enumerate() {
            d.send(body(*n, k), 0).unwrap();
        }
        let mut who = Vec::new();
        for (k, n) in sizes.iter().enumerate() {
            let m = r.recv_multipart(0).unwrap();
            assert_eq!(m[1], body(*n, k), "request {k} of {n} bytes");
            who = m[0].clone();
        }
        for (k, n) in sizes.iter().enumerate() {
            r.send_multipart([who.clone(), body(*n, k + 1)], 0).unwrap();
        }
        for (k, n) in sizes.iter().enumerate() {
            assert_eq!(d.recv_bytes(0).unwrap(), body(*n, k + 1), "reply {k} of {n} bytes");
        }
    }

    #[test]
    fn the_cap_is_raised_and_enforced() {
        let small = ZmqContext::new(3).unwrap();
        assert_eq!(small.max_sockets(), 3);
        let held: Vec<_> = (0..3).map(|_| small.socket(zmq::DEALER).unwrap()).collect();
        assert_eq!(small.socket(zmq::DEALER).err(), Some(zmq::Error::EMFILE));
        drop(held);
        // Well past libzmq's default of 1023.
        let big = ZmqContext::new(DEFAULT_MAX_SOCKETS).unwrap();
        let many: Vec<_> = (0..1100).map(|_| big.socket(zmq::PAIR).unwrap()).collect();
        assert_eq!(many.len(), 1100);
    }

    /// Scheduling policy of each thread of this process (field 41 of /proc's stat).
    fn thread_policies() -> std::collections::HashMap<u64, i32> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|e| {
                let tid: u64 = e.ok()?.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
                // Fields after the command name, which ends at the last ')'; policy is field 41.
                let rest = &stat[stat.rfind(')')? + 2..];
                Some((tid, rest.split(' ').nth(41 - 3)?.parse().ok()?))
            })
            .collect()
    }

    #[test]
    fn the_io_thread_runs_sched_batch_and_the_caller_keeps_its_policy() {
        let before = thread_policies();
        let ctx = ZmqContext::new(8).unwrap();
        assert!(
            ctx.set_io_thread_batch().unwrap(),
            "the test thread is SCHED_OTHER"
        );
        // The first socket starts the context's threads (its I/O thread and its reaper), which
        // apply the policy as they start; a message over TCP has gone through the I/O thread.
        let a = ctx.socket(zmq::PAIR).unwrap();
        a.bind("tcp://127.0.0.1:*").unwrap();
        let b = ctx.socket(zmq::PAIR).unwrap();
        b.connect(&a.get_last_endpoint().unwrap().unwrap()).unwrap();
        b.send("x", 0).unwrap();
        assert_eq!(a.recv_bytes(0).unwrap(), b"x");
        let started: Vec<i32> = thread_policies()
            .into_iter()
            .filter(|(tid, _)| !before.contains_key(tid))
            .map(|(_, p)| p)
            .collect();
        assert!(
            started.contains(&libc::SCHED_BATCH),
            "no thread started by the context runs SCHED_BATCH: {started:?}"
        );
        // SAFETY: plain query of the calling thread's policy.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
    }
}
