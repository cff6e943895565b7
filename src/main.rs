//! `kvrecv`: the decode-side KV receive coordinator's command-line tool. The subcommands live in
//! the library (private, feature `cli`) and are entered through [`kvrecv::cli::main`]; only the
//! allocator is the binary's own (a library user keeps its own allocator).

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod allocator;

// The binary's allocator (why mimalloc, and why not through the `mimalloc` crate: see there).
#[global_allocator]
static ALLOCATOR: allocator::MiMalloc = allocator::MiMalloc;

fn main() -> std::process::ExitCode {
    // mimalloc's options are set before this runs (`allocator::tune`).
    kvrecv::cli::main()
}
