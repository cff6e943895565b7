//! kvrecv's TCP target (PROTOCOL.md §5.2): the advertised windows (epochs), the landing permits
//! that admit a write only for its own pull, the data server and the wire format it speaks, and
//! the target that starts them with the shared handshake daemon.

pub mod memory_slot;
#[doc(hidden)]
pub mod permits;
pub(crate) mod raw_recv;
mod request_pulls;
#[doc(hidden)]
pub mod server;
pub mod target;
mod tcp_landing;
#[doc(hidden)]
pub mod windows;
#[doc(hidden)]
pub mod wire;

pub use target::{TargetConfig, TcpTarget};
pub use tcp_landing::TcpLanding;
