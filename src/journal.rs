//! The persistence seam of the lease store.
//!
//! A token must be durable before it is returned to a client. The lease store
//! calls [`Journal::persist_grant`] after the state machine grants a term and
//! before answering; if the journal fails, the grant is abandoned and the
//! client gets 503 `lease-store-unavailable` (fail closed).
//!
//! This module knows records and bytes, not lease rules. [`MemoryJournal`] keeps
//! nothing across restarts; the durable journal in the data directory plugs in
//! behind the same trait.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

/// What must survive a restart for one grant.
#[derive(Clone, Debug)]
pub struct GrantRecord {
    pub lease: String,
    pub token: u64,
    pub holder: String,
    pub ttl_ms: u64,
}

/// Why a record could not be persisted.
#[derive(Debug)]
pub struct JournalError(pub String);

impl std::fmt::Display for JournalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JournalError {}

/// A boxed future, as returned by [`Journal`] methods.
pub type JournalFuture<'a> = Pin<Box<dyn Future<Output = Result<(), JournalError>> + Send + 'a>>;

/// Where grants are made durable.
pub trait Journal: Send + Sync + 'static {
    /// Completes once `record` is durable, or fails if it cannot be made so.
    fn persist_grant<'a>(&'a self, record: &'a GrantRecord) -> JournalFuture<'a>;

    /// Whether the journal can currently persist (drives `/_fence/readyz`).
    fn is_healthy(&self) -> bool;
}

/// A journal that keeps nothing; it can be told to fail, to exercise the
/// fail-closed path.
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

impl Journal for MemoryJournal {
    fn persist_grant<'a>(&'a self, _record: &'a GrantRecord) -> JournalFuture<'a> {
        let failing = self.failing.load(Ordering::Acquire);
        Box::pin(async move {
            if failing {
                Err(JournalError("journal is failing (injected)".into()))
            } else {
                Ok(())
            }
        })
    }

    fn is_healthy(&self) -> bool {
        !self.failing.load(Ordering::Acquire)
    }
}
