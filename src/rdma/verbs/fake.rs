//! A [`VerbsBackend`] without hardware: it keeps QP states, enforces the verbs state machine's
//! legal transitions, records every call, and can be told to fail. Public so that the data-plane
//! wiring can be tested the same way.

use std::collections::BTreeMap;

use super::backend::{MrAccess, MrKeys, QpId, VerbsBackend, VerbsError};
use super::gpudirect::DmaBuf;
use super::nic::LocalNic;
use super::qp_attrs::{QpState, QpTransition};

/// One recorded backend call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerbsCall {
    Create {
        nic: usize,
        qps: Vec<QpId>,
    },
    Modify {
        qp: QpId,
        transition: QpTransition,
    },
    Query {
        qp: QpId,
    },
    Destroy {
        qp: QpId,
    },
    Register {
        addr: u64,
        length: u64,
        access: MrAccess,
    },
    Deregister {
        addr: u64,
    },
    /// `ibv_reg_dmabuf_mr` (device memory through a dma-buf).
    RegisterDmaBuf {
        offset: u64,
        length: u64,
        iova: u64,
        access: MrAccess,
    },
}

/// The fake backend.
#[derive(Debug)]
pub struct FakeVerbs {
    nics: Vec<LocalNic>,
    next_qp_num: u32,
    next_key: u32,
    states: BTreeMap<QpId, QpState>,
    regions: BTreeMap<u64, Vec<MrKeys>>,
    /// Every call, in order.
    pub calls: Vec<VerbsCall>,
    /// Fail the next `modify_qp` whose target state matches, with this errno.
    pub fail_modify_to: Option<(QpState, i32)>,
    /// Report this state from `query_qp_state` instead of the real one (a NIC that lies).
    pub query_override: Option<QpState>,
    /// Refuse every dma-buf registration with this errno (a kernel or rdma-core without it).
    pub fail_dmabuf: Option<i32>,
}

impl FakeVerbs {
    /// QP numbers start at `0x100` so they never look like a count or index in assertions.
    pub fn new(nics: Vec<LocalNic>) -> Self {
        FakeVerbs {
            nics,
            next_qp_num: 0x100,
            next_key: 0x1000,
            states: BTreeMap::new(),
            regions: BTreeMap::new(),
            calls: Vec::new(),
            fail_modify_to: None,
            query_override: None,
            fail_dmabuf: None,
        }
    }

    /// Current state of a live QP.
    pub fn state(&self, qp: QpId) -> Option<QpState> {
        self.states.get(&qp).copied()
    }

    /// Number of live QPs.
    pub fn live_qps(&self) -> usize {
        self.states.len()
    }

    /// The transitions requested for one QP, in order.
    pub fn transitions_of(&self, qp: QpId) -> Vec<QpTransition> {
        self.calls
            .iter()
            .filter_map(|c| match c {
                VerbsCall::Modify { qp: q, transition } if *q == qp => Some(transition.clone()),
                _ => None,
            })
            .collect()
    }

    /// Forget recorded calls (state is kept).
    pub fn clear_calls(&mut self) {
        self.calls.clear();
    }

    /// Legal per the verbs QP state machine (IB spec 10.3.1), restricted to what D requests.
    fn legal(from: QpState, to: QpState) -> bool {
        use QpState::*;
        matches!(
            (from, to),
            (_, Reset) | (_, Err) | (Reset, Init) | (Init, Init) | (Init, Rtr) | (Rtr, Rts)
        )
    }
}

impl VerbsBackend for FakeVerbs {
    fn nics(&self) -> &[LocalNic] {
        &self.nics
    }

    fn create_rc_qps(&mut self, nic: usize, count: usize) -> Result<Vec<QpId>, VerbsError> {
        if nic >= self.nics.len() {
            return Err(VerbsError::UnknownDevice(format!("#{nic}")));
        }
        let qps: Vec<QpId> = (0..count)
            .map(|_| {
                self.next_qp_num += 1;
                QpId {
                    nic,
                    qp_num: self.next_qp_num,
                }
            })
            .collect();
        for qp in &qps {
            self.states.insert(*qp, QpState::Reset);
        }
        self.calls.push(VerbsCall::Create {
            nic,
            qps: qps.clone(),
        });
        Ok(qps)
    }

    fn modify_qp(&mut self, qp: QpId, transition: &QpTransition) -> Result<(), VerbsError> {
        self.calls.push(VerbsCall::Modify {
            qp,
            transition: transition.clone(),
        });
        let from = *self.states.get(&qp).ok_or(VerbsError::UnknownQp(qp))?;
        let to = transition.target();
        if let Some((target, errno)) = self.fail_modify_to {
            if target == to {
                self.fail_modify_to = None;
                return Err(VerbsError::Os {
                    op: "ibv_modify_qp",
                    errno,
                });
            }
        }
        if !Self::legal(from, to) {
            return Err(VerbsError::Os {
                op: "ibv_modify_qp",
                errno: 22,
            });
        }
        self.states.insert(qp, to);
        Ok(())
    }

    fn query_qp_state(&self, qp: QpId) -> Result<QpState, VerbsError> {
        // `&self`: queries are not recorded; assertions look at states directly.
        let state = *self.states.get(&qp).ok_or(VerbsError::UnknownQp(qp))?;
        Ok(self.query_override.unwrap_or(state))
    }

    fn destroy_qp(&mut self, qp: QpId) -> Result<(), VerbsError> {
        self.calls.push(VerbsCall::Destroy { qp });
        self.states
            .remove(&qp)
            .map(|_| ())
            .ok_or(VerbsError::UnknownQp(qp))
    }

    unsafe fn register_memory(
        &mut self,
        addr: u64,
        length: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        self.calls.push(VerbsCall::Register {
            addr,
            length,
            access,
        });
        if length == 0 {
            return Err(VerbsError::EmptyRegion(addr));
        }
        let keys: Vec<MrKeys> = (0..self.nics.len())
            .map(|_| {
                self.next_key += 2;
                MrKeys {
                    lkey: self.next_key,
                    rkey: self.next_key + 1,
                }
            })
            .collect();
        self.regions.insert(addr, keys.clone());
        Ok(keys)
    }

    fn deregister_memory(&mut self, addr: u64) -> Result<(), VerbsError> {
        self.calls.push(VerbsCall::Deregister { addr });
        self.regions
            .remove(&addr)
            .map(|_| ())
            .ok_or(VerbsError::UnknownRegion(addr))
    }

    unsafe fn register_dmabuf(
        &mut self,
        buf: &DmaBuf,
        iova: u64,
        length: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        self.calls.push(VerbsCall::RegisterDmaBuf {
            offset: buf.offset,
            length,
            iova,
            access,
        });
        if let Some(errno) = self.fail_dmabuf {
            return Err(VerbsError::Os {
                op: "ibv_reg_dmabuf_mr",
                errno,
            });
        }
        // SAFETY: the fake never touches the memory.
        let keys = unsafe { self.register_memory(iova, length, access) }?;
        // The registration is the dma-buf one: drop the record of the inner call.
        self.calls.pop();
        Ok(keys)
    }
}
