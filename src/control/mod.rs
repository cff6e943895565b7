//! The control plane on real sockets: the ZMQ peer transport and the HTTP bootstrap client.
