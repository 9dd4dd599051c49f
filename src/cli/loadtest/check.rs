//! The load test's checkers: they compare what the clients did with what the
//! storage applied (its apply log, [`check`]) or holds at the end (what
//! reads of every key the run wrote return, [`read_back`]). Pure: histories
//! in, findings out.

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
    /// The key it was written to (the `{key}` of `--path`): its write id, or
    /// a key consecutive terms share.
    #[serde(default)]
    pub key: String,
    pub token: u64,
    /// Sent after the writer's term had ended for certain: after the
    /// proxy's deadline by the writer's clock (a zombie after a pause, or a
    /// skewed writer past the real deadline), or after a newer term of the
    /// lease was granted.
    pub stale: bool,
    /// Sent after the run had been granted a newer term of the lease (the
    /// grant's answer arrived before this write left): its token was no
    /// longer current. See [`mark_superseded`].
    #[serde(default)]
    pub superseded: bool,
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
    /// Read-back: keys read at the end of the run, and reads that failed
    /// (the storage answered neither the value nor 404), which leave the
    /// run inconclusive.
    #[serde(default)]
    pub keys_read: u64,
    #[serde(default)]
    pub reads_failed: u64,
    /// Read-back: keys it did not read, because it stopped once the verdict
    /// could no longer change (see `readback::read_keys`); they leave the
    /// run inconclusive too.
    #[serde(default)]
    pub keys_not_read: u64,
    /// Read-back: keys that consecutive terms of a lease both write, and
    /// those whose final value came from a lower term than a write to it
    /// that was acknowledged (a stale write landed after a newer one), or
    /// from no write the run sent to it.
    #[serde(default)]
    pub shared_keys_checked: u64,
    #[serde(default)]
    pub shared_key_regressions: u64,
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
            + self.shared_key_regressions
    }

    /// The findings of several checkers of one run as one: the clients'
    /// figures (the same in each), the worst of each safety figure.
    pub fn merge(all: &[Findings]) -> Findings {
        let Some(first) = all.first() else {
            return Findings::default();
        };
        let mut f = first.clone();
        for other in &all[1..] {
            f.stale_writes_applied = f.stale_writes_applied.max(other.stale_writes_applied);
            f.acknowledged_missing = f.acknowledged_missing.max(other.acknowledged_missing);
            f.rejected_present = f.rejected_present.max(other.rejected_present);
            f.shared_key_regressions = f.shared_key_regressions.max(other.shared_key_regressions);
            f.unknown_in_log = f.unknown_in_log.max(other.unknown_in_log);
            f.keys_read = f.keys_read.max(other.keys_read);
            f.reads_failed = f.reads_failed.max(other.reads_failed);
            f.keys_not_read = f.keys_not_read.max(other.keys_not_read);
            f.shared_keys_checked = f.shared_keys_checked.max(other.shared_keys_checked);
            for e in &other.examples {
                example(&mut f.examples, e.clone());
            }
            for id in &other.stale_applied_ids {
                if !f.stale_applied_ids.contains(id) {
                    f.stale_applied_ids.push(id.clone());
                }
            }
        }
        f
    }
}

/// Marks every write sent after the run was granted a newer term of its
/// lease (`terms`: every grant the run saw): superseded, and so stale.
pub fn mark_superseded(writes: &mut [ClientWrite], terms: &[super::TermSpan]) {
    // Per lease, the grants in the order their answers arrived, with the
    // highest token granted so far.
    let mut grants: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for t in terms {
        grants
            .entry(t.lease.as_str())
            .or_default()
            .push((t.granted_us, t.token));
    }
    for list in grants.values_mut() {
        list.sort_unstable();
        let mut highest = 0;
        for (_, token) in list.iter_mut() {
            highest = highest.max(*token);
            *token = highest;
        }
    }
    for w in writes {
        let Some(list) = grants.get(w.lease.as_str()) else {
            continue;
        };
        // Grants answered before the write was sent.
        let before = list.partition_point(|&(at, _)| at < w.at_us);
        if before > 0 && list[before - 1].1 > w.token {
            w.superseded = true;
            w.stale = true;
        }
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
    let mut f = client_figures(writes);
    let by_id: HashMap<&str, &ClientWrite> =
        writes.iter().map(|w| (w.write_id.as_str(), w)).collect();

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

/// What a read of one key at the end of the run found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Read {
    /// 404: no such key.
    Absent,
    /// A value: the write id and token of the load test's value in it, or
    /// `None` if it holds none.
    Holds(Option<(String, u64)>),
    /// The storage answered neither (an error, no answer): unknown.
    Failed(String),
}

/// Checks what reads of every key the run wrote (`reads`, by key; a key
/// not in it was not read) found against the clients' `writes` (already
/// [`mark_superseded`]):
/// - a key of one write: an acknowledged write must be there, a refused
///   one must not, and a superseded one (sent after a newer term of its
///   lease was granted) that is there is a stale write applied;
/// - a key consecutive terms share: its final value must come from a write
///   sent to it, of a term no lower than any write to it that was
///   acknowledged (else a stale write landed after a newer one).
///
/// Writes of unknown outcome and failed writes may be there or not.
pub fn read_back(reads: &HashMap<String, Read>, writes: &[ClientWrite]) -> Findings {
    let mut f = client_figures(writes);
    let mut by_key: BTreeMap<&str, Vec<&ClientWrite>> = BTreeMap::new();
    for w in writes {
        by_key.entry(w.key.as_str()).or_default().push(w);
    }
    for (key, to_key) in by_key {
        match reads.get(key) {
            Some(read) => read_key(&mut f, key, &to_key, read),
            None => f.keys_not_read += 1,
        }
    }
    f
}

/// Whether what a read of `key` found proves a safety violation by itself
/// (`to_key`: every write the run sent to it): the read-back's verdict is
/// then UNSAFE whatever the other keys hold. The same checks as
/// [`read_back`].
pub fn read_proves_violation(key: &str, to_key: &[ClientWrite], read: &Read) -> bool {
    let to_key: Vec<&ClientWrite> = to_key.iter().collect();
    let mut f = Findings::default();
    read_key(&mut f, key, &to_key, read);
    f.violations() > 0
}

/// The checks of one key read back, which the writes `to_key` wrote.
fn read_key(f: &mut Findings, key: &str, to_key: &[&ClientWrite], read: &Read) {
    if let Read::Failed(_) = read {
        f.reads_failed += 1;
        return;
    }
    f.keys_read += 1;
    let found = match read {
        Read::Holds(Some((id, _))) => to_key.iter().find(|w| w.write_id == *id).copied(),
        _ => None,
    };
    if let [w] = to_key[..] {
        if w.key == w.write_id {
            one_write(f, w, read, found.is_some());
            return;
        }
    }
    shared_key(f, key, to_key, read, found);
}

/// The checks of a key only `w` wrote.
fn one_write(f: &mut Findings, w: &ClientWrite, read: &Read, holds_it: bool) {
    let present = matches!(read, Read::Holds(_));
    match &w.outcome {
        Outcome::Acknowledged if !holds_it => {
            f.acknowledged_missing += 1;
            let what = if present {
                "holds another value"
            } else {
                "is absent"
            };
            example(
                &mut f.examples,
                format!("acknowledged write {} missing: its key {what}", w.write_id),
            );
        }
        Outcome::Rejected(reason) if present => {
            f.rejected_present += 1;
            example(
                &mut f.examples,
                format!("rejected write present: {} ({reason})", w.write_id),
            );
        }
        _ => {}
    }
    if w.superseded && holds_it {
        stale_present(f, w);
    }
}

/// The checks of `key`, which the writes `to_key` of consecutive terms
/// wrote; `found` is the write whose value it holds.
fn shared_key(
    f: &mut Findings,
    key: &str,
    to_key: &[&ClientWrite],
    read: &Read,
    found: Option<&ClientWrite>,
) {
    f.shared_keys_checked += 1;
    let acked = to_key
        .iter()
        .filter(|w| w.outcome == Outcome::Acknowledged)
        .map(|w| w.token)
        .max();
    match (read, found) {
        (Read::Absent, _) => {
            if acked.is_some() {
                f.acknowledged_missing += 1;
                example(
                    &mut f.examples,
                    format!("shared key {key} is absent after acknowledged writes"),
                );
            }
        }
        (_, None) => {
            f.shared_key_regressions += 1;
            example(
                &mut f.examples,
                format!("shared key {key} holds a value no write to it sent"),
            );
        }
        (_, Some(w)) => {
            if let Some(newest) = acked.filter(|&t| w.token < t) {
                f.shared_key_regressions += 1;
                example(
                    &mut f.examples,
                    format!(
                        "shared key {key} ends with {} of token {}, after a write of token {newest} was acknowledged",
                        w.write_id, w.token
                    ),
                );
            }
            if let Outcome::Rejected(reason) = &w.outcome {
                f.rejected_present += 1;
                example(
                    &mut f.examples,
                    format!("rejected write present: {} ({reason})", w.write_id),
                );
            }
            if w.superseded {
                stale_present(f, w);
            }
        }
    }
}

fn stale_present(f: &mut Findings, w: &ClientWrite) {
    f.stale_writes_applied += 1;
    f.stale_applied_ids.push(w.write_id.clone());
    example(
        &mut f.examples,
        format!(
            "stale write applied: {} by {} with token {}, sent after a newer term of lease {} was granted",
            w.write_id, w.writer, w.token, w.lease
        ),
    );
}

/// What the clients saw: writes attempted, acknowledged, rejected (by
/// reason), of unknown outcome, failed, and stale attempts.
fn client_figures(writes: &[ClientWrite]) -> Findings {
    let mut f = Findings {
        writes_attempted: writes.len() as u64,
        ..Findings::default()
    };
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
            granted_us: 0,
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
            key: id.into(),
            token,
            stale,
            superseded: false,
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

    fn on(key: &str, w: ClientWrite) -> ClientWrite {
        ClientWrite {
            key: key.into(),
            ..w
        }
    }

    fn holds(id: &str, token: u64) -> Read {
        Read::Holds(Some((id.into(), token)))
    }

    fn reads(list: &[(&str, Read)]) -> HashMap<String, Read> {
        list.iter()
            .map(|(k, r)| ((*k).to_owned(), r.clone()))
            .collect()
    }

    #[test]
    fn a_clean_read_back_has_no_violations() {
        let unknown = Outcome::Unknown("upstream-error".into());
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("a2", "l", 1, true, rejected("lease-expired")),
            write("a3", "l", 1, false, unknown.clone()),
            write("a4", "l", 1, false, unknown),
            on("h1", write("a5", "l", 1, false, Outcome::Acknowledged)),
            on("h1", write("b1", "l", 2, false, Outcome::Acknowledged)),
            on("h1", write("b2", "l", 2, false, Outcome::Acknowledged)),
        ];
        let r = reads(&[
            ("a1", holds("a1", 1)),
            ("a2", Read::Absent),
            ("a3", holds("a3", 1)),
            ("a4", Read::Absent),
            ("h1", holds("b1", 2)),
        ]);
        let f = read_back(&r, &writes);
        assert_eq!(f.violations(), 0, "{f:?}");
        assert_eq!(
            (f.keys_read, f.reads_failed, f.shared_keys_checked),
            (5, 0, 1)
        );
        assert_eq!((f.acknowledged, f.rejected, f.outcome_unknown), (4, 1, 2));
    }

    #[test]
    fn read_back_finds_lost_acknowledgements_and_refused_writes_that_landed() {
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("a2", "l", 1, false, Outcome::Acknowledged),
            write("x1", "l", 1, true, rejected("lease-expired")),
            write("f1", "l", 1, false, Outcome::Failed("reset".into())),
        ];
        let r = reads(&[
            ("a1", Read::Absent),
            ("a2", Read::Holds(None)),
            ("x1", holds("x1", 1)),
            ("f1", Read::Failed("503".into())),
        ]);
        let f = read_back(&r, &writes);
        assert_eq!((f.acknowledged_missing, f.rejected_present), (2, 1));
        assert_eq!((f.keys_read, f.reads_failed), (3, 1));
        assert_eq!(f.violations(), 3);
    }

    /// A key the read-back did not get to is not read, not failed; a key
    /// whose read proves a violation is told apart, as the read-back
    /// needs to stop once one does.
    #[test]
    fn keys_not_read_are_counted_and_a_read_can_prove_a_violation() {
        let writes = [
            write("a1", "l", 1, false, Outcome::Acknowledged),
            write("a2", "l", 1, false, Outcome::Acknowledged),
            write("x1", "l", 1, true, rejected("lease-expired")),
        ];
        let r = reads(&[
            ("a1", holds("a1", 1)),
            ("x1", Read::Failed("no answer".into())),
        ]);
        let f = read_back(&r, &writes);
        assert_eq!((f.keys_read, f.reads_failed, f.keys_not_read), (1, 1, 1));
        assert_eq!(f.violations(), 0, "{f:?}");
        assert!(!read_proves_violation("a1", &writes[..1], &holds("a1", 1)));
        assert!(read_proves_violation("a2", &writes[1..2], &Read::Absent));
        assert!(read_proves_violation("x1", &writes[2..], &holds("x1", 1)));
        assert!(!read_proves_violation(
            "x1",
            &writes[2..],
            &Read::Failed("503".into())
        ));
    }

    #[test]
    fn a_superseded_write_that_landed_is_a_stale_write_applied() {
        let span = |token, granted_us| crate::cli::loadtest::TermSpan {
            lease: "l".into(),
            writer: "w".into(),
            token,
            from_ms: 0,
            until_ms: 1,
            granted_us,
        };
        let mut writes = [
            ClientWrite {
                at_us: 50,
                ..write("z0", "l", 1, false, Outcome::Acknowledged)
            },
            ClientWrite {
                at_us: 150,
                ..write("z1", "l", 1, false, Outcome::Acknowledged)
            },
            ClientWrite {
                at_us: 160,
                ..write("z2", "l", 1, false, Outcome::Acknowledged)
            },
            ClientWrite {
                at_us: 170,
                ..write("b1", "l", 2, false, Outcome::Acknowledged)
            },
        ];
        mark_superseded(&mut writes, &[span(1, 10), span(2, 100)]);
        let marked: Vec<bool> = writes.iter().map(|w| w.superseded).collect();
        assert_eq!(marked, [false, true, true, false]);
        assert!(writes[1].stale);
        // z1 landed; z2 did not (refused, or lost: either way not stale).
        let r = reads(&[
            ("z0", holds("z0", 1)),
            ("z1", holds("z1", 1)),
            ("z2", Read::Absent),
            ("b1", holds("b1", 2)),
        ]);
        writes[2].outcome = rejected("stale-fencing-token");
        let f = read_back(&r, &writes);
        assert_eq!(f.stale_writes_applied, 1, "{f:?}");
        assert_eq!(f.stale_applied_ids, ["z1"]);
        assert_eq!(f.violations(), 1);
    }

    #[test]
    fn a_shared_key_must_end_with_the_newest_acknowledged_term() {
        let unknown = Outcome::Unknown("upstream-timeout".into());
        let writes = [
            on("h1", write("a1", "l", 1, false, Outcome::Acknowledged)),
            on("h1", write("b1", "l", 2, false, Outcome::Acknowledged)),
            on("h2", write("b2", "l", 2, false, Outcome::Acknowledged)),
            on("h2", write("c1", "l", 3, false, unknown)),
            on("h3", write("c2", "l", 3, false, Outcome::Acknowledged)),
            on("h4", write("d1", "l", 4, false, Outcome::Acknowledged)),
        ];
        let r = reads(&[
            // Term 1's write landed after term 2's: out of order.
            ("h1", holds("a1", 1)),
            // A newer write of unknown outcome may be the last: fine.
            ("h2", holds("c1", 3)),
            // Gone after an acknowledged write; and a value never sent to it.
            ("h3", Read::Absent),
            ("h4", holds("a1", 1)),
        ]);
        let f = read_back(&r, &writes);
        assert_eq!(f.shared_keys_checked, 4);
        assert_eq!(
            (f.shared_key_regressions, f.acknowledged_missing),
            (2, 1),
            "{f:?}"
        );
        assert_eq!(f.violations(), 3);
    }

    #[test]
    fn merged_findings_keep_the_worst_of_each_checker() {
        let a = Findings {
            writes_attempted: 10,
            stale_writes_applied: 2,
            stale_applied_ids: vec!["x".into(), "y".into()],
            ..Findings::default()
        };
        let b = Findings {
            writes_attempted: 10,
            stale_writes_applied: 1,
            shared_key_regressions: 1,
            stale_applied_ids: vec!["y".into(), "z".into()],
            ..Findings::default()
        };
        let f = Findings::merge(&[a, b]);
        assert_eq!((f.writes_attempted, f.stale_writes_applied), (10, 2));
        assert_eq!(f.shared_key_regressions, 1);
        assert_eq!(f.stale_applied_ids, ["x", "y", "z"]);
        assert_eq!(f.violations(), 3);
    }
}
