//! The summary table people read at the end of a run (the HTML report
//! shows it too).

use super::check::Findings;
use super::{store, LateWrites, Report, READ_BACK};

/// Which checkers ran, for people.
pub fn checkers(r: &Report) -> String {
    let names: Vec<&str> = r
        .verify
        .iter()
        .map(|name| match *name {
            super::HISTORY => "the storage's apply log",
            _ => "reading back every key",
        })
        .collect();
    names.join(" and ")
}

/// The summary: what the run was, a row per figure, the violations found
/// and the verdict.
pub fn summary(r: &Report) -> String {
    let via = match &r.direct {
        Some(d) => format!("straight to {d} (no fencing)"),
        None => format!("through {}", r.target),
    };
    let mut out = format!(
        "fencegate loadtest {}: {} writers, {} leases, ttl {} ms, pause p={} ({} ms), skew {} ms, seed {}\n\
         writes {via} to {}, checked by {}\n",
        r.run_id,
        r.writers,
        r.leases,
        r.ttl_ms,
        r.pause_prob,
        r.pause_ms,
        r.skew_ms,
        r.seed,
        r.path,
        checkers(r)
    );
    let mut rows = write_rows(r);
    if r.by_checker.contains_key(READ_BACK) {
        // Before latency and throughput.
        let at = rows.len() - 2;
        rows.splice(at..at, read_back_rows(r));
    }
    rows.push(("keys cleaned up", cleanup(r)));
    if let Some(late) = &r.late_writes {
        rows.extend(late_rows(late));
    }
    for (k, v) in rows {
        out.push_str(&format!("  {k:<26}{v}\n"));
    }
    for e in &r.findings.examples {
        out.push_str(&format!("  ! {e}\n"));
    }
    out.push_str(&r.verdict);
    out.push('\n');
    out
}

/// `total`, with its parts by reason if there are any.
fn with_reasons<'a>(total: u64, reasons: impl Iterator<Item = (&'a String, &'a u64)>) -> String {
    let parts: Vec<String> = reasons.map(|(k, v)| format!("{k} {v}")).collect();
    if parts.is_empty() {
        total.to_string()
    } else {
        format!("{total} ({})", parts.join(", "))
    }
}

/// What became of the writes, the safety figures, latency and throughput.
fn write_rows(r: &Report) -> Vec<(&'static str, String)> {
    let f = &r.findings;
    let ms = |us: u64| us as f64 / 1000.0;
    // A safety figure, with each checker's own when they differ.
    let safety = |figure: fn(&Findings) -> u64| {
        let values: Vec<u64> = r.by_checker.values().map(figure).collect();
        if values.windows(2).all(|w| w[0] == w[1]) {
            return figure(f).to_string();
        }
        let each: Vec<String> = r
            .by_checker
            .iter()
            .map(|(name, f)| format!("{name} {}", figure(f)))
            .collect();
        format!("{} ({})", figure(f), each.join(", "))
    };
    vec![
        (
            "writes attempted",
            match &r.writes_stopped {
                Some(why) => format!("{} (stopped once {why})", f.writes_attempted),
                None => f.writes_attempted.to_string(),
            },
        ),
        ("acknowledged", f.acknowledged.to_string()),
        (
            "rejected",
            with_reasons(f.rejected, f.rejected_by_reason.iter()),
        ),
        (
            "outcome unknown",
            with_reasons(f.outcome_unknown, f.outcome_unknown_by_reason.iter()),
        ),
        ("failed (no answer)", f.failed.to_string()),
        (
            "stale attempts",
            format!(
                "{} ({} rejected)",
                f.stale_attempts, f.stale_attempts_rejected
            ),
        ),
        ("stale writes applied", safety(|f| f.stale_writes_applied)),
        ("acked writes missing", safety(|f| f.acknowledged_missing)),
        ("rejected but applied", safety(|f| f.rejected_present)),
        ("tokens issued twice", f.tokens_issued_twice.to_string()),
        (
            "latency p50/p99/p99.9",
            format!(
                "{:.2} / {:.2} / {:.2} ms",
                ms(r.latency_us["p50"]),
                ms(r.latency_us["p99"]),
                ms(r.latency_us["p99.9"])
            ),
        ),
        (
            "throughput",
            format!(
                "{:.0} writes/s over {:.1} s",
                r.throughput_per_s,
                r.duration_ms as f64 / 1000.0
            ),
        ),
    ]
}

/// What the read-back found of the keys shared by terms, and how many
/// keys it read.
fn read_back_rows(r: &Report) -> Vec<(&'static str, String)> {
    let f = &r.findings;
    let stopped = match (&r.read_back_stopped, f.keys_not_read) {
        (_, 0) => String::new(),
        (Some(why), left) => format!(", {left} not read: stopped once {why}"),
        (None, left) => format!(", {left} not read"),
    };
    vec![
        (
            "shared keys out of order",
            format!("{} of {}", f.shared_key_regressions, f.shared_keys_checked),
        ),
        (
            "keys read back",
            format!("{} ({} failed{stopped})", f.keys_read, f.reads_failed),
        ),
    ]
}

/// What the cleanup did.
fn cleanup(r: &Report) -> String {
    match &r.cleanup {
        None if r.store == store::Store::DynamoDb && r.direct.is_none() => {
            "none: fencegate refuses DeleteItem (the run's items are left in the table)".to_owned()
        }
        None => "none (--keep)".to_owned(),
        Some(c) if c.failed == 0 => c.deleted.to_string(),
        Some(c) => format!(
            "{} ({} failed: {})",
            c.deleted,
            c.failed,
            c.error.as_deref().unwrap_or("")
        ),
    }
}

/// What the relay of `--late-writes` saw, and what the probe found.
fn late_rows(late: &LateWrites) -> Vec<(&'static str, String)> {
    let relay = &late.relay;
    let (without, of) = (relay.writes_without_precondition, relay.writes);
    vec![
        (
            "late writes (relay)",
            format!(
                "{} held {} ms; {} arrived after a later term's write to their key: {} refused by the storage, {} applied",
                relay.late_writes,
                late.late_by_ms,
                relay.late_stale,
                relay.late_stale_refused,
                relay.late_stale_applied
            ),
        ),
        (
            "writes w/o precondition",
            match late.store {
                store::Store::Http => format!(
                    "{without} of {of} reached the storage with neither If-Match nor If-None-Match"
                ),
                store::Store::EtcdV3 => {
                    format!("{without} of {of} reached etcd without their fence key's comparison")
                }
                store::Store::DynamoDb => format!(
                    "{without} of {of} reached DynamoDB without the condition on their item's token"
                ),
            },
        ),
        (
            "storage preconditions",
            match late.storage_evaluates_if_match {
                Some(true) => format!("evaluated: {}", late.probe),
                Some(false) => format!("IGNORED: {}", late.probe),
                None => format!("unknown: {}", late.probe),
            },
        ),
    ]
}
