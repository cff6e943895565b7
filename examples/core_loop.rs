//! The coordinator core alone, in a loop callgrind can count: `N` batches of `BATCH` requests
//! through Receiver -> Peer (a transport that answers FINISH ok at once) -> RequestAggregator ->
//! BlockManager, the host waiting for each batch's releases and draining, as `benches/core.rs`
//! does. Instruction counts do not move with the machine's load, so a construct kept only for
//! speed is justified by them (DESIGN.md's complexity budget):
//!
//! ```text
//! cargo build --release --features testing --example core_loop
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='core_loop::timed*' \
//!     target/release/examples/core_loop 20000 1 1
//! ```
//! Instructions per request = the `Collected` total / (`N` × `BATCH`). Arguments: batches
//! (default 20,000), batch size (1), peers (1); `LAYERS` sets the layout's layer count (2).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use futures::stream;

use kvrecv::actors::topology::StaticTopology;
use kvrecv::actors::{
    CleanFinish, Coordinator, CoordinatorParts, EventSink, PeerTransport, ReplyStream,
};
use kvrecv::config::KvRecvConfig;
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, LoadKv, MooncakeXferResponse, PeerId, XferStatus};
use kvrecv::rdma::StaticLanding;

include!("../benches/shared/instant_peer.rs");

/// The counted part: `batches` loads, each waited for and drained. Not inlined, so callgrind's
/// `--toggle-collect` finds it by name.
#[inline(never)]
async fn timed(
    coord: &Coordinator,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<KvEvent>,
    reply: &RefCell<Vec<u8>>,
    batches: usize,
    batch: usize,
) {
    let mut next = 0;
    for _ in 0..batches {
        let (requests, answer) = make_batch(batch, &mut next);
        *reply.borrow_mut() = answer;
        coord
            .receiver
            .send(LoadKv { requests })
            .await
            .expect("alive");
        let mut released = 0;
        while released < batch {
            if let Some(KvEvent::Released { .. }) = rx.recv().await {
                released += 1;
            }
        }
        let step = coord.drain().await.expect("alive");
        assert_eq!(step.finished_recving.len(), batch);
    }
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map(|v| v.parse().expect("a number"))
            .unwrap_or(default)
    };
    let (batches, batch, peers) = (arg(1, 20_000), arg(2, 1), arg(3, 1) as u32);
    let layers: u32 = std::env::var("LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let sys = actix::System::new();
    let reply = Rc::new(RefCell::new(Vec::new()));
    let transport = Rc::new(InstantPeer {
        reply: reply.clone(),
    });
    sys.block_on(async move {
        let (coord, mut rx) = start_coordinator(transport, peers, layers);
        // The host's loop is a task on the actors' thread, as in `benches/core.rs`.
        actix::spawn(async move {
            timed(&coord, &mut rx, &reply, batches, batch).await;
        })
        .await
        .expect("the host loop ends");
    });
    println!("{batches} batches of {batch} through {peers} peer(s), {layers} layers");
}
