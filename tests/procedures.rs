//! The lease store's procedures are the core's (`fencegate_core::lease::slot`):
//! a bug planted in one of them breaks the store itself, not only the
//! simulator that drives the same code. Each check below drives the real
//! `LeaseStore` on a manual clock and holds with nothing planted; with its
//! procedure's mutant planted, it fails (the simulator catches each too:
//! `crates/fencegate-sim/tests/mutants.rs`).
//!
//! One test, one mutant at a time: a mutant is planted for the whole
//! process, so this file is a test binary of its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fencegate::clock::Clock;
use fencegate::journal::{GrantRecord, Journal, JournalFuture, MemoryJournal};
use fencegate::lease::{AcquireError, Admission, AdmitOptions, LeaseLimits, LeaseStore};
use fencegate::names::{Holder, LeaseName};
use fencegate_core::mutant::{plant, Mutant};

/// A journal that keeps the grants it was given, and refuses the first
/// renewal record (a full queue).
#[derive(Default)]
struct Recording {
    grants: Mutex<Vec<GrantRecord>>,
    renewals_offered: AtomicUsize,
    memory: MemoryJournal,
}

impl Journal for Recording {
    fn persist_grant(&self, record: GrantRecord) -> JournalFuture {
        self.grants.lock().unwrap().push(record.clone());
        self.memory.persist_grant(record)
    }

    fn record_renew(&self, _: &str, _: u64, _: u64, _: u64) -> bool {
        self.renewals_offered.fetch_add(1, Ordering::SeqCst) > 0
    }

    fn persist_release(&self, lease: &str, token: u64, quiet: bool) -> JournalFuture {
        self.memory.persist_release(lease, token, quiet)
    }

    fn record_forget(&self, _: &str, _: u64) {}

    fn is_healthy(&self) -> bool {
        true
    }
}

fn name(n: &str) -> LeaseName {
    LeaseName::new(n).unwrap()
}

fn holder(n: &str) -> Holder {
    Holder::new(n).unwrap()
}

fn store(clock: &Clock, limits: LeaseLimits) -> (LeaseStore, Arc<Recording>) {
    let journal = Arc::new(Recording::default());
    (
        LeaseStore::new(clock.clone(), limits, journal.clone()),
        journal,
    )
}

/// A grant while an older term's write is still in flight is recorded as
/// not quiet (after a restart, the new term's writes wait).
async fn a_grant_over_an_older_write_is_not_quiet() -> Result<(), String> {
    let clock = Clock::manual(0);
    let (leases, journal) = store(&clock, LeaseLimits::default());
    let a = leases
        .acquire(&name("l"), &holder("A"), 1000, 0)
        .await
        .unwrap();
    let id = a.lease_id.expose().as_bytes().to_vec();
    let options = AdmitOptions::default();
    let Admission::Admitted(_write) =
        leases.try_admit_write("l", a.token, Some(&id), None, &options)
    else {
        return Err("term 1's write was not admitted".into());
    };
    clock.advance(1000);
    leases
        .acquire(&name("l"), &holder("B"), 1000, 0)
        .await
        .unwrap();
    let quiet: Vec<bool> = journal
        .grants
        .lock()
        .unwrap()
        .iter()
        .map(|g| g.quiet)
        .collect();
    match quiet.as_slice() {
        [true, false] => Ok(()),
        other => Err(format!(
            "grants recorded quiet: {other:?}, not [true, false]"
        )),
    }
}

/// A renewal whose record the journal dropped leaves the hint due: the
/// next renewal offers one again.
async fn a_dropped_renewal_hint_is_offered_again() -> Result<(), String> {
    let clock = Clock::manual(0);
    let (leases, journal) = store(&clock, LeaseLimits::default());
    let a = leases
        .acquire(&name("l"), &holder("A"), 1000, 0)
        .await
        .unwrap();
    let id = a.lease_id.expose().as_bytes().to_vec();
    // Half a TTL on (on the wall clock too), a hint is due: dropped.
    for at in [600, 650] {
        clock.advance(at - clock.now_ms());
        leases
            .renew("l", a.token, Some(&id), None, None)
            .map_err(|e| format!("{e:?}"))?;
    }
    match journal.renewals_offered.load(Ordering::SeqCst) {
        2 => Ok(()),
        n => Err(format!("{n} renewal records offered, not 2")),
    }
}

/// A full store makes room by forgetting a lease whose term ended, never
/// one whose term is live (50 ms left).
async fn room_is_never_made_from_a_live_term() -> Result<(), String> {
    let clock = Clock::manual(0);
    let limits = LeaseLimits {
        max_leases: 1,
        ..LeaseLimits::default()
    };
    let (leases, _) = store(&clock, limits);
    leases
        .acquire(&name("a"), &holder("A"), 1000, 0)
        .await
        .unwrap();
    clock.advance(950);
    match leases.acquire(&name("b"), &holder("B"), 1000, 0).await {
        Err(AcquireError::TooManyLeases { .. }) => Ok(()),
        other => Err(format!("a new name got {other:?} while a's term was live")),
    }
}

async fn check(mutant: Mutant) -> Result<(), String> {
    match mutant {
        Mutant::GrantQuietOverOlderWrites => a_grant_over_an_older_write_is_not_quiet().await,
        Mutant::HintKeptUntaken => a_dropped_renewal_hint_is_offered_again().await,
        Mutant::SweepEndsTermEarly => room_is_never_made_from_a_live_term().await,
        other => panic!("no store check for {}", other.name()),
    }
}

#[tokio::test]
async fn each_procedure_mutant_breaks_the_store() {
    for mutant in [
        Mutant::GrantQuietOverOlderWrites,
        Mutant::HintKeptUntaken,
        Mutant::SweepEndsTermEarly,
    ] {
        plant(None);
        check(mutant)
            .await
            .unwrap_or_else(|e| panic!("{} with nothing planted: {e}", mutant.name()));
        plant(Some(mutant));
        let planted = check(mutant).await;
        plant(None);
        match planted {
            Err(broken) => eprintln!("{}: {broken}", mutant.name()),
            Ok(()) => panic!(
                "{} planted, and the store's check still held",
                mutant.name()
            ),
        }
    }
}
