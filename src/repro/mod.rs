//! `kvrecv repro`: replays a real trace through real actors, ZMQ and the TCP data plane with
//! injected peer faults, and shows the write-after-free under `naive` and its absence under
//! `settle`.

pub mod trace;
