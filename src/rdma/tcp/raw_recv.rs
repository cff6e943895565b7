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
