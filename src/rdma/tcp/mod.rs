//! kvrecv's TCP target (PROTOCOL.md §5.2): the advertised windows (epochs), the landing permits
//! that admit a write only for its own pull, the data server and the wire format it speaks, and
//! the target that starts them with the shared handshake daemon.

mod conn_shards;
internal_mod!(memory_slot);
internal_mod!(permits);
pub(crate) mod raw_recv;
mod request_pulls;
internal_mod!(server);
internal_mod!(target);
mod tcp_landing;
internal_mod!(windows);
internal_mod!(wire);

pub use target::{TargetConfig, TcpTarget};
pub use tcp_landing::TcpLanding;
