//! The control plane on real sockets: the ZMQ peer transport and the HTTP bootstrap client.

internal_mod!(async_socket);
internal_mod!(bootstrap_client);
internal_mod!(control_cpu);
mod fd_exhaustion;
internal_mod!(http);
internal_mod!(zmq_context);
internal_mod!(zmq_transport);

#[cfg(any(feature = "sim", feature = "testing"))]
pub use async_socket::AsyncSocket;
#[cfg(feature = "testing")]
pub use async_socket::SocketError;
pub use bootstrap_client::{BootstrapConfig, HttpTopology};
pub use control_cpu::ControlCpu;
#[cfg(feature = "testing")]
pub use zmq_context::ZmqContext;
pub use zmq_transport::{ZmqTransport, ZmqTransportConfig};
