//! A vLLM-compatible prefill engine simulator (bootstrap server, one ROUTER per worker, fault
//! knobs), used by tests, the demo and `kvrecv prefill-sim`.
