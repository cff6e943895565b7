//! Loading requests into a running [`KvRecv`] and following them to their release through its
//! events, as a host's scheduler would (shared by both probes).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use kvrecv::{EventStream, KvEvent, KvRecv, KvRequest, Outcome};

/// One request of P engine `engine_id` (bootstrap `bootstrap`), its transfer id its own id.
pub fn request(engine_id: &str, bootstrap: &str, id: &str, blocks: Vec<u32>) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(id.into()),
        remote_engine_id: Some(engine_id.into()),
        remote_bootstrap_addr: Some(bootstrap.into()),
        block_ids: vec![blocks],
    }
}

/// How a request ended.
#[derive(Debug, Clone, Default)]
pub struct Ended {
    /// The completion's failure reason, if it failed.
    pub failure: Option<String>,
    /// Released by a fence (or exact revocation).
    pub fenced: bool,
    /// Released by the last-resort deadline.
    pub forced: bool,
}

/// Load `reqs`; wait until every one is released. `on_landed` runs the moment a request's
/// completion says Ok (before its release, before anything else is read).
pub async fn receive(
    kv: &KvRecv,
    events: &mut EventStream,
    reqs: Vec<KvRequest>,
    timeout: Duration,
    mut on_landed: impl FnMut(&str),
) -> Result<HashMap<String, Ended>, String> {
    let mut waiting: HashSet<String> = reqs.iter().map(|r| r.req_id.clone()).collect();
    let reply = kv.load_kv(reqs).await.map_err(|e| e.to_string())?;
    if let Some(r) = reply.rejected.first() {
        return Err(format!("load_kv refused a request: {r}"));
    }
    let mut ended: HashMap<String, Ended> = HashMap::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while !waiting.is_empty() {
        let ev = tokio::time::timeout_at(deadline, events.next())
            .await
            .map_err(|_| {
                format!(
                    "{} request(s) not released within {timeout:?}",
                    waiting.len()
                )
            })?
            .ok_or("kvrecv's event stream ended")?;
        match ev {
            KvEvent::Completion {
                req_id, outcome, ..
            } => match outcome {
                Outcome::Ok => on_landed(&req_id),
                Outcome::Failed { reason, .. } => {
                    ended.entry(req_id.to_string()).or_default().failure = Some(reason);
                }
            },
            KvEvent::Released {
                req_id,
                fenced,
                forced,
                ..
            } => {
                waiting.remove(&*req_id);
                let e = ended.entry(req_id.to_string()).or_default();
                e.fenced = fenced;
                e.forced = forced;
            }
            _ => {}
        }
    }
    let _ = kv.drain().await;
    Ok(ended)
}

/// `Err` naming the first failed request, if any failed.
pub fn all_ok(ended: &HashMap<String, Ended>) -> Result<(), String> {
    match ended
        .iter()
        .find_map(|(id, e)| Some((id, e.failure.as_ref()?)))
    {
        Some((id, why)) => Err(format!("request {id} failed: {why}")),
        None => Ok(()),
    }
}
