//! `benches/core.rs` with the binary's allocator (`src/allocator.rs`: mimalloc, as `kvrecv
//! serve` and `kvrecv bench` run): the coordinator's cost with the allocator a host would pick
//! for a server, next to the system allocator's in `core`. `cargo bench --bench core_mimalloc`.

#[path = "../src/allocator.rs"]
#[allow(dead_code, unused_imports)] // `tune` and its tests are the binary's
mod allocator;

#[global_allocator]
static ALLOCATOR: allocator::MiMalloc = allocator::MiMalloc;

include!("shared/coordinator.rs");
