//! The control plane on real sockets: the ZMQ peer transport and the HTTP bootstrap client.

#[doc(hidden)]
pub mod async_socket;
pub mod bootstrap_client;
pub mod control_cpu;
mod fd_exhaustion;
#[doc(hidden)]
pub mod http;
#[doc(hidden)]
pub mod zmq_context;
pub mod zmq_transport;

pub use async_socket::{AsyncSocket, SocketError};
pub use bootstrap_client::{BootstrapConfig, HttpTopology};
pub use control_cpu::ControlCpu;
pub use zmq_context::ZmqContext;
pub use zmq_transport::{ZmqTransport, ZmqTransportConfig};
