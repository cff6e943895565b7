//! Socket reads straight into destination memory through a raw pointer: `recv(2)` on the
//! stream's descriptor inside tokio's readiness (`try_io`), so the landing bytes, which other
//! connections may write at the same time, are never behind a `&mut [u8]`.

use std::io;
use std::os::fd::AsRawFd;

use tokio::io::Interest;
use tokio::net::TcpStream;

/// Read at most `len` bytes from `stream` into `dst` without waiting, like
/// [`TcpStream::try_read`]: `Ok(0)` at end of stream (or for `len == 0`), a
/// [`io::ErrorKind::WouldBlock`] error when nothing is ready (tokio's readiness is then cleared,
/// so [`TcpStream::readable`] waits for more). An interrupted `recv` is retried.
///
/// # Safety
/// `dst..dst + len` must be valid for writes for the whole call (allocated, not freed or moved
/// meanwhile). Nothing may hold a reference to those bytes: the kernel writes them while
/// no Rust code sees them, like DMA, and other writers may race it only through raw pointers
/// too (what they then hold is whatever bytes were last written: the permits decide whose
/// bytes count).
pub(crate) unsafe fn try_recv_into(
    stream: &TcpStream,
    dst: *mut u8,
    len: usize,
) -> io::Result<usize> {
    let fd = stream.as_raw_fd();
    stream.try_io(Interest::READABLE, || loop {
        // SAFETY: `fd` is the stream's open socket (borrowed for the call); `dst` is valid for
        // `len` bytes of writes and unreferenced (the caller's contract); `recv` writes at most
        // `len` bytes.
        let n = unsafe { libc::recv(fd, dst.cast::<libc::c_void>(), len, 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    })
}

/// Set `SO_RCVLOWAT`: the socket reports readable only once `bytes` are queued (or at EOF, an
/// error, or memory pressure), so a payload that is not all there yet costs one wakeup and one
/// `recv` when it is, not one per arriving segment. The kernel caps it at half the largest
/// receive buffer and grows the buffer to hold it.
pub(crate) fn set_rcvlowat(stream: &TcpStream, bytes: usize) -> io::Result<()> {
    let v = libc::c_int::try_from(bytes.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: the fd is the stream's open socket; `v` is a live c_int of the length passed.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes queued on the socket, not yet read (`FIONREAD`).
pub(crate) fn queued(stream: &TcpStream) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: the fd is the stream's open socket; FIONREAD writes one c_int to `n`.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc == 0 {
        Ok(usize::try_from(n).unwrap_or(0))
    } else {
        Err(io::Error::last_os_error())
    }
}
