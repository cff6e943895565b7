//! Mooncake Transfer Engine handshake JSON (PROTOCOL.md §5.1, §6): segment descriptors and the
//! small Notify / Probe bodies. Filled in by the data plane.
