//! The shared, concurrent shell around the core's lease slots
//! (`fencegate_core::lease::slot`): each procedure on a lease is the
//! slot's, called here under the lease's lock; this module carries out
//! what it returns (records to the journal, wake-ups to waiters, gauges).
//!
//! Leases live in a [`DashMap`] keyed by name: a sharded map, so operations on
//! different leases rarely contend, and the write hot path is one shard read
//! lock and one lookup. A shard lock is held for the few instructions of a
//! state-machine call, or (a read lock) while a scrape counts a shard's
//! leases or the holder index is first built; it is never held across an
//! `.await` (persisting a grant and waiting for a lease both happen after the
//! guard is dropped).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Once, OnceLock};

use compact_str::CompactString;
use std::ops::Bound;
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use tokio::sync::Notify;

mod barrier;
mod bucket;
mod gauges;

pub use barrier::{
    Admission, AdmitError, AdmitOptions, Admitted, HandoverStats, MustWait, WriteGuard,
};
use bucket::ClientBuckets;
pub use bucket::Requester;
use gauges::{InflightCount, LiveTerms};

use super::id::LeaseId;
use super::inflight::{self, Inflight};
use super::machine::{AcquireRefused, Grant, Held, LeaseState, Reject, Term, View};
use super::restart::{self, RestartRule};
use super::retention::{self, Named};
use super::slot;
use crate::clock::Clock;
use crate::journal::record::{self, Kind};
use crate::journal::{Journal, JournalError, JournalFuture, LeaseRecord};
use crate::names::{Holder, LeaseName};

/// Bounds the store enforces on every acquire and renew (the config's
/// `[leases]` section).
#[derive(Clone, Copy, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeaseLimits {
    /// Shortest TTL accepted, inclusive.
    pub min_ttl_ms: u64,
    /// Longest TTL accepted, inclusive.
    pub max_ttl_ms: u64,
    /// Longest `wait_ms` accepted on acquire, inclusive.
    pub max_wait_ms: u64,
    /// Most distinct lease names the store keeps (concurrent first acquires
    /// may overshoot by a few).
    pub max_leases: usize,
    /// How long a lease with no live term, nothing waiting on it and no
    /// request naming it is kept; then it is forgotten, and its name no
    /// longer counts against `max_leases` (0: kept for ever). A forgotten
    /// name's next term still gets a token above every one it had.
    pub retention_ms: u64,
    /// Acquire attempts per second per client: the authenticated caller,
    /// or the address a request came from (a token bucket with a burst of
    /// one second's worth); 0 for no limit.
    pub acquire_rate_per_client: u32,
    /// The older name of `acquire_rate_per_client`, keyed on the holder
    /// name then; still read (with a warning at start), never written.
    #[serde(skip_serializing)]
    pub acquire_rate_per_holder: Option<u32>,
    /// How far the wall clock may be off between a term's last record and
    /// a restart (or a takeover, on another member's clock): a recovered
    /// term whose recorded wall-clock end lies further back than this ends
    /// at the start instead of being held for a full TTL (ending a term
    /// early is safe; the hint never extends one).
    pub wall_clock_tolerance_ms: u64,
}

impl Default for LeaseLimits {
    fn default() -> Self {
        Self {
            min_ttl_ms: 100,
            max_ttl_ms: 3_600_000,
            max_wait_ms: 60_000,
            max_leases: 1_000_000,
            retention_ms: 3_600_000,
            acquire_rate_per_client: 1000,
            acquire_rate_per_holder: None,
            wall_clock_tolerance_ms: 1000,
        }
    }
}

/// A granted term, as the acquirer sees it.
#[derive(Clone, Debug)]
pub struct Acquired {
    pub holder: String,
    pub token: u64,
    pub lease_id: LeaseId,
    pub ttl_ms: u64,
    pub expires_in_ms: u64,
}

/// Why an acquire failed.
#[derive(Debug)]
pub enum AcquireError {
    /// Another term is live (after waiting, if asked to).
    Held(Held),
    /// The TTL is outside the configured bounds.
    InvalidTtl { min_ttl_ms: u64, max_ttl_ms: u64 },
    /// The request is malformed (bad holder, wait too long).
    Invalid(String),
    /// The grant could not be made durable, or no token is left to issue.
    Unavailable(String),
    /// A new lease name, but the store already holds `max_leases` leases.
    TooManyLeases { max_leases: usize },
    /// The holder is over its acquire rate; try again after this long.
    RateLimited { retry_after_ms: u64 },
}

/// A grant made under its lease's lock, its record queued, not yet durable.
struct Pending {
    grant: Grant,
    lease_id: LeaseId,
    /// The term it replaced, put back if the record cannot be made durable.
    previous: Option<Term>,
    persisted: JournalFuture,
}

/// Why a renew failed.
#[derive(Debug)]
pub enum RenewError {
    Rejected(Reject),
    InvalidTtl { min_ttl_ms: u64, max_ttl_ms: u64 },
}

/// One lease's entry in the map: the core's slot (its state, and every
/// procedure on it) and the cell its waiters and writes in flight share.
struct Slot {
    lease: slot::Slot,
    /// Shared with the guards of the lease's writes in flight, so finishing a
    /// write touches only this cell, not the map. Made on the lease's first
    /// write or first waiting acquire: most held leases never need one.
    cell: OnceLock<Arc<LeaseCell>>,
}

impl Slot {
    fn new(lease: slot::Slot) -> Self {
        Self {
            lease,
            cell: OnceLock::new(),
        }
    }

    fn state(&self) -> &LeaseState {
        self.lease.state()
    }

    /// Whether the sweep may forget the lease (the core's
    /// [`slot::Slot::forget`]), and the mark it leaves: its cell, if it has
    /// one, held by nobody else (a waiting acquire or write) and its writes
    /// looked at under their lock.
    fn forget(&self, sweep: &retention::Sweep) -> Option<u64> {
        let cell = self.cell.get();
        self.lease.forget(
            sweep,
            cell.is_some_and(|cell| Arc::strong_count(cell) != 1),
            || cell.map(|cell| cell.inflight()),
        )
    }

    /// The lease's cell, made now if it has none yet.
    fn cell(&self) -> &Arc<LeaseCell> {
        self.cell.get_or_init(Arc::default)
    }

    /// Wakes whoever waits on the lease (nobody does if it has no cell).
    fn notify_waiters(&self) {
        if let Some(cell) = self.cell.get() {
            cell.changed.notify_waiters();
        }
    }
}

/// The parts of a lease that outlive a map lookup.
#[derive(Debug, Default)]
struct LeaseCell {
    /// Admitted writes not yet finished, by term. A plain mutex: it is held
    /// for a few instructions, never across an await, and is only contended
    /// by writes of the same lease. Lock order: map shard, then this.
    inflight: Mutex<Inflight>,
    /// Woken when the lease becomes free early (release, abandoned grant) and
    /// when the last write of a term in flight finishes, so waiting acquirers
    /// and waiting writes re-check at once. Waiters always re-check, so one
    /// notifier serves both.
    changed: Notify,
}

impl LeaseCell {
    fn inflight(&self) -> std::sync::MutexGuard<'_, Inflight> {
        // The counts stay consistent even if a holder panicked.
        self.inflight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `(holder, name)` pairs, in order.
type HolderIndex = BTreeSet<(CompactString, CompactString)>;

struct Shared {
    /// Names of 24 bytes or less (most) are kept inline, in the map and in
    /// both indexes, with no allocation of their own. Each lease is boxed:
    /// the hash table, half empty after it doubles, then holds 32-byte
    /// entries rather than 150-byte ones (a third less memory at 1M leases).
    leases: DashMap<CompactString, Box<Slot>>,
    /// Every name in `leases`, in order, for listing a page at a time.
    /// Lock order: map shard, then this.
    names: Mutex<BTreeSet<CompactString>>,
    /// `(holder, name)` of every lease's current term, in order, for
    /// listing one holder's leases a page at a time. Built on the first such
    /// page (only callers who are not admins, with authentication on, ask
    /// for one): a store that never serves one keeps no such index. Lock
    /// order: map shard, then this.
    by_holder: Mutex<Option<HolderIndex>>,
    /// Run once, to build `by_holder`.
    by_holder_built: Once,
    clock: Clock,
    limits: LeaseLimits,
    journal: Arc<dyn Journal>,
    stats: HandoverStats,
    /// Acquire rate buckets by client.
    buckets: ClientBuckets,
    /// Until this instant, writes of recovered leases may still be at the
    /// backend from before the restart (0: no restart to wait for).
    unsettled_until_ms: u64,
    /// Tokens of leases not in the store yet continue above this.
    token_floor: u64,
    /// The journal may have lost records: leases not in the store may have
    /// had terms, and writes, before the restart too.
    lost_records: bool,
    /// Live terms, kept on each change (the `leases_held` gauge).
    live_terms: LiveTerms,
    /// Writes in flight, kept on each admission and finish.
    inflight_writes: InflightCount,
    /// When the last write whose outcome became unknown has settled (the
    /// storage may apply it until then).
    settling_until_ms: AtomicU64,
    /// Leases not in the store (never granted, or forgotten) continue above
    /// this: the highest token of any lease forgotten, here or before a
    /// restart (the journal keeps it).
    forgotten_above: AtomicU64,
    /// Where the retention sweep goes on from.
    sweep_cursor: Mutex<Option<CompactString>>,
}

/// The lease store: cheap to clone, shared by the lease API and the fence.
#[derive(Clone)]
pub struct LeaseStore {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseStore")
            .field("leases", &self.shared.leases.len())
            .field("limits", &self.shared.limits)
            .finish()
    }
}

impl LeaseStore {
    /// A store on `clock`, persisting grants to `journal`.
    pub fn new(clock: Clock, limits: LeaseLimits, journal: Arc<dyn Journal>) -> Self {
        Self {
            shared: Arc::new(Shared {
                leases: DashMap::new(),
                names: Mutex::default(),
                by_holder: Mutex::default(),
                by_holder_built: Once::new(),
                clock,
                limits,
                journal,
                stats: HandoverStats::default(),
                buckets: ClientBuckets::default(),
                unsettled_until_ms: 0,
                token_floor: 0,
                lost_records: false,
                live_terms: LiveTerms::new(limits.max_ttl_ms),
                inflight_writes: InflightCount::default(),
                settling_until_ms: AtomicU64::new(0),
                forgotten_above: AtomicU64::new(0),
                sweep_cursor: Mutex::new(None),
            }),
        }
    }

    /// A store holding the leases a journal recovered: tokens continue above
    /// every recovered token, unreleased terms are held for a full TTL from
    /// now (see [`LeaseState::restored`]), and writes of a term that may
    /// follow a write sent before the restart wait until it has settled
    /// (unless the journal says none can be unfinished: a quiet grant or
    /// release, see [`LeaseRecord`]'s term).
    pub fn restore(
        clock: Clock,
        limits: LeaseLimits,
        journal: Arc<dyn Journal>,
        recovered: Vec<LeaseRecord>,
        rule: RestartRule,
    ) -> Result<Self, JournalError> {
        let mut store = Self::new(clock, limits, journal);
        let now_ms = store.shared.clock.now_ms();
        let wall_ms = store.shared.clock.wall_ms();
        let shared = Arc::get_mut(&mut store.shared).expect("a new store is not shared yet");
        shared.unsettled_until_ms = rule.window_until_ms(now_ms);
        shared.token_floor = rule.token_floor;
        shared.lost_records = rule.lost_records;
        shared.forgotten_above = AtomicU64::new(rule.forgotten_above);
        // A recovered term may have a TTL above today's limit: the ring of
        // live terms must reach its deadline.
        let longest_ttl_ms = recovered
            .iter()
            .filter_map(|l| l.term.as_ref().map(|t| t.ttl_ms))
            .max()
            .unwrap_or(0);
        if longest_ttl_ms > limits.max_ttl_ms {
            shared.live_terms = LiveTerms::new(longest_ttl_ms);
        }
        let restart::Restoration { leases, endings } = restart::restore_all(
            recovered,
            &rule,
            now_ms,
            wall_ms,
            limits.wall_clock_tolerance_ms,
        )
        .map_err(|e| JournalError(e.to_string()))?;
        for ending in &endings {
            drop(store.shared.journal.persist_release(
                ending.lease.as_str(),
                ending.token,
                ending.quiet(),
            ));
        }
        for restored in leases {
            let name: CompactString = restored.name.as_str().into();
            let lease = slot::Slot::from(restored);
            store
                .shared
                .live_terms
                .track(None, live_deadline(lease.state()));
            lock(&store.shared.names).insert(name.clone());
            store.shared.leases.insert(name, Box::new(Slot::new(lease)));
        }
        if !endings.is_empty() {
            tracing::info!(
                terms = endings.len(),
                "recovered terms ended by their wall-clock hint: they had ended before the restart"
            );
        }
        Ok(store)
    }

    /// The clock deadlines are measured on.
    pub fn clock(&self) -> &Clock {
        &self.shared.clock
    }

    /// The bounds in force.
    pub fn limits(&self) -> LeaseLimits {
        self.shared.limits
    }

    /// Whether grants can currently be persisted.
    pub fn is_ready(&self) -> bool {
        self.shared.journal.is_healthy()
    }

    fn check_ttl(&self, ttl_ms: u64) -> Result<(), (u64, u64)> {
        let l = self.shared.limits;
        if (l.min_ttl_ms..=l.max_ttl_ms).contains(&ttl_ms) {
            Ok(())
        } else {
            Err((l.min_ttl_ms, l.max_ttl_ms))
        }
    }

    /// Grants a new term of `name` to `holder`, waiting up to `wait_ms` for a
    /// live term to end. The token is persisted before this returns. The
    /// attempt counts against the holder's acquire rate (callers inside the
    /// process; the lease API uses [`LeaseStore::acquire_from`]).
    pub async fn acquire(
        &self,
        name: &LeaseName,
        holder: &Holder,
        ttl_ms: u64,
        wait_ms: u64,
    ) -> Result<Acquired, AcquireError> {
        let requester = Requester::Holder(holder.as_str());
        self.acquire_from(requester, name, holder, ttl_ms, wait_ms)
            .await
    }

    /// [`LeaseStore::acquire`] on behalf of `requester`, whose acquire
    /// rate the attempt counts against.
    pub async fn acquire_from(
        &self,
        requester: Requester<'_>,
        name: &LeaseName,
        holder: &Holder,
        ttl_ms: u64,
        wait_ms: u64,
    ) -> Result<Acquired, AcquireError> {
        self.check_acquire(requester, name, ttl_ms, wait_ms)?;
        let clock = &self.shared.clock;
        let wait_until_ms = clock.now_ms().saturating_add(wait_ms);
        loop {
            let lease_id = new_lease_id()?;
            let mut slot = self
                .shared
                .leases
                .entry(name.as_str().into())
                .or_insert_with(|| {
                    lock(&self.shared.names).insert(name.as_str().into());
                    Box::new(self.new_slot())
                });
            let now_ms = clock.now_ms();
            let held = match self.attempt(&mut slot, name, holder, ttl_ms, lease_id, now_ms) {
                Ok(pending) => {
                    drop(slot);
                    return self.confirm(name, holder, ttl_ms, pending).await;
                }
                Err(AcquireRefused::TokensExhausted) => {
                    return Err(AcquireError::Unavailable(
                        "every fencing token of this lease has been issued".into(),
                    ))
                }
                Err(AcquireRefused::Held(held)) => held,
            };
            if now_ms >= wait_until_ms {
                return Err(AcquireError::Held(held));
            }
            // Listen before the lease's lock is dropped, so a release
            // between the attempt and the wait below still wakes this
            // acquirer.
            let cell = slot.cell().clone();
            let notified = cell.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            drop(slot);
            let retry_at_ms = now_ms.saturating_add(held.expires_in_ms).min(wait_until_ms);
            tokio::select! {
                () = &mut notified => {}
                () = clock.sleep_until(retry_at_ms) => {}
            }
        }
    }

    /// The checks an acquire passes before it tries: TTL and wait bounds,
    /// the requester's rate, the number of leases.
    fn check_acquire(
        &self,
        requester: Requester<'_>,
        name: &LeaseName,
        ttl_ms: u64,
        wait_ms: u64,
    ) -> Result<(), AcquireError> {
        let limits = self.shared.limits;
        self.check_ttl(ttl_ms)
            .map_err(|(min_ttl_ms, max_ttl_ms)| AcquireError::InvalidTtl {
                min_ttl_ms,
                max_ttl_ms,
            })?;
        if wait_ms > limits.max_wait_ms {
            return Err(AcquireError::Invalid(format!(
                "wait_ms must be at most {}",
                limits.max_wait_ms
            )));
        }
        self.shared
            .buckets
            .take(
                requester,
                limits.acquire_rate_per_client,
                self.shared.clock.now_ms(),
            )
            .map_err(|retry_after_ms| AcquireError::RateLimited { retry_after_ms })?;
        let leases = &self.shared.leases;
        if leases.len() >= limits.max_leases
            && !leases.contains_key(name.as_str())
            && !self.make_room()
        {
            return Err(AcquireError::TooManyLeases {
                max_leases: limits.max_leases,
            });
        }
        Ok(())
    }

    /// One try at a grant, under the lease's lock. The record is queued
    /// while the lock is held: the next term of this lease can only be
    /// granted after it is released, so its record always follows this one
    /// in the journal, and a replay never ends on an older term.
    fn attempt(
        &self,
        slot: &mut Slot,
        name: &LeaseName,
        holder: &Holder,
        ttl_ms: u64,
        lease_id: LeaseId,
        now_ms: u64,
    ) -> Result<Pending, AcquireRefused> {
        let before = live_deadline(slot.state());
        let ask = slot::GrantAsk {
            lease: name.as_str(),
            holder: holder.as_str(),
            ttl_ms,
            now_ms,
            wall_ms: self.shared.clock.wall_ms(),
            unsettled_until_ms: self.shared.unsettled_until_ms,
        };
        let cell = slot.cell.get();
        let granted = slot
            .lease
            .grant(ask, lease_id.clone(), || cell.map(|cell| cell.inflight()))?;
        self.shared
            .live_terms
            .track(before, live_deadline(slot.state()));
        self.index_holder(
            granted.previous.as_ref().map(|t| t.holder.as_str()),
            Some(holder.as_str()),
            name.as_str(),
        );
        let persisted = awaited(
            Kind::Grant,
            self.shared.journal.persist_grant(granted.record),
        );
        Ok(Pending {
            grant: granted.grant,
            lease_id,
            previous: granted.previous,
            persisted,
        })
    }

    /// Waits for `pending`'s record to be durable; if it cannot be, the
    /// grant is taken back and the acquire fails closed.
    async fn confirm(
        &self,
        name: &LeaseName,
        holder: &Holder,
        ttl_ms: u64,
        pending: Pending,
    ) -> Result<Acquired, AcquireError> {
        let Pending {
            grant,
            lease_id,
            previous,
            persisted,
        } = pending;
        if let Err(err) = persisted.await {
            self.abandon(name, holder.as_str(), grant.token, previous);
            tracing::warn!(target: "audit", lease = name.as_str(), token = grant.token, error = %err, "grant not persisted; refused");
            return Err(AcquireError::Unavailable(
                "the lease store cannot persist grants right now".into(),
            ));
        }
        tracing::info!(target: "audit", lease = name.as_str(), token = grant.token, holder = holder.as_str(), ttl_ms, "lease acquired");
        Ok(Acquired {
            holder: holder.as_str().to_owned(),
            token: grant.token,
            lease_id,
            ttl_ms,
            // Time spent persisting counts against the term.
            expires_in_ms: grant.expires_in_ms(self.shared.clock.now_ms()),
        })
    }

    /// The entry of a lease not in the store yet.
    fn new_slot(&self) -> Slot {
        Slot::new(slot::Slot::new(&RestartRule {
            token_floor: self.shared.token_floor,
            forgotten_above: self.shared.forgotten_above.load(Ordering::Acquire),
            lost_records: self.shared.lost_records,
            ..RestartRule::default()
        }))
    }

    fn abandon(&self, name: &str, holder: &str, token: u64, previous: Option<Term>) {
        if let Some(mut slot) = self.shared.leases.get_mut(name) {
            let before = previous.as_ref().map(|t| t.holder.clone());
            let live_before = live_deadline(slot.state());
            let abandoned = slot.lease.abandon(token, previous);
            self.shared
                .live_terms
                .track(live_before, live_deadline(slot.state()));
            if abandoned {
                self.index_holder(Some(holder), before.as_deref(), name);
                slot.notify_waiters();
            }
        }
    }

    /// Moves `name` in the holder index, if there is one yet, from `from`
    /// to `to` (called under the lease's map shard lock).
    fn index_holder(&self, from: Option<&str>, to: Option<&str>, name: &str) {
        if from == to {
            return;
        }
        let mut index = lock(&self.shared.by_holder);
        let Some(index) = index.as_mut() else {
            return;
        };
        if let Some(from) = from {
            index.remove(&(from.into(), name.into()));
        }
        if let Some(to) = to {
            index.insert((to.into(), name.into()));
        }
    }

    /// Whether the index by holder exists yet.
    pub fn has_holder_index(&self) -> bool {
        self.shared.by_holder_built.is_completed()
    }

    /// Builds the index by holder if it does not exist yet: a pass over
    /// every lease, so callers on the async workers run it with
    /// `spawn_blocking` (the first holder page does).
    pub fn build_holder_index(&self) {
        drop(self.holder_index());
    }

    /// The holder index, built first if this is its first use. From the
    /// moment it exists every change of holder updates it; then the current
    /// holders are copied out (each shard read-locked only while its pairs
    /// are copied) and inserted a batch at a time, so neither a shard nor
    /// the index is held for long. A change between a pair's copy and its
    /// insertion can leave that stale pair behind: `page` checks each
    /// lease's holder again, so it is never shown.
    fn holder_index(&self) -> std::sync::MutexGuard<'_, Option<HolderIndex>> {
        self.shared.by_holder_built.call_once(|| {
            *lock(&self.shared.by_holder) = Some(BTreeSet::new());
            let pairs: Vec<(CompactString, CompactString)> = self
                .shared
                .leases
                .iter()
                .filter_map(|e| Some((e.value().state().term()?.holder.clone(), e.key().clone())))
                .collect();
            for batch in pairs.chunks(4096) {
                if let Some(index) = lock(&self.shared.by_holder).as_mut() {
                    index.extend(batch.iter().cloned());
                }
            }
        });
        lock(&self.shared.by_holder)
    }

    /// Extends the live term `token` of `name` by `ttl_ms` (or its last TTL).
    /// `holder` is the authenticated caller, when authentication is on.
    pub fn renew(
        &self,
        name: &str,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
        ttl_ms: Option<u64>,
    ) -> Result<Acquired, RenewError> {
        if let Some(ttl_ms) = ttl_ms {
            self.check_ttl(ttl_ms)
                .map_err(|(min_ttl_ms, max_ttl_ms)| RenewError::InvalidTtl {
                    min_ttl_ms,
                    max_ttl_ms,
                })?;
        }
        let now_ms = self.shared.clock.now_ms();
        let mut slot = self
            .shared
            .leases
            .get_mut(name)
            .ok_or(RenewError::Rejected(Reject::UnknownToken { current: 0 }))?;
        let before = live_deadline(slot.state());
        let presented = slot::Presented {
            token,
            lease_id,
            holder,
        };
        let wall_ms = self.shared.clock.wall_ms();
        let slot::Renewed { grant, hint } = slot
            .lease
            .renew(now_ms, wall_ms, presented, ttl_ms)
            .map_err(RenewError::Rejected)?;
        self.shared
            .live_terms
            .track(before, live_deadline(slot.state()));
        let term = slot.state().term().expect("renewed term exists");
        let renewed = Acquired {
            holder: term.holder.to_string(),
            token,
            lease_id: term.lease_id.clone(),
            ttl_ms: grant.ttl_ms,
            expires_in_ms: grant.expires_in_ms(now_ms),
        };
        // After a restart the term is held for a full TTL, or less if the
        // wall-clock hint says it had ended: a renewal records a new hint
        // when the core says one is due. Queued under the guard, like every
        // record of a lease, so records keep the order of events; kept only
        // once the journal took it.
        if let Some(hint) = hint {
            let journal = &self.shared.journal;
            if journal.record_renew(name, hint.token, hint.ttl_ms, hint.wall_ms) {
                slot.lease.hint_taken(&hint);
            }
        }
        drop(slot);
        Ok(renewed)
    }

    /// Ends the live term `token` of `name`; waiting acquirers retry at once.
    /// `holder` is the authenticated caller, when authentication is on.
    /// The release's record is queued under the lease's lock; the future
    /// completes once it is durable (answer only then: else a crash could
    /// bring the released term back).
    pub fn release(
        &self,
        name: &str,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
    ) -> Result<JournalFuture, Reject> {
        let now_ms = self.shared.clock.now_ms();
        let mut slot = self
            .shared
            .leases
            .get_mut(name)
            .ok_or(Reject::UnknownToken { current: 0 })?;
        let before = live_deadline(slot.state());
        let presented = slot::Presented {
            token,
            lease_id,
            holder,
        };
        let entry: &mut Slot = &mut slot;
        let cell = entry.cell.get();
        let quiet = entry.lease.release(
            now_ms,
            presented,
            || cell.map(|cell| cell.inflight()),
            self.shared.unsettled_until_ms,
        )?;
        self.shared.live_terms.track(before, None);
        let persisted = awaited(
            Kind::Release,
            self.shared.journal.persist_release(name, token, quiet),
        );
        slot.notify_waiters();
        Ok(persisted)
    }

    /// Whether term `token` of `name` is still current and live with more
    /// than `margin_ms` left (a write admitted a moment ago, checked again
    /// right before it leaves).
    pub fn check_live(&self, name: &str, token: u64, margin_ms: u64) -> Result<(), Reject> {
        let now_ms = self.shared.clock.now_ms();
        let slot = self
            .shared
            .leases
            .get(name)
            .ok_or(Reject::UnknownToken { current: 0 })?;
        slot.state()
            .check_write(now_ms, margin_ms, token, None, None)
            .map(|_| ())
    }

    /// Counters of the handover barrier.
    pub fn handover_stats(&self) -> &HandoverStats {
        &self.shared.stats
    }

    /// The current term's token and holder of `name`, if it was ever granted.
    pub fn holder(&self, name: &str) -> Option<(u64, String)> {
        let slot = self.shared.leases.get(name)?;
        slot.state().term().map(|t| (t.token, t.holder.to_string()))
    }

    /// What inspection shows of `name`; `None` if it was never granted.
    pub fn inspect(&self, name: &str) -> Option<View> {
        let now_ms = self.shared.clock.now_ms();
        let slot = self.shared.leases.get(name)?;
        slot.lease.named(Named::Inspect, now_ms);
        slot.state().view(now_ms)
    }

    /// Forgets, of the next `budget` leases in name order (going on from
    /// where the last call stopped, and round again), those idle for the
    /// retention time (see [`LeaseLimits::retention_ms`]); how many it
    /// forgot. Each is checked and removed under its lease's lock, its
    /// highest token raised into the mark every lease not in the store
    /// continues above, and the journal told, before any later grant of
    /// the name can be queued.
    pub fn forget_idle(&self, budget: usize) -> usize {
        let shared = &self.shared;
        let retention_ms = shared.limits.retention_ms;
        if retention_ms == 0 {
            return 0;
        }
        let now_ms = shared.clock.now_ms();
        let sweep = retention::Sweep::idle(now_ms, retention_ms, shared.unsettled_until_ms);
        self.forget(budget, &sweep)
    }

    /// The store is full and a new name asks in: forgets, of the next few
    /// hundred leases the sweep would look at, the first with no live
    /// term and nothing waiting on or writing under it, however recently it
    /// was named (the core's `Sweep::making_room`: the mark keeps its
    /// tokens safe; only the retention's courtesy is cut short). Whether
    /// room was made. Nothing is forgotten with retention off.
    fn make_room(&self) -> bool {
        let shared = &self.shared;
        if shared.limits.retention_ms == 0 {
            return false;
        }
        let now_ms = shared.clock.now_ms();
        let sweep = retention::Sweep::making_room(now_ms, shared.unsettled_until_ms);
        self.forget(256, &sweep) > 0
    }

    /// Forgets, of the next `budget` leases in name order, those `sweep`
    /// lets go, stopping at its most.
    fn forget(&self, budget: usize, sweep: &retention::Sweep) -> usize {
        let shared = &self.shared;
        let names: Vec<CompactString> = {
            let mut cursor = lock(&shared.sweep_cursor);
            let from = match cursor.as_deref() {
                Some(after) => Bound::Excluded(after),
                None => Bound::Unbounded,
            };
            let names: Vec<CompactString> = lock(&shared.names)
                .range::<str, _>((from, Bound::Unbounded))
                .take(budget)
                .cloned()
                .collect();
            *cursor = if names.len() < budget {
                None
            } else {
                names.last().cloned()
            };
            names
        };
        let mut forgotten = 0;
        for name in names {
            let removed = shared.leases.remove_if(name.as_str(), |_, slot| {
                let Some(mark) = slot.forget(sweep) else {
                    return false;
                };
                // Under the lease's lock: no grant of this name can come
                // between the mark, the journal's record and the removal.
                let _ = shared.forgotten_above.fetch_update(
                    Ordering::AcqRel,
                    Ordering::Acquire,
                    |above| Some(record::forgotten_above(above, mark)),
                );
                shared.journal.record_forget(&name, mark);
                lock(&shared.names).remove(name.as_str());
                let holder = slot.state().term().map(|t| t.holder.as_str());
                self.index_holder(holder, None, &name);
                true
            });
            if removed.is_some() {
                forgotten += 1;
                if forgotten == sweep.most {
                    break;
                }
            }
        }
        if forgotten > 0 {
            tracing::debug!(forgotten, "idle leases forgotten");
        }
        forgotten
    }

    /// Runs [`LeaseStore::forget_idle`] a thousand leases at a time, ten
    /// times a second (a pass over a million leases takes 100 s), for as
    /// long as the store exists; does nothing when retention is off.
    pub fn start_sweeper(&self) {
        if self.shared.limits.retention_ms == 0 {
            return;
        }
        let store = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            let mut every =
                tokio::time::interval(std::time::Duration::from_millis(retention::SWEEP_EVERY_MS));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(shared) = store.upgrade() else {
                    return;
                };
                LeaseStore { shared }.forget_idle(1_000);
            }
        });
    }

    /// How many leases the store keeps.
    pub fn len(&self) -> usize {
        self.shared.leases.len()
    }

    /// Whether the store keeps no lease.
    pub fn is_empty(&self) -> bool {
        self.shared.leases.is_empty()
    }

    /// One page of the leases ever granted, in name order: up to `limit`
    /// whose names start with `prefix` (`""`: all), after `after`, only those
    /// whose current term is `holder`'s when it is given (read from the
    /// holder index, so such a page looks at the holder's leases only), and
    /// the name to continue after (`None`: no such lease follows). The cursor
    /// is always a lease of the page.
    pub fn page(
        &self,
        holder: Option<&str>,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> (Vec<(String, View)>, Option<String>) {
        const BATCH: usize = 256;
        let now_ms = self.shared.clock.now_ms();
        let mut out: Vec<(String, View)> = Vec::new();
        // Names before the prefix cannot start with it: skip them at once.
        let mut cursor = after.filter(|a| *a >= prefix).map(str::to_owned);
        // One more than the page, to know whether another page follows.
        let mut extra = false;
        'scan: loop {
            // Names are copied out a batch at a time: the map is read
            // without holding the index (the lock order is map, index).
            let batch: Vec<String> = match holder {
                None => {
                    let names = lock(&self.shared.names);
                    let from = cursor
                        .as_deref()
                        .map_or(Bound::Included(prefix), Bound::Excluded);
                    names
                        .range::<str, _>((from, Bound::Unbounded))
                        .take_while(|n| n.starts_with(prefix))
                        .take(BATCH)
                        .map(|n| n.to_string())
                        .collect()
                }
                Some(holder) => {
                    let index = self.holder_index();
                    let Some(index) = index.as_ref() else {
                        break;
                    };
                    let start = (
                        CompactString::from(holder),
                        CompactString::from(cursor.as_deref().unwrap_or(prefix)),
                    );
                    let from = match cursor {
                        Some(_) => Bound::Excluded(start),
                        None => Bound::Included(start),
                    };
                    index
                        .range((from, Bound::Unbounded))
                        .take_while(|(h, name)| h == holder && name.starts_with(prefix))
                        .take(BATCH)
                        .map(|(_, name)| name.to_string())
                        .collect()
                }
            };
            if batch.is_empty() {
                break;
            }
            for name in batch {
                let view = self
                    .shared
                    .leases
                    .get(name.as_str())
                    .and_then(|slot| slot.state().view(now_ms));
                // The term may have changed hands since the index was read.
                let theirs = |v: &View| holder.is_none_or(|h| v.holder == h);
                if let Some(view) = view.filter(theirs) {
                    if out.len() == limit {
                        extra = true;
                        break 'scan;
                    }
                    out.push((name.clone(), view));
                }
                cursor = Some(name);
            }
        }
        let next = if extra {
            out.last().map(|(name, _)| name.clone())
        } else {
            None
        };
        (out, next)
    }

    /// Writes in flight now, all leases together: a few counters summed,
    /// whatever the number of leases.
    pub fn inflight_count(&self) -> u64 {
        self.shared.inflight_writes.count()
    }

    /// How long a write whose outcome became unknown (see
    /// [`LeaseStore::inflight_count`], which no longer counts it) may still
    /// be applied by the storage, in milliseconds: 0 once the last has
    /// settled.
    pub fn settling_left_ms(&self) -> u64 {
        self.shared
            .settling_until_ms
            .load(Ordering::Acquire)
            .saturating_sub(self.shared.clock.now_ms())
    }

    /// Whether a primary handing its shard over, its primacy revoked, may
    /// record the handover as clean now (the core's
    /// `cluster::handover_drained`): no admitted write unfinished, none of
    /// unknown outcome still settling, and this store's own restart (or
    /// takeover) window over.
    pub fn handover_drained(&self) -> bool {
        // The count first: a write that leaves it has set how long it
        // settles before (see `count_ended`).
        let in_flight = self.inflight_count();
        let settling_until_ms = self.shared.settling_until_ms.load(Ordering::Acquire);
        fencegate_core::cluster::handover_drained(
            in_flight,
            self.shared.clock.now_ms(),
            settling_until_ms,
            self.shared.unsettled_until_ms,
        )
    }

    /// How many leases have a live term now, counting those whose deadline
    /// falls within the last [`LeaseStore::held_count_precision_ms`]: read
    /// from counters kept on each change, whatever the number of leases.
    pub fn held_count(&self) -> usize {
        let now_ms = self.shared.clock.now_ms();
        usize::try_from(self.shared.live_terms.count(now_ms)).unwrap_or(usize::MAX)
    }

    /// How early [`LeaseStore::held_count`] may still count a term that
    /// has just expired, in milliseconds.
    pub fn held_count_precision_ms(&self) -> u64 {
        self.shared.live_terms.bucket_ms()
    }
}

impl LeaseStore {
    /// Counts a write of the lease whose cell is `cell` into the writes in
    /// flight.
    fn count_admitted(&self, cell: &Arc<LeaseCell>) {
        self.shared.inflight_writes.add(Arc::as_ptr(cell) as usize);
    }

    /// Counts a write of the lease whose cell is `cell` out of the writes in
    /// flight; with `linger_until_ms` its outcome is unknown and it settles
    /// then.
    fn count_ended(&self, cell: &Arc<LeaseCell>, settles_at_ms: Option<u64>) {
        // Only a write of unknown outcome touches this shared line: one
        // that finished (the usual case) costs the counter alone. Before
        // the count (Release): a drain that sees it gone sees this too.
        if let Some(at) = settles_at_ms {
            let _ = self.shared.settling_until_ms.fetch_update(
                Ordering::Release,
                Ordering::Relaxed,
                |until| Some(inflight::settling_until(until, at)),
            );
        }
        self.shared
            .inflight_writes
            .remove(Arc::as_ptr(cell) as usize);
    }
}

/// The deadline of `state`'s term if it has one that was not released (it
/// may be past).
/// A fresh lease id from the OS random number generator.
fn new_lease_id() -> Result<LeaseId, AcquireError> {
    let mut raw = [0u8; super::id::ID_BYTES];
    getrandom::fill(&mut raw)
        .map_err(|e| AcquireError::Unavailable(format!("OS RNG failed: {e}")))?;
    Ok(LeaseId::from_bytes(raw))
}

fn live_deadline(state: &LeaseState) -> Option<u64> {
    state.term().filter(|t| !t.released).map(|t| t.deadline_ms)
}

/// The journal's answer to a record of `kind`, if the answer waits for it
/// (the core's `record::awaited`); else one that is ready at once, the
/// record queued all the same.
fn awaited(kind: Kind, persisted: JournalFuture) -> JournalFuture {
    if record::awaited(kind) {
        persisted
    } else {
        Box::pin(std::future::ready(Ok(())))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str) -> LeaseName {
        LeaseName::new(name).unwrap()
    }

    fn holder(name: &str) -> Holder {
        Holder::new(name).unwrap()
    }
    use crate::journal::MemoryJournal;

    #[test]
    fn fresh_lease_ids_differ() {
        let a = new_lease_id().unwrap();
        let b = new_lease_id().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), crate::lease::id::LEASE_ID_LEN);
    }

    fn store(clock: &Clock) -> (LeaseStore, Arc<MemoryJournal>) {
        let journal = Arc::new(MemoryJournal::default());
        (
            LeaseStore::new(clock.clone(), LeaseLimits::default(), journal.clone()),
            journal,
        )
    }

    #[tokio::test]
    async fn pages_follow_name_order_and_name_only_what_they_show() {
        let clock = Clock::manual(0);
        let (s, _) = store(&clock);
        for i in 0..10 {
            let h = if i % 3 == 0 { "mine" } else { "other" };
            s.acquire(&lease(&format!("l{i}")), &holder(h), 1000, 0)
                .await
                .unwrap();
        }
        let names = |page: &[(String, View)]| -> Vec<String> {
            page.iter().map(|(n, _)| n.clone()).collect()
        };
        let (page, next) = s.page(None, "", None, 4);
        assert_eq!(names(&page), ["l0", "l1", "l2", "l3"]);
        assert_eq!(next.as_deref(), Some("l3"));
        let (page, next) = s.page(None, "", Some("l3"), 4);
        assert_eq!(names(&page), ["l4", "l5", "l6", "l7"]);
        let (page, next) = s.page(None, "", next.as_deref(), 4);
        assert_eq!((names(&page), next), (vec!["l8".into(), "l9".into()], None));
        // A page that ends exactly at the last lease has no next page.
        let (page, next) = s.page(None, "", Some("l5"), 4);
        assert_eq!((names(&page).len(), next), (4, None));
        // A cursor need not be a lease.
        let (page, _) = s.page(None, "", Some("l55"), 1);
        assert_eq!(names(&page), ["l6"]);
        // One holder's, from the holder index: the cursor is always one of
        // its leases.
        let (page, next) = s.page(Some("mine"), "", None, 2);
        assert_eq!(names(&page), ["l0", "l3"]);
        assert_eq!(next.as_deref(), Some("l3"));
        let (page, next) = s.page(Some("mine"), "", next.as_deref(), 2);
        assert_eq!((names(&page), next), (vec!["l6".into(), "l9".into()], None));
        // A holder whose name another's begins with sees none of them; a
        // new term moves a lease to its new holder.
        assert!(s.page(Some("min"), "", None, 10).0.is_empty());
        clock.advance(1000).unwrap();
        s.acquire(&lease("l3"), &holder("other"), 1000, 0)
            .await
            .unwrap();
        let (page, _) = s.page(Some("mine"), "", None, 10);
        assert_eq!(names(&page), ["l0", "l6", "l9"]);
        let (page, _) = s.page(Some("other"), "", None, 10);
        assert_eq!(names(&page), ["l1", "l2", "l3", "l4", "l5", "l7", "l8"]);
    }

    #[tokio::test]
    async fn a_prefix_pages_through_the_names_that_start_with_it() {
        let clock = Clock::manual(0);
        let (s, _) = store(&clock);
        for (name, h) in [
            ("a", "x"),
            ("ab", "x"),
            ("abc", "y"),
            ("abd", "x"),
            ("b", "x"),
        ] {
            s.acquire(&lease(name), &holder(h), 1000, 0).await.unwrap();
        }
        let names = |page: &[(String, View)]| -> Vec<String> {
            page.iter().map(|(n, _)| n.clone()).collect()
        };
        let (page, next) = s.page(None, "ab", None, 2);
        assert_eq!(
            (names(&page), next.as_deref()),
            (vec!["ab".into(), "abc".into()], Some("abc"))
        );
        let (page, next) = s.page(None, "ab", next.as_deref(), 2);
        assert_eq!((names(&page), next), (vec!["abd".into()], None));
        // A cursor before the prefix starts at the prefix; one past it ends.
        assert_eq!(
            names(&s.page(None, "ab", Some("a"), 10).0),
            ["ab", "abc", "abd"]
        );
        assert!(s.page(None, "ab", Some("abz"), 10).0.is_empty());
        assert!(s.page(None, "c", None, 10).0.is_empty());
        // Within one holder's leases.
        assert_eq!(names(&s.page(Some("x"), "ab", None, 10).0), ["ab", "abd"]);
        assert_eq!(names(&s.page(Some("x"), "ab", Some("ab"), 10).0), ["abd"]);
    }

    #[tokio::test]
    async fn waiting_acquire_wakes_on_release() {
        let clock = Clock::manual(0);
        let (leases, _) = store(&clock);
        let a = leases
            .acquire(&lease("l"), &holder("A"), 10_000, 0)
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let leases = leases.clone();
            async move { leases.acquire(&lease("l"), &holder("B"), 1000, 5_000).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        leases
            .release("l", a.token, Some(a.lease_id.expose().as_bytes()), None)
            .unwrap()
            .await
            .unwrap();
        let b = waiter.await.unwrap().unwrap();
        assert_eq!(b.token, 2);
    }

    #[tokio::test]
    async fn waiting_acquire_wakes_at_expiry_and_gives_up_at_wait_end() {
        let clock = Clock::manual(0);
        let (leases, _) = store(&clock);
        leases
            .acquire(&lease("l"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let leases = leases.clone();
            async move { leases.acquire(&lease("l"), &holder("B"), 1000, 5_000).await }
        });
        tokio::task::yield_now().await;
        clock.advance(999);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        clock.advance(1);
        let b = waiter.await.unwrap().unwrap();
        assert_eq!((b.token, b.holder.as_str()), (2, "B"));

        // B holds for 1 s; C waits 300 ms and gives up with the holder's details.
        let waiter = tokio::spawn({
            let leases = leases.clone();
            async move { leases.acquire(&lease("l"), &holder("C"), 1000, 300).await }
        });
        tokio::task::yield_now().await;
        clock.advance(300);
        match waiter.await.unwrap() {
            Err(AcquireError::Held(h)) => assert_eq!((h.token, h.expires_in_ms), (2, 700)),
            other => panic!("expected held, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn failed_persist_issues_no_token_and_recovers() {
        let clock = Clock::manual(0);
        let (leases, journal) = store(&clock);
        journal.set_failing(true);
        assert!(!leases.is_ready());
        assert!(matches!(
            leases.acquire(&lease("l"), &holder("A"), 1000, 0).await,
            Err(AcquireError::Unavailable(_))
        ));
        assert_eq!(leases.inspect("l"), None);
        journal.set_failing(false);
        assert!(leases.is_ready());
        let a = leases
            .acquire(&lease("l"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        // The abandoned token 1 is never reused.
        assert_eq!(a.token, 2);
    }

    /// A journal that notes, for each grant, whether the lease was still
    /// locked when the record was queued.
    #[derive(Default)]
    struct LockProbe {
        store: std::sync::OnceLock<LeaseStore>,
        locked: Mutex<Vec<bool>>,
    }

    impl Journal for LockProbe {
        fn persist_grant(
            &self,
            record: crate::journal::GrantRecord,
        ) -> crate::journal::JournalFuture {
            let store = self.store.get().expect("store set");
            let locked = store
                .shared
                .leases
                .try_get_mut(record.lease.as_str())
                .is_locked();
            self.locked.lock().unwrap().push(locked);
            Box::pin(async { Ok(()) })
        }
        fn record_renew(&self, _: &str, _: u64, _: u64, _: u64) -> bool {
            true
        }
        fn persist_release(&self, _: &str, _: u64, _: bool) -> crate::journal::JournalFuture {
            Box::pin(async { Ok(()) })
        }
        fn record_forget(&self, _: &str, _: u64) {}
        fn is_healthy(&self) -> bool {
            true
        }
    }

    /// Seen failing when the record was sent after the guard was dropped: in
    /// that window the term could expire and the next term's grant reach the
    /// journal first, so a replay ended on the older term.
    #[tokio::test]
    async fn grants_are_queued_while_their_lease_is_locked() {
        let clock = Clock::manual(0);
        let probe = Arc::new(LockProbe::default());
        let leases = LeaseStore::new(clock.clone(), LeaseLimits::default(), probe.clone());
        probe.store.set(leases.clone()).unwrap();
        leases
            .acquire(&lease("l"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        clock.advance(1000);
        leases
            .acquire(&lease("l"), &holder("B"), 1000, 0)
            .await
            .unwrap();
        assert_eq!(*probe.locked.lock().unwrap(), [true, true]);
    }

    #[tokio::test]
    async fn the_number_of_leases_is_bounded() {
        let clock = Clock::manual(0);
        let limits = LeaseLimits {
            max_leases: 2,
            ..LeaseLimits::default()
        };
        let leases = LeaseStore::new(clock, limits, Arc::new(MemoryJournal::default()));
        leases
            .acquire(&lease("a"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        let b = leases
            .acquire(&lease("b"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        assert!(matches!(
            leases.acquire(&lease("c"), &holder("A"), 1000, 0).await,
            Err(AcquireError::TooManyLeases { max_leases: 2 })
        ));
        // Known names keep working.
        leases
            .release("b", b.token, Some(b.lease_id.expose().as_bytes()), None)
            .unwrap()
            .await
            .unwrap();
        assert_eq!(
            leases
                .acquire(&lease("b"), &holder("B"), 1000, 0)
                .await
                .unwrap()
                .token,
            2
        );
    }

    /// Seen failing before retention: once `max_leases` names were taken,
    /// every new name was refused for ever.
    #[tokio::test]
    async fn idle_leases_are_forgotten_and_their_names_keep_their_tokens() {
        let clock = Clock::manual(0);
        let limits = LeaseLimits {
            max_leases: 3,
            retention_ms: 10_000,
            ..LeaseLimits::default()
        };
        let leases = LeaseStore::new(clock.clone(), limits, Arc::new(MemoryJournal::default()));
        let mut tokens = Vec::new();
        for _ in 0..4 {
            let a = leases
                .acquire(&lease("a"), &holder("A"), 1000, 0)
                .await
                .unwrap();
            tokens.push(a.token);
            leases
                .release("a", a.token, Some(a.lease_id.expose().as_bytes()), None)
                .unwrap()
                .await
                .unwrap();
        }
        leases
            .acquire(&lease("b"), &holder("B"), 1000, 0)
            .await
            .unwrap();
        leases
            .acquire(&lease("c"), &holder("C"), 1000, 0)
            .await
            .unwrap();
        assert!(matches!(
            leases.acquire(&lease("d"), &holder("D"), 1000, 0).await,
            Err(AcquireError::TooManyLeases { .. })
        ));
        // Not before the retention time has passed since the terms ended
        // (b's and c's at 1 s) and the last request naming them.
        clock.advance(10_999);
        assert_eq!(leases.inspect("c").map(|v| v.token), Some(1));
        clock.advance(1);
        assert_eq!(leases.forget_idle(100), 2, "a and b");
        assert_eq!(leases.forget_idle(100), 0, "c was inspected at 10,999");
        assert!(leases.inspect("a").is_none());
        // Room again; a forgotten name goes on above every token it had.
        leases
            .acquire(&lease("d"), &holder("D"), 1000, 0)
            .await
            .unwrap();
        let again = leases
            .acquire(&lease("a"), &holder("A2"), 1000, 0)
            .await
            .unwrap();
        assert!(
            tokens.iter().all(|&t| again.token > t),
            "{} after {tokens:?}",
            again.token
        );
        assert_eq!(leases.len(), 3);
        // Full (a, c, d): a new name makes room at once by forgetting a
        // lease with no live term, however recently it was named (c). Seen
        // failing before: a client that kept naming its idle names kept
        // every new name out for as long as it went on.
        leases
            .acquire(&lease("e"), &holder("E"), 1000, 0)
            .await
            .unwrap();
        assert!(leases.inspect("c").is_none());
        assert!(
            matches!(
                leases.acquire(&lease("f"), &holder("F"), 1000, 0).await,
                Err(AcquireError::TooManyLeases { .. })
            ),
            "a, d and e have live terms"
        );
    }

    /// After a restart or a takeover, names the journal no longer holds
    /// start above its mark of forgotten tokens.
    #[tokio::test]
    async fn a_restored_store_starts_new_names_above_the_forgotten_mark() {
        let rule = RestartRule {
            forgotten_above: 7,
            ..RestartRule::default()
        };
        let leases = LeaseStore::restore(
            Clock::manual(0),
            LeaseLimits::default(),
            Arc::new(MemoryJournal::default()),
            Vec::new(),
            rule,
        )
        .unwrap();
        let a = leases
            .acquire(&lease("a"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        assert_eq!(a.token, 8);
    }

    /// A lease something still waits on or writes under is kept, however
    /// long ago its term ended.
    #[tokio::test]
    async fn a_lease_with_a_waiter_or_a_write_is_kept() {
        let clock = Clock::manual(0);
        let limits = LeaseLimits {
            retention_ms: 10_000,
            ..LeaseLimits::default()
        };
        let leases = LeaseStore::new(clock.clone(), limits, Arc::new(MemoryJournal::default()));
        let a = leases
            .acquire(&lease("w"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        let options = AdmitOptions::default();
        let Admission::Admitted(guard) = leases.try_admit_write(
            "w",
            a.token,
            Some(a.lease_id.expose().as_bytes()),
            None,
            &options,
        ) else {
            panic!("not admitted");
        };
        clock.advance(60_000);
        assert_eq!(leases.forget_idle(10), 0, "a write in flight");
        drop(guard); // outcome unknown: it settles for settle_ms
        assert_eq!(leases.forget_idle(10), 0, "a write settling");
        clock.advance(options.settle_ms);
        assert_eq!(leases.forget_idle(10), 1);
    }

    #[tokio::test]
    async fn acquires_are_rate_limited_per_holder() {
        let clock = Clock::manual(0);
        let limits = LeaseLimits {
            acquire_rate_per_client: 2,
            ..LeaseLimits::default()
        };
        let leases = LeaseStore::new(clock.clone(), limits, Arc::new(MemoryJournal::default()));
        leases
            .acquire(&lease("a"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        leases
            .acquire(&lease("b"), &holder("A"), 1000, 0)
            .await
            .unwrap();
        match leases.acquire(&lease("c"), &holder("A"), 1000, 0).await {
            Err(AcquireError::RateLimited { retry_after_ms }) => assert_eq!(retry_after_ms, 500),
            other => panic!("{other:?}"),
        }
        // Another holder has its own bucket; time refills A's.
        leases
            .acquire(&lease("c"), &holder("B"), 1000, 0)
            .await
            .unwrap();
        clock.advance(499);
        assert!(leases
            .acquire(&lease("d"), &holder("A"), 1000, 0)
            .await
            .is_err());
        clock.advance(1);
        leases
            .acquire(&lease("d"), &holder("A"), 1000, 0)
            .await
            .unwrap();
    }

    /// The gauges kept on each change agree with a walk over every lease
    /// (what a scrape did before), through random grants, renewals,
    /// releases, expiries and failed grants.
    #[tokio::test]
    async fn the_kept_gauges_agree_with_a_walk_over_every_lease() {
        let clock = Clock::manual(0);
        let (s, journal) = store(&clock);
        let precision = s.held_count_precision_ms();
        let walk = |s: &LeaseStore| {
            let now_bucket = clock.now_ms() / precision;
            s.shared
                .leases
                .iter()
                .filter_map(|e| {
                    let deadline = live_deadline(e.value().state())?;
                    (deadline / precision >= now_bucket).then_some(())
                })
                .count()
        };
        let mut held: Vec<Option<Acquired>> = vec![None; 8];
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (rng >> 33) % n
        };
        for _ in 0..5_000 {
            let i = next(8) as usize;
            let name = format!("l{i}");
            match next(6) {
                0 | 1 => {
                    journal.set_failing(next(10) == 0);
                    if let Ok(a) = s
                        .acquire(&lease(&name), &holder("h"), 100 + next(2_000), 0)
                        .await
                    {
                        held[i] = Some(a);
                    }
                    journal.set_failing(false);
                }
                2 => {
                    if let Some(a) = &held[i] {
                        let ttl = (next(2) == 0).then(|| 100 + next(5_000));
                        let _ = s.renew(
                            &name,
                            a.token,
                            Some(a.lease_id.expose().as_bytes()),
                            None,
                            ttl,
                        );
                    }
                }
                3 => {
                    if let Some(a) = held[i].take() {
                        let _ =
                            s.release(&name, a.token, Some(a.lease_id.expose().as_bytes()), None);
                    }
                }
                _ => {
                    clock.advance(next(400));
                }
            }
            assert_eq!(s.held_count(), walk(&s));
        }
    }

    #[tokio::test]
    async fn bounds_are_inclusive() {
        let clock = Clock::manual(0);
        let (leases, _) = store(&clock);
        assert!(leases
            .acquire(&lease("a"), &holder("A"), 100, 0)
            .await
            .is_ok());
        assert!(leases
            .acquire(&lease("b"), &holder("A"), 3_600_000, 0)
            .await
            .is_ok());
        assert!(matches!(
            leases.acquire(&lease("c"), &holder("A"), 99, 0).await,
            Err(AcquireError::InvalidTtl { .. })
        ));
        assert!(matches!(
            leases
                .acquire(&lease("c"), &holder("A"), 3_600_001, 0)
                .await,
            Err(AcquireError::InvalidTtl { .. })
        ));
        assert!(matches!(
            leases
                .acquire(&lease("c"), &holder("A"), 1000, 60_001)
                .await,
            Err(AcquireError::Invalid(_))
        ));
    }
}
