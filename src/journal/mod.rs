//! The persistence seam of the lease store.
//!
//! A token must be durable before it is returned to a client. The lease store
//! calls [`Journal::persist_grant`] after the state machine grants a term and
//! before answering; if the journal fails, the grant is abandoned and the
//! client gets 503 `lease-store-unavailable` (fail closed). A release is
//! durable before it is answered too; renewals (when the TTL changes or
//! the term's wall-clock hint falls behind) and forgotten leases are
//! recorded lazily.
//!
//! This module knows records and bytes, not lease rules: [`file`](mod@file) is the
//! durable journal in the data directory, [`record`] its on-disk format, and
//! [`MemoryJournal`] keeps nothing (for tests of the layers above). Cluster
//! mode's journal lives with the cluster (`cluster::journal`).

pub mod file;
pub use fencegate_core::journal::record;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

pub use file::{FileJournal, FileJournalOptions, Recovered};
pub use record::{LeaseRecord, TermRecord};

/// A grant's record, as the core's [`fencegate_core::lease::slot::Slot::grant`]
/// makes it.
pub use fencegate_core::journal::record::GrantRecord;

/// Why a record could not be persisted.
#[derive(Debug)]
pub struct JournalError(pub String);

impl std::fmt::Display for JournalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JournalError {}

/// A boxed future, as returned by [`Journal::persist_grant`].
pub type JournalFuture = Pin<Box<dyn Future<Output = Result<(), JournalError>> + Send>>;

/// Where lease state is made durable: the lease store's persistence seam.
/// [`FileJournal`] fills it in single-node mode, the cluster's etcd journal
/// (`cluster::journal::EtcdJournal`) on a cluster's primary, [`MemoryJournal`]
/// in tests; the store, the fence and the API see only this trait. In a
/// cluster only the primary writes, each write conditional on its election,
/// so no change made elsewhere has to flow in: a new primary starts from
/// what etcd holds.
pub trait Journal: Send + Sync + 'static {
    /// Completes once `record` is durable (fsync'd), or fails if it cannot be.
    ///
    /// The record is queued by the call itself, not when the future is first
    /// polled: records reach the journal in the order of the calls, which the
    /// lease store relies on (it calls this while the lease is locked).
    fn persist_grant(&self, record: GrantRecord) -> JournalFuture;

    /// Records that term `token` of `lease` was renewed at `wall_ms` (the
    /// wall clock, Unix ms) for `ttl_ms` (lazy); whether the record was
    /// queued (a full queue drops it).
    fn record_renew(&self, lease: &str, token: u64, ttl_ms: u64, wall_ms: u64) -> bool;

    /// Records that term `token` of `lease` was released, `quiet` if no
    /// write of it or of an earlier term was unfinished; completes once that
    /// is durable (queued by the call itself, like a grant).
    fn persist_release(&self, lease: &str, token: u64, quiet: bool) -> JournalFuture;

    /// Records that `lease`, whose highest token was `last_token`, was
    /// forgotten (lazy): its state may be dropped, and a lease no longer
    /// kept continues above `last_token` (losing the record is safe: the
    /// lease is then still kept after a restart).
    fn record_forget(&self, lease: &str, last_token: u64);

    /// Whether the journal can currently persist (drives `/_fence/readyz`).
    fn is_healthy(&self) -> bool;
}

/// A journal that keeps nothing; it can be told to fail, to exercise the
/// fail-closed path of the layers above.
#[derive(Debug, Default)]
pub struct MemoryJournal {
    failing: AtomicBool,
}

impl MemoryJournal {
    /// Makes every following persist fail (`true`) or succeed (`false`).
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::Release);
    }
}

impl MemoryJournal {
    /// What a durable write answers: at once, failed if told to fail.
    fn answer(&self) -> JournalFuture {
        let failing = self.failing.load(Ordering::Acquire);
        Box::pin(async move {
            if failing {
                Err(JournalError("journal is failing (injected)".into()))
            } else {
                Ok(())
            }
        })
    }
}

impl Journal for MemoryJournal {
    fn persist_grant(&self, _record: GrantRecord) -> JournalFuture {
        self.answer()
    }

    fn record_renew(&self, _lease: &str, _token: u64, _ttl_ms: u64, _wall_ms: u64) -> bool {
        true
    }

    fn persist_release(&self, _lease: &str, _token: u64, _quiet: bool) -> JournalFuture {
        self.answer()
    }

    fn record_forget(&self, _lease: &str, _last_token: u64) {}

    fn is_healthy(&self) -> bool {
        !self.failing.load(Ordering::Acquire)
    }
}
