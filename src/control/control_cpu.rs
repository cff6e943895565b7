//! Where the control plane runs: the thread that drives the coordinator's actors and sockets,
//! and libzmq's I/O thread.
//!
//! A library must not move its host's threads, so nothing is pinned unless asked
//! ([`ControlCpu::Any`], the default); `kvrecv serve` and `kvrecv bench` ask for
//! [`ControlCpu::Current`], which is what docs/PERFORMANCE.md measured.
//!
//! Every pull is a hand-off between those two threads in each direction (a send wakes the I/O
//! thread through its mailbox, a reply wakes the actors' thread through the socket's). On two
//! CPUs each hand-off is a cross-CPU wake-up (an inter-processor interrupt, a VM exit under a
//! hypervisor); on one CPU it is a run-queue insert, and the woken thread runs when the other
//! sleeps. On the development VM that cut the D's CPU per request most with one request in
//! flight, and not at all under load (docs/PERFORMANCE.md has the runs). The data plane's
//! threads are not placed: they stay wherever the scheduler puts them.

use std::fmt;
use std::str::FromStr;

/// Placement of the control plane's two threads.
///
/// ```
/// use kvrecv::ControlCpu;
/// assert_eq!(ControlCpu::default(), ControlCpu::Any);
/// assert_eq!("current".parse::<ControlCpu>(), Ok(ControlCpu::Current));
/// assert_eq!("3".parse::<ControlCpu>(), Ok(ControlCpu::Fixed(3)));
/// assert_eq!(ControlCpu::Any.to_string(), "any");
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ControlCpu {
    /// Both threads on the CPU the actors' thread is running on when the transport starts:
    /// one CPU, no choice to make up front (`kvrecv serve` and `kvrecv bench`).
    Current,
    /// Both threads on this CPU (numbered as the kernel numbers them).
    Fixed(usize),
    /// Wherever the scheduler puts them: nothing is pinned (the default: a library leaves its
    /// host's thread placement alone unless asked).
    #[default]
    Any,
}

impl fmt::Display for ControlCpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ControlCpu::Current => f.write_str("current"),
            ControlCpu::Fixed(n) => write!(f, "{n}"),
            ControlCpu::Any => f.write_str("any"),
        }
    }
}

impl FromStr for ControlCpu {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "current" => Ok(ControlCpu::Current),
            "any" => Ok(ControlCpu::Any),
            n => n
                .parse()
                .map(ControlCpu::Fixed)
                .map_err(|_| format!("expected `current`, `any` or a CPU number, got {n:?}")),
        }
    }
}

/// Pin the calling thread as `placement` says; the CPU it is now pinned to, `None` for
/// [`ControlCpu::Any`], or why it could not be pinned (the thread is then left as it was).
pub fn pin_current_thread(placement: ControlCpu) -> Result<Option<usize>, String> {
    let cpu = match placement {
        ControlCpu::Any => return Ok(None),
        ControlCpu::Fixed(n) => n,
        ControlCpu::Current => current_cpu()?,
    };
    pin::to(cpu).map(|()| Some(cpu))
}

/// Give the calling thread back every CPU the process was allowed when the control plane was
/// first pinned: for threads spawned by the pinned thread that are not part of the control
/// plane (the data plane's runtime), which would otherwise inherit its single CPU.
pub fn unpin_current_thread() {
    pin::restore();
}

fn current_cpu() -> Result<usize, String> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: no arguments; returns the CPU number or -1 with errno set.
        let n = unsafe { libc::sched_getcpu() };
        if n < 0 {
            return Err(format!("sched_getcpu: {}", std::io::Error::last_os_error()));
        }
        Ok(n as usize)
    }
    #[cfg(not(target_os = "linux"))]
    Err("thread placement is only supported on Linux".into())
}

#[cfg(target_os = "linux")]
mod pin {
    use std::sync::OnceLock;

    /// The calling thread's mask before the first pin (the process's CPUs, as far as kvrecv
    /// can tell).
    static BEFORE: OnceLock<libc::cpu_set_t> = OnceLock::new();

    fn get() -> Result<libc::cpu_set_t, String> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is the calling thread; the size is the set's own.
        let rc =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            return Err(format!(
                "sched_getaffinity: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(set)
    }

    fn set(set: &libc::cpu_set_t) -> std::io::Result<()> {
        // SAFETY: pid 0 is the calling thread; `set` is a valid set of its own size.
        let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    pub(super) fn to(cpu: usize) -> Result<(), String> {
        // A thread pinned by an earlier transport may move to any CPU it had before.
        let before = match BEFORE.get() {
            Some(b) => *b,
            None => get()?,
        };
        // SAFETY: `cpu` is below CPU_SETSIZE, checked first (CPU_ISSET indexes the set by it).
        if cpu >= libc::CPU_SETSIZE as usize || !unsafe { libc::CPU_ISSET(cpu, &before) } {
            return Err(format!("CPU {cpu} is not one this thread may run on"));
        }
        let _ = BEFORE.set(before);
        // SAFETY: as in `get`.
        let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
        unsafe { libc::CPU_SET(cpu, &mut one) };
        set(&one).map_err(|e| format!("sched_setaffinity to CPU {cpu}: {e}"))
    }

    pub(super) fn restore() {
        if let Some(before) = BEFORE.get() {
            if let Err(e) = set(before) {
                tracing::warn!(error = %e, "cannot give a data-plane thread its CPUs back");
            }
        }
    }

    /// The calling thread's CPUs, in order.
    #[cfg(test)]
    pub(super) fn allowed() -> Vec<usize> {
        let s = get().unwrap();
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `c` is below CPU_SETSIZE.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &s) })
            .collect()
    }
}

#[cfg(not(target_os = "linux"))]
mod pin {
    pub(super) fn to(_cpu: usize) -> Result<(), String> {
        Err("thread placement is only supported on Linux".into())
    }
    pub(super) fn restore() {}
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn parses_what_it_prints() {
        for p in [ControlCpu::Current, ControlCpu::Any, ControlCpu::Fixed(7)] {
            assert_eq!(p.to_string().parse::<ControlCpu>(), Ok(p));
        }
        assert!("-1".parse::<ControlCpu>().is_err());
        assert!("cpu0".parse::<ControlCpu>().is_err());
    }

    #[test]
    fn pins_a_thread_and_gives_a_spawned_one_its_cpus_back() {
        std::thread::spawn(|| {
            let all = pin::allowed();
            let cpu = pin_current_thread(ControlCpu::Current).unwrap().unwrap();
            assert_eq!(pin::allowed(), vec![cpu]);
            assert_eq!(current_cpu().unwrap(), cpu);
            // A thread spawned now inherits the single CPU, until it gives it back.
            let everything = all.clone();
            std::thread::spawn(move || {
                assert_eq!(pin::allowed(), vec![cpu]);
                unpin_current_thread();
                assert_eq!(pin::allowed(), everything);
            })
            .join()
            .unwrap();
            // Pinned already, it may still be placed on any CPU it had.
            for &other in &all {
                assert_eq!(
                    pin_current_thread(ControlCpu::Fixed(other)),
                    Ok(Some(other))
                );
                assert_eq!(pin::allowed(), vec![other]);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_cpu_the_thread_may_not_use_is_refused_and_nothing_changes() {
        std::thread::spawn(|| {
            let all = pin::allowed();
            let e = pin_current_thread(ControlCpu::Fixed(libc::CPU_SETSIZE as usize + 1));
            assert!(e.unwrap_err().contains("not one this thread may run on"));
            assert_eq!(pin::allowed(), all);
            assert_eq!(pin_current_thread(ControlCpu::Any), Ok(None));
            assert_eq!(pin::allowed(), all);
        })
        .join()
        .unwrap();
    }
}
