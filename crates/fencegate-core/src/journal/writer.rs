//! The journal writer's decisions around each append (the order of one
//! append's writes is [`crate::journal::append`]): which batches are made
//! durable, when the log is compacted, and when and how it takes a new
//! identity. The file journal carries them out; the simulator runs the same
//! functions against its simulated disk.
//!
//! The rules:
//! - a batch is synced when anyone waits for one of its records (a grant's
//!   or a release's answer goes out only once it is durable), when it holds
//!   a renewal's wall-clock hint (a start may end a term by an older hint,
//!   so a hint must not wait for the next grant to reach the disk), and
//!   while the journal is unhealthy (every batch then probes whether the
//!   disk takes durable writes again);
//! - the log is compacted once it is past a minimum size and four times the
//!   size it had after the last compaction;
//! - the log takes a new identity at each start, clean stop and compaction,
//!   and after a synced batch once it grew by a set number of bytes since
//!   the last change. A change names the new identity in the meta file
//!   (beside the old one) first, then gives it to the log, durably, then
//!   drops the old one from the meta file: a crash between any two steps
//!   leaves a log the meta file names.

use crate::journal::record::Record;
use crate::journal::recovery::Meta;
use crate::mutant::{planted, Mutant};

/// Frames a batch's records into `buf`; the highest token a grant among
/// them carries (0: none), which the token floor reserved on disk must
/// cover before the batch is written.
pub fn encode_batch<'a>(records: impl IntoIterator<Item = &'a Record>, buf: &mut Vec<u8>) -> u64 {
    let mut max_token = 0;
    for record in records {
        record.encode_frame(buf);
        if let Record::Grant { token, .. } = record {
            max_token = max_token.max(*token);
        }
    }
    max_token
}

/// Whether the journal takes durable writes, as its writer last saw.
/// Unhealthy, the store is not ready (`/_fence/readyz`), grants fail, and
/// every batch is synced: a batch that then succeeds shows the disk takes
/// durable writes again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
}

impl Health {
    /// The health after an append (a batch, or a change of identity) that
    /// was `written` in full (and synced, if it was to be) or failed.
    pub fn after(written: bool) -> Self {
        if written {
            Health::Healthy
        } else {
            Health::Unhealthy
        }
    }
}

/// Whether a batch of `records` must be made durable before its answers
/// go out: one holds a record someone waits for ([`Record::awaited`]) or a
/// renewal's wall-clock hint, or the journal is unhealthy.
pub fn batch_syncs<'a>(health: Health, records: impl IntoIterator<Item = &'a Record>) -> bool {
    health == Health::Unhealthy
        || records.into_iter().any(|record| {
            (record.awaited() && !planted(Mutant::AwaitedNotSynced))
                || matches!(record, Record::Renew { wall_ms, .. } if *wall_ms != 0)
        })
}

/// Whether a log of `len` bytes, `compacted_len` after its last compaction,
/// is compacted now (never below `min_bytes`).
pub fn compaction_due(len: u64, compacted_len: u64, min_bytes: u64) -> bool {
    len >= min_bytes && len >= compacted_len.saturating_mul(4)
}

/// Whether the log takes a new identity after a batch: only after a synced
/// one (the change syncs, and a lazy batch must stay cheap), once the log
/// is `every_bytes` longer than at the last change.
pub fn identity_due(synced: bool, len: u64, identity_len: u64, every_bytes: u64) -> bool {
    synced && len >= identity_len.saturating_add(every_bytes)
}

/// The identity after `last`, from `random` (the system's randomness, or
/// `None` when there is none): never 0, never `last`.
pub fn next_identity(last: u64, random: Option<u64>) -> u64 {
    match random {
        Some(r) if r != 0 && r != last => r,
        Some(_) => last.wrapping_add(2).max(1),
        // A value that differs from the last still tells this log from
        // the one before.
        None => last.wrapping_add(1).max(1),
    }
}

/// One step of a change of identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityStep {
    /// Replace the meta file, durably, with this.
    WriteMeta(Meta),
    /// Append the identity record [`identity_append`] frames, as an append
    /// of its own ([`crate::journal::append::plan`]) that it syncs.
    Append(u64),
}

/// An append of the log's own: the framed bytes, whether it is synced,
/// and the highest token it grants (for
/// [`crate::journal::append::plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnAppend {
    pub bytes: Vec<u8>,
    pub sync: bool,
    pub max_token: u64,
}

/// The append that gives the log the identity `id`: its record alone,
/// synced (the meta file's next step must not name a log that may still
/// lose it), granting nothing.
pub fn identity_append(id: u64) -> OwnAppend {
    let mut bytes = Vec::new();
    Record::Identity { id }.encode_frame(&mut bytes);
    OwnAppend {
        bytes,
        sync: true,
        max_token: 0,
    }
}

/// The steps that move the log from the identity `meta` names to `next`.
pub fn change_identity(meta: Meta, next: u64) -> [IdentityStep; 3] {
    let named = Meta {
        identity: next,
        previous: meta.identity,
        ..meta
    };
    let settled = Meta {
        previous: next,
        ..named
    };
    if planted(Mutant::IdentityNamedLate) {
        // The log carries an identity the meta file does not name yet.
        return [
            IdentityStep::Append(next),
            IdentityStep::WriteMeta(named),
            IdentityStep::WriteMeta(settled),
        ];
    }
    [
        IdentityStep::WriteMeta(named),
        IdentityStep::Append(next),
        IdentityStep::WriteMeta(settled),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn renew(wall_ms: u64) -> Record {
        Record::Renew {
            lease: "a".into(),
            token: 1,
            ttl_ms: 1000,
            wall_ms,
        }
    }

    fn forget() -> Record {
        Record::Forget {
            lease: "a".into(),
            last_token: 1,
        }
    }

    #[test]
    fn awaited_records_and_hints_are_synced_lazy_ones_are_not() {
        let (hint, no_hint, forget) = (renew(5), renew(0), forget());
        let release = Record::Release {
            lease: "a".into(),
            token: 1,
            quiet: false,
        };
        let ok = Health::Healthy;
        assert!(batch_syncs(ok, [&forget, &release]));
        assert!(batch_syncs(ok, [&forget, &hint]));
        assert!(!batch_syncs(ok, [&forget, &no_hint]));
        assert!(batch_syncs(Health::Unhealthy, [&forget]));
        assert!(!batch_syncs(ok, []));
        assert_eq!(Health::after(false), Health::Unhealthy);
        assert_eq!(Health::after(true), Health::Healthy);
    }

    #[test]
    fn compaction_waits_for_the_minimum_and_four_times_the_last_size() {
        assert!(!compaction_due(100, 10, 1000));
        assert!(!compaction_due(3999, 1000, 1000));
        assert!(compaction_due(4000, 1000, 1000));
        assert!(compaction_due(1000, 0, 1000));
    }

    #[test]
    fn identity_changes_after_a_synced_batch_past_the_growth() {
        assert!(!identity_due(false, 5000, 0, 100));
        assert!(!identity_due(true, 199, 100, 100));
        assert!(identity_due(true, 200, 100, 100));
    }

    #[test]
    fn a_new_identity_is_never_zero_nor_the_last() {
        for last in [0, 1, 7, u64::MAX - 1, u64::MAX] {
            for random in [None, Some(0), Some(last), Some(42)] {
                let next = next_identity(last, random);
                assert_ne!(next, 0, "{last} {random:?}");
                assert_ne!(next, last, "{last} {random:?}");
            }
        }
    }

    #[test]
    fn the_meta_file_names_the_new_identity_before_the_log_carries_it() {
        let meta = Meta {
            reserved: 10,
            floor: 2,
            identity: 5,
            previous: 5,
        };
        let steps = change_identity(meta, 9);
        let IdentityStep::WriteMeta(named) = steps[0] else {
            panic!("{steps:?}")
        };
        assert_eq!((named.identity, named.previous), (9, 5));
        assert_eq!(steps[1], IdentityStep::Append(9));
        assert_eq!(
            steps[2],
            IdentityStep::WriteMeta(Meta {
                previous: 9,
                ..named
            })
        );
    }
}
