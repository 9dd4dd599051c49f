//! The load test's checker: compares what the clients did with what the
//! storage applied. Pure: histories in, report out.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::backend::embedded::Applied;

/// How one write ended, as its client saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum Outcome {
    /// 2xx: the storage (through the proxy) acknowledged it.
    Acknowledged,
    /// Refused with a problem document's `reason`: it must not be applied.
    Rejected(String),
    /// The proxy could not tell whether the storage applied it (`502
    /// upstream-error`, `504 upstream-timeout`: a backend fault): applied or
    /// not, both are fine.
    Unknown(String),
    /// No answer (connection failed) or an unexpected status.
    Failed(String),
}

/// The problem reasons whose writes may or may not have been applied.
pub const OUTCOME_UNKNOWN_REASONS: [&str; 2] = ["upstream-error", "upstream-timeout"];

/// One write a client sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientWrite {
    pub writer: String,
    pub write_id: String,
    pub lease: String,
    pub token: u64,
    /// Sent after the writer's term had ended (a zombie after a pause, or a
    /// skewed writer past the real deadline).
    pub stale: bool,
    pub outcome: Outcome,
    pub latency_us: u64,
    /// When it was sent, in microseconds since the run started.
    #[serde(default)]
    pub at_us: u64,
}

/// What the checker found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Findings {
    pub writes_attempted: u64,
    pub acknowledged: u64,
    pub rejected: u64,
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Answered with a backend fault: applied or not, both fine.
    pub outcome_unknown: u64,
    pub outcome_unknown_by_reason: BTreeMap<String, u64>,
    pub failed: u64,
    pub stale_attempts: u64,
    pub stale_attempts_rejected: u64,
    /// Writes the storage applied with a token lower than one it had already
    /// applied for the same lease (an older term after a newer term).
    pub stale_writes_applied: u64,
    /// Acknowledged writes the storage has no record of.
    pub acknowledged_missing: u64,
    /// Rejected writes the storage applied anyway.
    pub rejected_present: u64,
    /// Writes in the storage's log that no client of this run sent.
    pub unknown_in_log: u64,
    /// Grants of a token this run had been granted before for the same
    /// lease.
    #[serde(default)]
    pub tokens_issued_twice: u64,
    /// The first few violations, for people.
    pub examples: Vec<String>,
    /// The write ids of every stale write applied, for the HTML report.
    #[serde(skip)]
    pub stale_applied_ids: Vec<String>,
}

impl Findings {
    /// The safety figures that must all be zero.
    pub fn violations(&self) -> u64 {
        self.stale_writes_applied
            + self.acknowledged_missing
            + self.rejected_present
            + self.tokens_issued_twice
    }
}

/// Counts the grants of a token the run had been granted before for the
/// same lease (a token is issued once, ever).
pub fn issued_twice(f: &mut Findings, terms: &[super::TermSpan]) {
    let mut seen: HashSet<(&str, u64)> = HashSet::new();
    for t in terms {
        if !seen.insert((t.lease.as_str(), t.token)) {
            f.tokens_issued_twice += 1;
            example(
                &mut f.examples,
                format!(
                    "token {} of lease {} issued twice (again to {})",
                    t.token, t.lease, t.writer
                ),
            );
        }
    }
}

/// Checks the storage's apply `log` (already filtered to this run, in apply
/// order) against the clients' `writes`.
pub fn check(log: &[Applied], writes: &[ClientWrite]) -> Findings {
    let mut f = Findings {
        writes_attempted: writes.len() as u64,
        ..Findings::default()
    };
    let by_id: HashMap<&str, &ClientWrite> =
        writes.iter().map(|w| (w.write_id.as_str(), w)).collect();
    for w in writes {
        match &w.outcome {
            Outcome::Acknowledged => f.acknowledged += 1,
            Outcome::Rejected(reason) => {
                f.rejected += 1;
                *f.rejected_by_reason.entry(reason.clone()).or_default() += 1;
            }
            Outcome::Unknown(reason) => {
                f.outcome_unknown += 1;
                *f.outcome_unknown_by_reason
                    .entry(reason.clone())
                    .or_default() += 1;
            }
            Outcome::Failed(_) => f.failed += 1,
        }
        if w.stale {
            f.stale_attempts += 1;
            if matches!(w.outcome, Outcome::Rejected(_)) {
                f.stale_attempts_rejected += 1;
            }
        }
    }

    let mut newest_by_lease: HashMap<&str, u64> = HashMap::new();
    let mut applied: HashSet<&str> = HashSet::new();
    for entry in log {
        let Some(write) = entry.write_id.as_deref().and_then(|id| by_id.get(id)) else {
            f.unknown_in_log += 1;
            continue;
        };
        applied.insert(write.write_id.as_str());
        let token = entry.token.unwrap_or(0);
        let newest = newest_by_lease.entry(write.lease.as_str()).or_insert(0);
        if token < *newest {
            f.stale_writes_applied += 1;
            f.stale_applied_ids.push(write.write_id.clone());
            example(
                &mut f.examples,
                format!(
                    "stale write applied: {} by {} with token {token} after token {} on lease {} (log seq {})",
                    write.write_id, write.writer, *newest, write.lease, entry.seq
                ),
            );
        }
        *newest = (*newest).max(token);
        if matches!(write.outcome, Outcome::Rejected(_)) {
            f.rejected_present += 1;
            example(
                &mut f.examples,
                format!(
                    "rejected write applied: {} (log seq {})",
                    write.write_id, entry.seq
                ),
            );
        }
    }
    for w in writes {
        if w.outcome == Outcome::Acknowledged && !applied.contains(w.write_id.as_str()) {
            f.acknowledged_missing += 1;
            example(
                &mut f.examples,
                format!("acknowledged write missing from the log: {}", w.write_id),
            );
        }
    }
    f
}

fn example(examples: &mut Vec<String>, text: String) {
    if examples.len() < 10 {
        examples.push(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_granted_twice_is_a_violation() {
        let span = |lease: &str, token| crate::cli::loadtest::TermSpan {
            lease: lease.into(),
            writer: "w".into(),
            token,
            from_ms: 0,
            until_ms: 1,
        };
        let mut f = Findings::default();
        issued_twice(&mut f, &[span("a", 1), span("b", 1), span("a", 2)]);
        assert_eq!(f.violations(), 0);
        issued_twice(&mut f, &[span("a", 1), span("a", 2), span("a", 1)]);
        assert_eq!((f.tokens_issued_twice, f.violations()), (1, 1));
    }

    fn write(id: &str, lease: &str, token: u64, stale: bool, outcome: Outcome) -> ClientWrite {
        ClientWrite {
            writer: "w".into(),
            write_id: id.into(),
            lease: lease.into(),
            token,
            stale,
            outcome,
            latency_us: 100,
            at_us: 0,
        }
    }

    fn applied(seq: u64, id: &str, token: u64) -> Applied {
        Applied {
            seq,
            method: "PUT".into(),
            key: "/kv/l/k".into(),
            token: Some(token),
            writer: Some("w".into()),
            write_id: Some(id.into()),
        }
    }

    fn rejected(reason: &str) -> Outcome {
        Outcome::Rejected(reason.into())
    }

    #[test]
    fn a_clean_history_has_no_violations() {
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("a2", "l", 1, true, rejected("lease-expired")),
            write("b1", "l", 2, false, Outcome::Acknowledged),
            write("z1", "l", 1, true, rejected("stale-fencing-token")),
            write("c1", "m", 1, false, Outcome::Acknowledged),
        ];
        let log = [
            applied(1, "a1", 1),
            applied(2, "c1", 1),
            applied(3, "b1", 2),
        ];
        let f = check(&log, &writes);
        assert_eq!(f.violations(), 0, "{f:?}");
        assert_eq!((f.writes_attempted, f.acknowledged, f.rejected), (5, 3, 2));
        assert_eq!((f.stale_attempts, f.stale_attempts_rejected), (2, 2));
        assert_eq!(f.rejected_by_reason["stale-fencing-token"], 1);
    }

    #[test]
    fn an_older_term_applied_after_a_newer_one_is_a_stale_write() {
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("b1", "l", 2, false, Outcome::Acknowledged),
            write("z1", "l", 1, true, Outcome::Acknowledged),
            // Another lease's lower token is not stale.
            write("m1", "m", 1, false, Outcome::Acknowledged),
        ];
        let log = [
            applied(1, "a1", 1),
            applied(2, "b1", 2),
            applied(3, "z1", 1),
            applied(4, "m1", 1),
        ];
        let f = check(&log, &writes);
        assert_eq!(f.stale_writes_applied, 1);
        assert_eq!(f.violations(), 1);
        assert!(f.examples[0].contains("z1"));
    }

    #[test]
    fn a_zombie_write_before_the_new_term_writes_is_not_applied_stale() {
        // The zombie was not refused (no proxy) but landed before any newer
        // write: the order of terms at the storage is intact.
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("z1", "l", 1, true, Outcome::Acknowledged),
            write("b1", "l", 2, false, Outcome::Acknowledged),
        ];
        let log = [
            applied(1, "a1", 1),
            applied(2, "z1", 1),
            applied(3, "b1", 2),
        ];
        assert_eq!(check(&log, &writes).stale_writes_applied, 0);
    }

    /// Seen failing when every answer with a reason counted as rejected: a
    /// write answered 502 that the backend had applied was reported as
    /// "rejected but applied".
    #[test]
    fn backend_faults_are_outcome_unknown_and_fine_either_way() {
        let unknown = |reason: &str| Outcome::Unknown(reason.into());
        let writes = [
            write("a1", "l", 1, false, unknown("upstream-error")),
            write("a2", "l", 1, false, unknown("upstream-timeout")),
            write("a3", "l", 1, false, Outcome::Acknowledged),
        ];
        let log = [applied(1, "a1", 1), applied(2, "a3", 1)];
        let f = check(&log, &writes);
        assert_eq!(f.violations(), 0, "{f:?}");
        assert_eq!((f.outcome_unknown, f.rejected), (2, 0));
        assert_eq!(f.outcome_unknown_by_reason["upstream-error"], 1);
    }

    #[test]
    fn lost_acknowledgements_and_applied_rejections_are_found() {
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("a2", "l", 1, false, Outcome::Acknowledged),
            write("x1", "l", 1, true, rejected("lease-expired")),
            write(
                "f1",
                "l",
                1,
                false,
                Outcome::Failed("connection reset".into()),
            ),
        ];
        let log = [
            applied(1, "a1", 1),
            applied(2, "x1", 1),
            applied(3, "other-run", 9),
        ];
        let f = check(&log, &writes);
        assert_eq!(
            (f.acknowledged_missing, f.rejected_present, f.unknown_in_log),
            (1, 1, 1)
        );
        assert_eq!(f.failed, 1);
        assert_eq!(f.violations(), 2);
    }
}
