//! The simulator in `cargo test`: as many seeds as fit in the time budget
//! (`FENCEGATE_SIM_SECONDS`, default 120), from seed 1 on (odd seeds
//! standalone, even seeds a cluster of three), so a run is the same on
//! every machine but for how far it gets; any failure prints the command
//! that replays it exactly. Longer searches: the `simulate`
//! example (`--seconds`).

use std::time::{Duration, Instant};

use fencegate_sim::{run, Config};

const STEPS: u64 = 20_000;

#[test]
fn seeds_hold_every_guarantee() {
    let seconds = std::env::var("FENCEGATE_SIM_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let budget = Duration::from_secs(seconds);
    // The test's time budget, not the simulation's: the world runs on its
    // own clock and never reads this one.
    #[allow(clippy::disallowed_methods)]
    let started = Instant::now();
    let (mut seeds, mut steps) = (0u64, 0u64);
    let mut totals = fencegate_sim::Stats::default();
    // At least a few dozen seeds, both kinds, whatever the budget.
    while started.elapsed() < budget || seeds < 40 {
        let seed = seeds + 1;
        let report = run(&Config::new(seed, STEPS));
        if let Some(v) = report.violation {
            panic!(
                "seed {seed}, step {}, at {} ms: {}\nreplay: cargo run --release -p \
                 fencegate-sim --example simulate -- --seed {seed} --steps {STEPS}",
                v.step, v.at_ms, v.what
            );
        }
        seeds += 1;
        steps += report.steps;
        add(&mut totals, &report.stats);
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "simulator: {seeds} seeds, {steps} steps in {secs:.0} s ({:.0} steps/s); {} crashes \
         ({} during a start), {} of them power cuts ({} torn writes), {} damaged logs, {} failed syncs, {} grants, \
         {} writes applied, {} leases forgotten, {} lazy records dropped by a full queue, {} stale or late writes refused, {} barrier waits, {} rogue \
         writes left out; cluster mode: {} takeovers, {} stops, {} pauses, {} members cut off from \
         etcd, {} step-downs, {} clean handovers ({} found clean by the next primary); \
         preconditions: {} writes answered 428, {} key reads, {} \
         preconditions refused, {} of them late writes of an old term, {} returned states let \
         through",
        steps as f64 / secs,
        totals.crashes,
        totals.start_crashes,
        totals.power_cuts,
        totals.torn_writes,
        totals.damaged_logs,
        totals.failed_syncs,
        totals.grants,
        totals.writes_applied,
        totals.forgotten,
        totals.lazy_records_dropped,
        totals.writes_refused,
        totals.barrier_waits,
        totals.rogue_writes,
        totals.takeovers,
        totals.stops,
        totals.pauses,
        totals.partitions,
        totals.step_downs,
        totals.clean_handovers,
        totals.clean_takeovers,
        totals.preconditions_required,
        totals.key_reads,
        totals.preconditions_refused,
        totals.late_stale_refused,
        totals.returned_states,
    );
    // The world did go wrong: a run that never crashed would prove little.
    assert!(totals.power_cuts > 0 && totals.damaged_logs > 0 && totals.failed_syncs > 0);
    assert!(totals.start_crashes > 0 && totals.forgotten > 0);
    assert!(totals.lazy_records_dropped > 0);
    assert!(totals.barrier_waits > 0 && totals.rogue_writes > 0);
    assert!(totals.takeovers > 0 && totals.pauses > 0 && totals.partitions > 0);
    assert!(totals.clean_takeovers > 0 && totals.clean_takeovers < totals.takeovers);
    // The storage refused late writes of old terms, and both kinds of tag
    // were played.
    assert!(totals.late_stale_refused > 0 && totals.preconditions_required > 0);
    assert!(totals.returned_states > 0);
}

fn add(totals: &mut fencegate_sim::Stats, s: &fencegate_sim::Stats) {
    totals.grants += s.grants;
    totals.writes_applied += s.writes_applied;
    totals.forgotten += s.forgotten;
    totals.lazy_records_dropped += s.lazy_records_dropped;
    totals.writes_refused += s.writes_refused;
    totals.barrier_waits += s.barrier_waits;
    totals.rogue_writes += s.rogue_writes;
    totals.crashes += s.crashes;
    totals.start_crashes += s.start_crashes;
    totals.power_cuts += s.power_cuts;
    totals.torn_writes += s.torn_writes;
    totals.damaged_logs += s.damaged_logs;
    totals.failed_syncs += s.failed_syncs;
    totals.takeovers += s.takeovers;
    totals.pauses += s.pauses;
    totals.partitions += s.partitions;
    totals.step_downs += s.step_downs;
    totals.stops += s.stops;
    totals.clean_handovers += s.clean_handovers;
    totals.clean_takeovers += s.clean_takeovers;
    totals.preconditions_required += s.preconditions_required;
    totals.key_reads += s.key_reads;
    totals.preconditions_refused += s.preconditions_refused;
    totals.late_stale_refused += s.late_stale_refused;
    totals.returned_states += s.returned_states;
}
