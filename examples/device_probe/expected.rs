//! The bytes `kvrecv prefill-sim --write` puts into a D block: each P rank's head slice filled
//! with the request's owner tag and stamped for the audit (`sim::te_writer`), recomputed here
//! with the same public functions so that every block can be compared byte for byte.

use kvrecv::owner_tag;
use kvrecv::rdma::audit::stamp_write;

/// One D block of `block_len` bytes as P TP `p_tp` writes it into D TP1 for `transfer_id`.
pub fn block(transfer_id: &str, block: u64, block_len: u64, p_tp: u64) -> Vec<u8> {
    let tag = owner_tag(transfer_id);
    let mut want = vec![(tag & 0xff) as u8; block_len as usize];
    let slice = block_len / p_tp;
    for s in 0..p_tp {
        let at = (s * slice) as usize;
        stamp_write(
            &mut want[at..at + slice as usize],
            block * block_len + s * slice,
            block_len,
            tag,
            |_| 0,
        );
    }
    want
}
