//! A [`VerbsBackend`] without hardware: it keeps QP states, enforces the verbs state machine's
//! legal transitions, records every call, and can be told to fail. Public so that the data-plane
//! wiring can be tested the same way.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use super::backend::AsyncEvent;

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
    /// A registration at an IOVA other than its address (a landing window's).
    RegisterAt {
        addr: u64,
        length: u64,
        iova: u64,
        access: MrAccess,
    },
    /// `addr` is the registration's IOVA.
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

/// One live registration of the fake.
#[derive(Debug, Clone)]
struct FakeMr {
    addr: u64,
    length: u64,
    /// Every registration grants remote write (D's only use of one), so access is not kept.
    keys: Vec<MrKeys>,
}

/// Why the fake NIC did not place an incoming RDMA WRITE (see [`FakeVerbs::deliver_write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteRefused {
    /// The QP does not exist or is not in RTR/RTS: the packet is dropped silently (a QP in ERR
    /// neither acks nor NAKs; the writer sees retry-exceeded).
    Dropped,
    /// No live registration on the QP's device has this rkey, covers the range and grants
    /// remote write: the responder NAKs with a remote access error.
    RemoteAccess,
}

/// Holds one backend call: `entered` is signalled when the call starts, which then waits until
/// `release` receives (or its sender is dropped).
#[derive(Debug)]
pub struct FakeGate {
    pub entered: std::sync::mpsc::Sender<()>,
    pub release: std::sync::mpsc::Receiver<()>,
}

/// The fake backend.
#[derive(Debug)]
pub struct FakeVerbs {
    nics: Vec<LocalNic>,
    next_qp_num: u32,
    next_key: u32,
    states: BTreeMap<QpId, QpState>,
    /// Live registrations by IOVA.
    regions: BTreeMap<u64, FakeMr>,
    /// Every call, in order.
    pub calls: Vec<VerbsCall>,
    /// Fail the next `modify_qp` whose target state matches, with this errno.
    pub fail_modify_to: Option<(QpState, i32)>,
    /// Report this state from `query_qp_state` instead of the real one (a NIC that lies).
    pub query_override: Option<QpState>,
    /// Fail the next `deregister_memory` with this errno (the registration stays live).
    pub fail_deregister: Option<i32>,
    /// Hold the next `create_rc_qps` until the test says so (a firmware call that hangs).
    pub gate: Option<FakeGate>,
    /// Async events pushed by a test, not yet taken.
    events: std::collections::VecDeque<AsyncEvent>,
    /// (reader, writer): a byte per pushed event, so the reader's fd turns readable like a
    /// device's async fd. `None` if the pair could not be made.
    event_pipe: Option<(UnixStream, UnixStream)>,
    /// `RLIMIT_MEMLOCK` as (soft, hard) bytes, checked by `ensure_memlock` (soft raised when
    /// allowed); `None`: unlimited.
    pub memlock: Option<(u64, u64)>,
    /// Refuse every dma-buf registration with this errno (a kernel or rdma-core without it).
    pub fail_dmabuf: Option<i32>,
}

/// A NIC as tests hand it to [`FakeVerbs`]: `name`, port 1, LID 0, GID `gid` at index 3, MTU
/// 4096, the default link layer, no NUMA node.
pub fn test_nic(name: &str, gid: super::gid::Gid) -> LocalNic {
    LocalNic {
        name: name.into(),
        port: 1,
        lid: 0,
        gid,
        gid_index: 3,
        active_mtu: super::qp_attrs::RdmaMtu::Mtu4096,
        link_layer: Default::default(),
        numa_node: None,
    }
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
            fail_deregister: None,
            memlock: None,
            gate: None,
            events: Default::default(),
            event_pipe: UnixStream::pair()
                .and_then(|(r, w)| r.set_nonblocking(true).map(|()| (r, w)))
                .ok(),
            fail_dmabuf: None,
        }
    }

    /// Queue an async event as a device would report it (the fd turns readable).
    pub fn push_async_event(&mut self, event: AsyncEvent) {
        self.events.push_back(event);
        if let Some((_, w)) = &mut self.event_pipe {
            let _ = w.write_all(&[1]);
        }
    }

    /// What the NIC does with an RDMA WRITE of `len` bytes at `iova` with `rkey` arriving on
    /// `qp`: `Ok(address)` of the bytes it would write in this process, or why it refuses.
    /// This is the responder's check (IB spec 9.7.5.1.x, o9-20): QP able to receive (RTR/RTS),
    /// an rkey naming a registration of the QP's PD (here: device), and the range inside it. Tests use it to play P's one-sided writes, retries included.
    pub fn deliver_write(
        &self,
        qp: QpId,
        rkey: u32,
        iova: u64,
        len: u64,
    ) -> Result<u64, WriteRefused> {
        match self.states.get(&qp) {
            Some(QpState::Rtr | QpState::Rts) => {}
            _ => return Err(WriteRefused::Dropped),
        }
        let end = iova.checked_add(len).ok_or(WriteRefused::RemoteAccess)?;
        self.regions
            .iter()
            .find(|(&at, mr)| {
                mr.keys.get(qp.nic).is_some_and(|k| k.rkey == rkey)
                    && at <= iova
                    && end <= at + mr.length
            })
            .map(|(&at, mr)| mr.addr + (iova - at))
            .ok_or(WriteRefused::RemoteAccess)
    }

    /// IOVAs of the live registrations.
    pub fn registrations(&self) -> Vec<u64> {
        self.regions.keys().copied().collect()
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

    /// Legal as the kernel's `qp_state_table` (drivers/infiniband/core/verbs.c) has it, which
    /// `ibv_modify_qp` enforces on real hardware: RESET → {RESET, INIT}; INIT → {RESET, ERR,
    /// INIT, RTR}; RTR → {RESET, ERR, RTS}; RTS → {RESET, ERR, RTS, SQD}; SQD → {RESET, ERR,
    /// RTS, SQD}; SQE → {RESET, ERR, RTS}; ERR → {RESET, ERR}. Notably RESET → ERR is refused.
    /// SQD and SQE are [`QpState::Other`] with their `ibv_qp_state` codes (4 and 5).
    pub fn legal(from: QpState, to: QpState) -> bool {
        use QpState::*;
        const SQD: u32 = 4;
        const SQE: u32 = 5;
        matches!(
            (from, to),
            (Reset, Reset | Init)
                | (Init, Reset | Err | Init | Rtr)
                | (Rtr, Reset | Err | Rts)
                | (Rts, Reset | Err | Rts | Other(SQD))
                | (Other(SQD), Reset | Err | Rts | Other(SQD))
                | (Other(SQE), Reset | Err | Rts)
                | (Err, Reset | Err)
        )
    }
}

impl VerbsBackend for FakeVerbs {
    fn nics(&self) -> &[LocalNic] {
        &self.nics
    }

    fn create_rc_qps(&mut self, nic: usize, count: usize) -> Result<Vec<QpId>, VerbsError> {
        if let Some(gate) = self.gate.take() {
            let _ = gate.entered.send(());
            let _ = gate.release.recv();
        }
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

    unsafe fn register_memory_iova(
        &mut self,
        addr: u64,
        length: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        self.calls.push(if iova == addr {
            VerbsCall::Register {
                addr,
                length,
                access,
            }
        } else {
            VerbsCall::RegisterAt {
                addr,
                length,
                iova,
                access,
            }
        });
        if length == 0 {
            return Err(VerbsError::EmptyRegion(addr));
        }
        if self.regions.contains_key(&iova) {
            // The real backend names registrations by IOVA too: a second one would orphan the
            // first's keys.
            return Err(VerbsError::Os {
                op: "ibv_reg_mr_iova2",
                errno: 17,
            });
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
        self.regions.insert(
            iova,
            FakeMr {
                addr,
                length,
                keys: keys.clone(),
            },
        );
        Ok(keys)
    }

    fn deregister_memory(&mut self, iova: u64) -> Result<(), VerbsError> {
        self.calls.push(VerbsCall::Deregister { addr: iova });
        if let Some(errno) = self.fail_deregister.take() {
            return Err(VerbsError::Os {
                op: "ibv_dereg_mr",
                errno,
            });
        }
        self.regions
            .remove(&iova)
            .map(|_| ())
            .ok_or(VerbsError::UnknownRegion(iova))
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

    fn take_async_events(&mut self) -> Vec<AsyncEvent> {
        if let Some((r, _)) = &mut self.event_pipe {
            let mut sink = [0u8; 64];
            while matches!(r.read(&mut sink), Ok(1..)) {}
        }
        self.events.drain(..).collect()
    }

    fn async_event_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.event_pipe.iter().map(|(r, _)| r.as_raw_fd()).collect()
    }

    fn ensure_memlock(&mut self, bytes_per_nic: u64) -> Result<(), VerbsError> {
        use super::memlock::{pinned_bytes, plan, MemlockPlan};
        let Some((soft, hard)) = self.memlock else {
            return Ok(());
        };
        let nics = self.nics.len();
        let need = pinned_bytes([bytes_per_nic], nics, 4096);
        match plan(soft, hard, 0, need, false) {
            MemlockPlan::Enough => Ok(()),
            MemlockPlan::RaiseSoft { to } => {
                self.memlock = Some((to, hard));
                Ok(())
            }
            MemlockPlan::TooLow => Err(VerbsError::MemlockTooLow {
                need,
                nics,
                pinned: 0,
                soft,
                hard,
            }),
        }
    }
}

#[cfg(test)]
mod state_table_tests {
    use super::*;
    use QpState::*;

    /// The kernel's `qp_state_table`, written out as the set of legal targets per state.
    #[test]
    fn legal_transitions_are_exactly_the_kernels() {
        let all = [Reset, Init, Rtr, Rts, Other(4), Other(5), Err];
        let kernel: [(QpState, &[QpState]); 7] = [
            (Reset, &[Reset, Init]),
            (Init, &[Reset, Err, Init, Rtr]),
            (Rtr, &[Reset, Err, Rts]),
            (Rts, &[Reset, Err, Rts, Other(4)]),
            (Other(4), &[Reset, Err, Rts, Other(4)]),
            (Other(5), &[Reset, Err, Rts]),
            (Err, &[Reset, Err]),
        ];
        for (from, legal) in kernel {
            for to in all {
                assert_eq!(
                    FakeVerbs::legal(from, to),
                    legal.contains(&to),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn a_fresh_qp_refuses_err_as_real_hardware_does() {
        let mut f = FakeVerbs::new(vec![LocalNic {
            name: "mlx5_0".into(),
            port: 1,
            lid: 0,
            gid: Default::default(),
            gid_index: 0,
            active_mtu: crate::rdma::verbs::qp_attrs::RdmaMtu::Mtu4096,
            link_layer: Default::default(),
            numa_node: None,
        }]);
        let qp = f.create_rc_qps(0, 1).unwrap()[0];
        assert_eq!(
            f.modify_qp(qp, &QpTransition::ToErr),
            Result::Err(VerbsError::Os {
                op: "ibv_modify_qp",
                errno: 22
            })
        );
        assert_eq!(f.state(qp), Some(Reset));
    }
}
