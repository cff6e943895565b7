//! P's write step for the simulator ([`KvWriter`]): each job's copies, as a vLLM prefill worker
//! computes them from D's metadata (`sim::te_writer::plan_copies`), written by the shared TE
//! session. A request whose id starts with `fence` is reported failed after its bytes were
//! written ("Mooncake transfer engine returned -1"): D must then fence P before releasing it.

use std::sync::Arc;

use futures::future::BoxFuture;
use kvrecv::sim::te_writer::plan_copies;
use kvrecv::sim::{KvWriter, WriteJob};
use tokio::sync::{mpsc, Mutex};

use crate::te_session::{TeSession, Write};

/// What P sent for a job.
#[derive(Debug, Clone)]
pub struct Sent {
    pub req_ids: Vec<String>,
    /// D's segment (`host:port` of its handshake daemon).
    pub target: String,
    pub writes: Vec<Write>,
    /// The TE's return code.
    pub rc: i64,
}

pub struct SessionWriter {
    pub te: Arc<Mutex<TeSession>>,
    pub sent: mpsc::UnboundedSender<Sent>,
}

impl KvWriter for SessionWriter {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let (te, sent) = (self.te.clone(), self.sent.clone());
        Box::pin(async move {
            let copies = plan_copies(&job.metadata, &job.rank, &job.req_ids)?;
            let target = format!(
                "{}:{}",
                job.metadata.remote_hostname, job.metadata.remote_port
            );
            let writes: Vec<Write> = copies
                .iter()
                .map(|c| Write {
                    addr: c.addr,
                    len: c.len,
                    seed: (c.owner_tag & 0x7f) as u8,
                    region_offset: c.region_offset,
                })
                .collect();
            let (rc, _) = te.lock().await.write(&target, &writes).await?;
            let _ = sent.send(Sent {
                req_ids: job.req_ids.clone(),
                target,
                writes,
                rc,
            });
            if rc != 0 {
                return Err(format!("Mooncake transfer engine returned {rc}"));
            }
            if job.req_ids.iter().any(|r| r.starts_with("fence")) {
                return Err("Mooncake transfer engine returned -1".into());
            }
            Ok(())
        })
    }
}
