//! The order of a batch's writes: what the journal writer does, step by
//! step, to append a batch so that a power cut at any point loses nothing
//! that was acknowledged and never makes the log claim what it lacks.
//!
//! The rules:
//! - a grant above the meta file's reserved floor raises that floor first,
//!   durably, so every token ever returned is at most the floor on disk;
//! - the batch is written at the end of the log, then synced;
//! - only then is the header rewritten with the new durable length. Written
//!   before the sync, it could reach the disk first (nothing orders the
//!   writes of one sync) and claim a batch a power cut then took, which the
//!   next start would read as acknowledged records lost; after a failed sync
//!   it would claim the batch that failed. The header is not synced by
//!   itself: it reaches the disk with the next sync, and until then the
//!   older claim on the disk is smaller, which is safe.

use crate::journal::record::Header;
use crate::mutant::{planted, Mutant};

/// One I/O step of appending a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Rewrite the meta file, durably, with this reserved floor.
    RaiseReserved(u64),
    /// Write the batch at the log's end.
    WriteBatch,
    /// Make the log's data durable (`fdatasync`).
    Sync,
    /// Write this header into its slot.
    WriteHeader(Header),
}

/// The steps of one append, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    steps: [Option<Step>; 4],
}

impl IntoIterator for Plan {
    type Item = Step;
    type IntoIter = core::iter::Flatten<core::array::IntoIter<Option<Step>, 4>>;

    fn into_iter(self) -> Self::IntoIter {
        self.steps.into_iter().flatten()
    }
}

/// Where the log stands before a batch.
#[derive(Clone, Copy, Debug)]
pub struct Log {
    /// The header last written.
    pub header: Header,
    /// The log's length (every byte written so far).
    pub len: u64,
    /// The meta file's reserved floor.
    pub reserved: u64,
    /// How far above a grant that passes it the floor is raised.
    pub floor_block: u64,
}

/// How to append a batch of `batch_len` bytes whose highest granted token
/// is `max_token` (0: no grant); with `sync`, the batch is made durable and
/// the header claims it.
pub fn plan(log: &Log, batch_len: u64, sync: bool, max_token: u64) -> Plan {
    let raise = (max_token > log.reserved)
        .then(|| Step::RaiseReserved(max_token.saturating_add(log.floor_block)));
    if !sync {
        return Plan {
            steps: [raise, Some(Step::WriteBatch), None, None],
        };
    }
    let header = Step::WriteHeader(Header {
        seq: log.header.seq + 1,
        durable_len: log.len + batch_len,
        ..log.header
    });
    let steps = if planted(Mutant::HeaderBeforeSync) {
        [
            raise,
            Some(Step::WriteBatch),
            Some(header),
            Some(Step::Sync),
        ]
    } else {
        [
            raise,
            Some(Step::WriteBatch),
            Some(Step::Sync),
            Some(header),
        ]
    };
    Plan { steps }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(reserved: u64) -> Log {
        Log {
            header: Header {
                seq: 4,
                durable_len: 100,
                compacted_len: 100,
                token_floor: 0,
            },
            len: 120,
            reserved,
            floor_block: 4096,
        }
    }

    #[test]
    fn the_header_claims_a_batch_only_after_its_sync() {
        let steps: Vec<Step> = plan(&log(4096), 30, true, 7).into_iter().collect();
        assert_eq!(steps.len(), 3);
        assert_eq!(steps[0], Step::WriteBatch);
        assert_eq!(steps[1], Step::Sync);
        let Step::WriteHeader(h) = steps[2] else {
            panic!("{steps:?}")
        };
        assert_eq!((h.seq, h.durable_len), (5, 150));
    }

    #[test]
    fn a_grant_past_the_floor_raises_it_first() {
        let steps: Vec<Step> = plan(&log(4096), 30, true, 4097).into_iter().collect();
        assert_eq!(steps[0], Step::RaiseReserved(4097 + 4096));
        let lazy: Vec<Step> = plan(&log(4096), 30, false, 0).into_iter().collect();
        assert_eq!(lazy, [Step::WriteBatch]);
    }
}
