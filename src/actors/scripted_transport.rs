//! A transport driven by the test: every pull a Peer opens shows up as an [`OpenedPull`] the
//! test answers, in whatever order the scenario needs. For actor tests only; the integration
//! tests use real ZMQ sockets.

#![forbid(unsafe_code)]

use std::cell::RefCell;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::messages::{MooncakeXferMetadata, MooncakeXferResponse, PeerId, XferStatus};

use super::transport::{CleanFinish, Frames, PeerTransport, ReplyStream, TransportError};

/// One pull as the peer's side would see it.
pub struct OpenedPull {
    pub peer: PeerId,
    pub request: Vec<u8>,
    replies: RefCell<Option<UnboundedSender<Result<Frames, TransportError>>>>,
    finish: CleanFinish,
}

impl OpenedPull {
    /// The decoded metadata D sent.
    pub fn metadata(&self) -> MooncakeXferMetadata {
        MooncakeXferMetadata::decode(&self.request).expect("D sent undecodable metadata")
    }

    /// D request ids in this pull.
    pub fn req_ids(&self) -> Vec<String> {
        self.metadata().req_blocks.into_keys().collect()
    }

    fn push(&self, item: Result<Frames, TransportError>) {
        if let Some(tx) = self.replies.borrow().as_ref() {
            let _ = tx.send(item);
        }
    }

    pub fn reply(&self, r: &MooncakeXferResponse) {
        self.push(Ok(vec![r.encode().expect("encodable response")]));
    }

    /// Reply with a status and lists (`None` for an absent list).
    pub fn respond(&self, status: XferStatus, ok: &[&str], err: &[&str], msg: Option<&str>) {
        let list = |v: &[&str]| (!v.is_empty()).then(|| v.iter().map(|s| s.to_string()).collect());
        self.reply(&MooncakeXferResponse {
            status,
            ok_reqs: list(ok),
            err_reqs: list(err),
            err_msg: msg.map(str::to_owned),
            layout_id: 0,
        });
    }

    /// Raw frames (garbage, multi-frame messages).
    pub fn reply_frames(&self, frames: Frames) {
        self.push(Ok(frames));
    }

    /// A channel failure (socket error).
    pub fn fail(&self, reason: &str) {
        self.push(Err(TransportError::Recv {
            peer: self.peer.clone(),
            reason: reason.into(),
        }));
    }

    /// The other side closes the channel.
    pub fn close(&self) {
        self.replies.borrow_mut().take();
    }

    /// Whether the Peer marked this pull's channel reusable (a clean FINISH).
    pub fn finished_cleanly(&self) -> bool {
        self.finish.is_set()
    }

    /// Whether D still listens on this pull's channel (false once D closed it).
    pub fn is_open(&self) -> bool {
        self.replies
            .borrow()
            .as_ref()
            .is_some_and(|tx| !tx.is_closed())
    }
}

/// Hands every opened pull to the test through a channel.
pub struct ScriptedTransport {
    opened: UnboundedSender<OpenedPull>,
}

impl ScriptedTransport {
    pub fn new() -> (Self, UnboundedReceiver<OpenedPull>) {
        let (tx, rx) = unbounded_channel();
        (ScriptedTransport { opened: tx }, rx)
    }
}

impl PeerTransport for ScriptedTransport {
    fn pull(&self, peer: &PeerId, request: Vec<u8>, finish: CleanFinish) -> ReplyStream {
        let (tx, mut rx) = unbounded_channel();
        let _ = self.opened.send(OpenedPull {
            peer: peer.clone(),
            request,
            replies: RefCell::new(Some(tx)),
            finish,
        });
        Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
    }
}
