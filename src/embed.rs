//! Running the coordinator inside a host that owns its own tokio runtime: the actix System
//! lives on a dedicated thread; the host holds a `Send + Sync` handle and awaits replies from
//! any runtime.

use std::thread::JoinHandle;

use thiserror::Error;

use crate::actors::{Coordinator, CoordinatorParts};
use crate::messages::{KvRequest, LoadKv, LoadKvReply, StepOutput};

#[derive(Debug, Error)]
pub enum EmbedError {
    #[error("the kvrecv actor system is not running: {0}")]
    Stopped(#[from] actix::MailboxError),
    #[error("the kvrecv thread failed to start")]
    Start,
}

/// A coordinator on its own thread.
///
/// ```no_run
/// # async fn host(make: impl FnOnce() -> kvrecv::actors::CoordinatorParts + Send + 'static) {
/// let kv = kvrecv::embed::KvRecvHandle::spawn(make).unwrap();
/// let reply = kv.load_kv(vec![]).await.unwrap();
/// let step = kv.drain().await.unwrap();
/// # let _ = (reply, step);
/// kv.shutdown();
/// # }
/// ```
pub struct KvRecvHandle {
    coord: Coordinator,
    system: actix::System,
    thread: Option<JoinHandle<()>>,
}

impl KvRecvHandle {
    /// Start the actors on a new thread. `make` runs on that thread (transports and topology
    /// sources need not be `Send`).
    pub fn spawn<F>(make: F) -> Result<Self, EmbedError>
    where
        F: FnOnce() -> CoordinatorParts + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kvrecv".into())
            .spawn(move || {
                let sys = actix::System::new();
                sys.block_on(async {
                    let coord = Coordinator::start(make());
                    let _ = tx.send((coord, actix::System::current()));
                });
                let _ = sys.run();
            })
            .map_err(|_| EmbedError::Start)?;
        let (coord, system) = rx.recv().map_err(|_| EmbedError::Start)?;
        Ok(KvRecvHandle {
            coord,
            system,
            thread: Some(thread),
        })
    }

    /// `load_kv`: hand a batch over; invalid requests come back in the reply.
    pub async fn load_kv(&self, requests: Vec<KvRequest>) -> Result<LoadKvReply, EmbedError> {
        Ok(self.coord.receiver.send(LoadKv { requests }).await?)
    }

    /// The per-step drain.
    pub async fn drain(&self) -> Result<StepOutput, EmbedError> {
        Ok(self.coord.drain().await?)
    }

    /// The running actors, for hosts that want to talk to them directly.
    pub fn coordinator(&self) -> &Coordinator {
        &self.coord
    }

    /// Stop the actors and join the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KvRecvHandle {
    fn drop(&mut self) {
        self.stop();
    }
}
