//! Why a repro or bench run could not finish.

#![forbid(unsafe_code)]

use thiserror::Error;

use crate::rdma::tcp::target::TargetError;

use super::trace::TraceError;

#[derive(Debug, Error)]
pub enum ReproError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("data-plane target: {0}")]
    Target(#[from] TargetError),
    #[error("D worker: {0}")]
    Start(#[from] crate::StartError),
    #[error("prefill simulator: {0}")]
    Sim(#[from] crate::sim::SimError),
    #[error("actor system stopped: {0}")]
    Mailbox(#[from] actix::MailboxError),
    #[error("bad scenario: {0}")]
    Scenario(String),
}
