//! The handover barrier: while a write of an older term of a lease may still
//! reach the backend, a write of a newer term waits. A write counts as in
//! flight from its admission until its answer has been sent (bounded by the
//! settle time after the answer), or, if its outcome is unknown, for the
//! settle time; writes sent before a restart count until the restart's
//! unsettled window ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{LeaseCell, LeaseStore};
use crate::lease::admission::{self, Decision, WriteCheck};
use crate::lease::inflight::{Ended, WriteLife};
use crate::lease::machine::Reject;

/// Counters of the handover barrier, for metrics.
#[derive(Debug, Default)]
pub struct HandoverStats {
    /// Writes that waited for an earlier term's writes to finish.
    pub barrier_waits: AtomicU64,
    /// Milliseconds spent waiting, all waits together.
    pub barrier_wait_ms: AtomicU64,
    /// Writes refused because earlier writes did not finish in time.
    pub barrier_timeouts: AtomicU64,
}

/// How a write is admitted.
#[derive(Clone, Copy, Debug)]
pub struct AdmitOptions {
    /// A write needs more than this much of its term left.
    pub margin_ms: u64,
    /// Whether a newer term's writes wait for an older term's to finish.
    /// Switching it off voids the handover guarantee; it exists so tests can
    /// show what the barrier prevents.
    pub barrier: bool,
    /// Longest wait for an older term's writes (the upstream deadline).
    pub max_wait_ms: u64,
    /// How long a write whose outcome is unknown (upstream connection lost,
    /// upstream timeout, client gone) still counts as in flight.
    pub settle_ms: u64,
}

impl Default for AdmitOptions {
    fn default() -> Self {
        Self {
            margin_ms: 0,
            barrier: true,
            max_wait_ms: 30_000,
            settle_ms: 1_000,
        }
    }
}

/// An admitted write. It holds back newer terms' writes while it awaits the
/// backend's answer, then while its response body is sent (at most the
/// settle time after the answer, see [`WriteGuard::answered`]); dropped
/// unfinished, its outcome is unknown and it holds them back for the settle
/// time.
#[must_use = "the write counts as in flight until the guard is finished or dropped"]
pub struct WriteGuard {
    store: LeaseStore,
    cell: Arc<LeaseCell>,
    life: WriteLife,
}

/// A write that may go to the backend.
pub struct Admitted {
    pub guard: WriteGuard,
    /// Time spent waiting for an earlier term's writes (0 almost always).
    pub waited_ms: u64,
}

/// A write that must wait for an earlier term's writes to finish.
#[derive(Debug)]
pub struct MustWait {
    /// The newest earlier term with writes in flight.
    pub older_token: u64,
    /// The waiting write's own term deadline.
    pub deadline_ms: u64,
    /// When the wait ends by the clock alone, if only time holds the write
    /// back (answered or unknown-outcome writes settling, writes from before
    /// a restart); `None` while an older write awaits its answer.
    pub until_ms: Option<u64>,
    /// When the check ran.
    pub now_ms: u64,
    cell: Arc<LeaseCell>,
}

/// What [`LeaseStore::try_admit_write`] decided, at once.
#[derive(Debug)]
pub enum Admission {
    /// The write may go to the backend now; it counts as in flight.
    Admitted(WriteGuard),
    /// The write must wait for an earlier term's writes to finish.
    MustWait(MustWait),
    /// The write is refused.
    Refused(Reject),
}

/// Why a write was not admitted.
#[derive(Debug)]
pub enum AdmitError {
    Rejected(Reject),
    /// Writes of an earlier term were still unfinished at the wait limit
    /// (or will be, which is known at once when only time holds the write
    /// back: then `retry_after_ms` says when they will have settled).
    DrainTimeout {
        older_token: u64,
        waited_ms: u64,
        retry_after_ms: Option<u64>,
    },
}

impl std::fmt::Debug for WriteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGuard")
            .field("token", &self.life.token())
            .finish()
    }
}

impl WriteGuard {
    /// The backend answered (the response head arrived) and a body follows
    /// ([`WriteLife::answered`]): from now on the write holds back newer
    /// terms only until the body ends or the settle time has passed.
    pub fn answered(&mut self) {
        let now_ms = self.store.clock().now_ms();
        if self.life.answered(&mut self.cell.inflight(), now_ms) {
            self.cell.changed.notify_waiters();
        }
    }

    /// The write is complete (its whole response has arrived): it stops
    /// counting as in flight now.
    pub fn finish(mut self) {
        let ended = self.life.finish(&mut self.cell.inflight());
        self.ended(ended);
    }

    /// The write's token.
    pub fn token(&self) -> u64 {
        self.life.token()
    }

    fn ended(&self, ended: Option<Ended>) {
        let Some(ended) = ended else { return };
        self.store.count_ended(&self.cell, ended.settles_at_ms);
        if ended.wake {
            self.cell.changed.notify_waiters();
        }
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        if self.life.is_over() {
            return;
        }
        // Unfinished: the outcome is unknown, and the backend may still
        // apply the write ([`WriteLife::abandon`]).
        let now_ms = self.store.clock().now_ms();
        let ended = self.life.abandon(&mut self.cell.inflight(), now_ms);
        self.ended(ended);
    }
}

impl LeaseStore {
    /// Decides at once whether a write with `token` may reach the storage
    /// now. The hot path: one map lookup, no allocation, no await.
    pub fn try_admit_write(
        &self,
        name: &str,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
        options: &AdmitOptions,
    ) -> Admission {
        let now_ms = self.shared.clock.now_ms();
        let Some(slot) = self.shared.leases.get(name) else {
            return Admission::Refused(Reject::UnknownToken { current: 0 });
        };
        let write = WriteCheck {
            token,
            lease_id,
            holder,
            margin_ms: options.margin_ms,
            barrier: options.barrier,
        };
        // The term cannot change meanwhile: that takes the map shard's
        // write lock, and `slot` holds it for reading. The cell is made, and
        // its writes locked, only once the lease's checks passed.
        let mut cell = None;
        let decision = slot
            .lease
            .admit(now_ms, self.shared.unsettled_until_ms, &write, || {
                cell.insert(slot.cell()).inflight()
            });
        match decision {
            Decision::Refuse(reject) => Admission::Refused(reject),
            Decision::Wait {
                older_token,
                until_ms,
                deadline_ms,
            } => Admission::MustWait(MustWait {
                older_token,
                deadline_ms,
                until_ms,
                now_ms,
                cell: cell.expect("a write told to wait was looked at").clone(),
            }),
            Decision::Admit(_) => {
                let cell = cell.expect("an admitted write was counted");
                self.count_admitted(cell);
                Admission::Admitted(WriteGuard {
                    store: self.clone(),
                    cell: cell.clone(),
                    life: WriteLife::new(token, options.settle_ms),
                })
            }
        }
    }

    /// [`LeaseStore::try_admit_write`], waiting as long as it allows.
    ///
    /// The handover barrier: while any write of an older term is in flight,
    /// a write of a newer term waits (re-checked whenever a term drains, and
    /// at its own deadline, which still applies). Writes of one term never
    /// wait for each other.
    pub async fn admit_write(
        &self,
        name: &str,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
        options: AdmitOptions,
    ) -> Result<Admitted, AdmitError> {
        let clock = &self.shared.clock;
        let mut started_ms = None;
        let admitted = |guard: WriteGuard, started_ms: Option<u64>| {
            let waited_ms = started_ms.map_or(0, |s| clock.now_ms().saturating_sub(s));
            if started_ms.is_some() {
                self.shared
                    .stats
                    .barrier_wait_ms
                    .fetch_add(waited_ms, Ordering::Relaxed);
            }
            Admitted { guard, waited_ms }
        };
        loop {
            let wait = match self.try_admit_write(name, token, lease_id, holder, &options) {
                Admission::Admitted(guard) => return Ok(admitted(guard, started_ms)),
                Admission::MustWait(wait) => wait,
                Admission::Refused(reject) => return Err(AdmitError::Rejected(reject)),
            };
            let now_ms = wait.now_ms;
            let started = *started_ms.get_or_insert_with(|| {
                self.shared
                    .stats
                    .barrier_waits
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    lease = name,
                    token,
                    older_token = wait.older_token,
                    "write waits for an earlier term's writes"
                );
                now_ms
            });
            if let Err(late) =
                admission::may_wait(started, now_ms, options.max_wait_ms, wait.until_ms)
            {
                self.shared
                    .stats
                    .barrier_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                return Err(AdmitError::DrainTimeout {
                    older_token: wait.older_token,
                    waited_ms: late.waited_ms,
                    retry_after_ms: late.retry_after_ms,
                });
            }
            // Listen first, then re-check: a drain between the check above
            // and this registration is then not missed.
            let cell = wait.cell;
            let notified = cell.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait = match self.try_admit_write(name, token, lease_id, holder, &options) {
                Admission::Admitted(guard) => return Ok(admitted(guard, started_ms)),
                Admission::MustWait(wait) => wait,
                Admission::Refused(reject) => return Err(AdmitError::Rejected(reject)),
            };
            // The term's own deadline (less the margin) still applies: wake
            // then and let the check refuse the write.
            let wake_ms = wait
                .deadline_ms
                .saturating_sub(options.margin_ms)
                .min(started.saturating_add(options.max_wait_ms))
                .min(wait.until_ms.unwrap_or(u64::MAX));
            tokio::select! {
                () = notified => {}
                () = clock.sleep_until(wake_ms) => {}
            }
        }
    }
}
