//! What the BlockManager has ready for the host's next drain, in one place both can reach: the
//! BlockManager appends as completions and failures happen, the host takes it all at its drain
//! without a message round trip (DESIGN.md §7).

#![forbid(unsafe_code)]

use crate::messages::StepOutput;

use super::shared::Shared;

/// The step output not yet drained.
pub type Outbox = Shared<StepOutput>;

impl Shared<StepOutput> {
    /// Everything ready since the last take, in the order it became ready.
    pub fn take(&self) -> StepOutput {
        std::mem::take(&mut *self.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::ReqId;

    #[test]
    fn a_take_empties_the_shared_output_and_a_clone_keeps_its_copy() {
        let a = Outbox::default();
        let host = a.share();
        a.lock().finished_recving.push(ReqId::from("r1"));
        let copy = a.clone();
        a.lock().invalid_block_ids.push(7);
        let taken = host.take();
        assert_eq!(taken.finished_recving, vec![ReqId::from("r1")]);
        assert_eq!(taken.invalid_block_ids, vec![7]);
        assert!(a.lock().is_empty(), "the take emptied the shared output");
        assert_eq!(
            copy.take().finished_recving,
            vec![ReqId::from("r1")],
            "the clone kept what it copied and saw nothing later"
        );
    }
}
