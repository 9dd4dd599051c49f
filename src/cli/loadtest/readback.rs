//! After the run: reading back every key it wrote (bounded concurrency,
//! with progress on a terminal) until the verdict can no longer change,
//! and deleting the run's keys.
//!
//! Both are bounded once the storage stops answering: the read-back stops
//! one `--request-timeout` after the verdict was settled (see
//! [`read_keys`]), and the cleanup one `--request-timeout` after a request
//! of the run first got no answer (or after it began, if later).

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde::Serialize;
use serde_json::json;

use super::check::{self, ClientWrite, Read};
use super::store::ReadAnswer;
use super::{call, LoadtestError, Shared, To};
use crate::clock::Stopwatch;
use crate::wire::{FENCING_LEASE_ID, FENCING_TOKEN};

/// Tries per read before it counts as failed, when the storage answers
/// with an error (or the connection fails); a read that got no answer
/// within `--request-timeout` is not tried again.
const READ_TRIES: u32 = 3;

/// Why the read-back stopped: a request of the run got no answer within
/// `--request-timeout` (the run can no longer pass).
pub(super) const NO_ANSWER: &str = "a request got no answer";
/// Why the read-back stopped: a key could not be read (the run can no
/// longer pass).
pub(super) const KEY_UNREAD: &str = "a key could not be read";
/// Why the read-back stopped: a safety violation was proven (the verdict
/// is UNSAFE).
pub(super) const VIOLATION_FOUND: &str = "a safety violation was found";

/// Every key the run tried to write, once: `(lease, key)`.
fn keys(writes: &[ClientWrite]) -> Vec<(String, String)> {
    let mut keys: Vec<(String, String)> = writes
        .iter()
        .map(|w| (w.lease.clone(), w.key.clone()))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Where the keys are read: `--read-from`, else `--direct`, else through
/// the target.
fn read_url(shared: &Shared, path: String) -> To {
    match shared
        .args
        .read_from
        .as_ref()
        .or(shared.args.direct.as_ref())
    {
        Some(base) => To::Url(format!("{base}{path}")),
        None => To::Target(path),
    }
}

/// What reading back found.
pub(super) struct ReadBack {
    /// What each key read holds, by key; a key not in it was not read.
    pub reads: HashMap<String, Read>,
    /// Why it stopped before reading every key (`None`: it read them all).
    pub stopped: Option<&'static str>,
}

/// A key to read, and every write the run sent to it.
struct ToRead {
    lease: String,
    key: String,
    writes: Vec<ClientWrite>,
}

/// The read-back's clock: when it began, and when (and why) its verdict
/// was settled, in milliseconds since the run started.
struct Reading {
    began_ms: u64,
    settled: OnceLock<(u64, &'static str)>,
}

impl Reading {
    /// Notes that the verdict is settled, and why (the first reason wins).
    fn settle(&self, shared: &Shared, why: &'static str) {
        let _ = self.settled.set((shared.started.elapsed_ms(), why));
    }

    /// When the verdict was settled, and why: by what the read-back found,
    /// or by a request of the run (a write, a read) that got no answer.
    fn settled(&self, shared: &Shared) -> Option<(u64, &'static str)> {
        let unanswered = shared.unanswered_since_ms().map(|ms| (ms, NO_ANSWER));
        // On a tie (the read that got no answer), the request says more.
        [unanswered, self.settled.get().copied()]
            .into_iter()
            .flatten()
            .min_by_key(|&(ms, _)| ms)
    }

    /// What is left of the read-back: `None` (no bound) while the verdict
    /// can still change.
    fn time_left(&self, shared: &Shared) -> Option<Duration> {
        shared.time_left(self.began_ms, self.settled(shared).map(|(ms, _)| ms))
    }
}

/// Reads every key the run tried to write, `--read-concurrency` at a time,
/// until the verdict can no longer change.
///
/// Settled means: a safety violation is proven (`proven` before a key is
/// read, or a key's read proves one: UNSAFE whatever the rest hold), or the
/// run can no longer pass for want of answers (a key could not be read, or
/// a request of the run got no answer within `--request-timeout`: at best
/// INCONCLUSIVE, and only more violations could still change that). From
/// then on the read-back has one more `--request-timeout` (counted from
/// when it began, if it was settled before): what answers in that time
/// still counts, and a read in flight at its end is abandoned. The keys it
/// did not read are left out of the answer (the checker counts them as not
/// read). While every read is answered in time and nothing is proven, every
/// key is read.
pub(super) async fn read_keys(
    shared: &Arc<Shared>,
    writes: &[ClientWrite],
    proven: Option<&'static str>,
) -> ReadBack {
    let mut to_key: BTreeMap<(String, String), Vec<ClientWrite>> = BTreeMap::new();
    for w in writes {
        let at = (w.lease.clone(), w.key.clone());
        to_key.entry(at).or_default().push(w.clone());
    }
    let keys: Arc<Vec<ToRead>> = Arc::new(
        to_key
            .into_iter()
            .map(|((lease, key), writes)| ToRead { lease, key, writes })
            .collect(),
    );
    let reading = Arc::new(Reading {
        began_ms: shared.started.elapsed_ms(),
        settled: OnceLock::new(),
    });
    if let Some(why) = proven {
        reading.settle(shared, why);
    }
    let next = Arc::new(AtomicUsize::new(0));
    let watch = Stopwatch::start();
    let bar = tokio::spawn(progress(next.clone(), keys.len()));
    let readers: Vec<_> = (0..shared.args.read_concurrency.max(1))
        .map(|_| {
            let (shared, keys, next) = (shared.clone(), keys.clone(), next.clone());
            let reading = reading.clone();
            tokio::spawn(async move {
                let mut found = Vec::new();
                while reading.time_left(&shared) != Some(Duration::ZERO) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(k) = keys.get(i) else {
                        break;
                    };
                    let Some(read) = read_one(&shared, &reading, &k.lease, &k.key).await else {
                        break;
                    };
                    if let Read::Failed(_) = read {
                        reading.settle(&shared, KEY_UNREAD);
                    } else if check::read_proves_violation(&k.key, &k.writes, &read) {
                        reading.settle(&shared, VIOLATION_FOUND);
                    }
                    found.push((k.key.clone(), read));
                }
                found
            })
        })
        .collect();
    let mut reads = HashMap::with_capacity(keys.len());
    for reader in readers {
        if let Ok(found) = reader.await {
            reads.extend(found);
        }
    }
    bar.abort();
    if std::io::stderr().is_terminal() && watch.elapsed_ms() >= 1000 {
        eprintln!();
    }
    let stopped = if reads.len() < keys.len() {
        reading.settled(shared).map(|(_, why)| why)
    } else {
        None
    };
    ReadBack { reads, stopped }
}

/// Reads one key: a few times if the storage answers with an error, once
/// if it does not answer within `--request-timeout`. `None`: the read-back
/// ran out of time first (the key was not read).
async fn read_one(shared: &Shared, reading: &Reading, lease: &str, key: &str) -> Option<Read> {
    let path = shared.path.render(lease, key);
    let store = &shared.storage;
    let request = store.read(&path);
    let headers = request.headers();
    let mut why = String::new();
    for attempt in 0..READ_TRIES {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        let to = read_url(shared, request.path.clone());
        let read = call(
            shared,
            request.method.clone(),
            to,
            &headers,
            request.body.clone(),
        );
        // Past the read-back's end, the read is abandoned.
        let answer = match reading.time_left(shared) {
            Some(left) => tokio::time::timeout(left, read).await.ok()?,
            None => read.await,
        };
        match answer {
            Ok(a) => match store.read_answer(a.status, &a.body) {
                ReadAnswer::Holds(value) => return Some(Read::Holds(value)),
                ReadAnswer::Absent => return Some(Read::Absent),
                ReadAnswer::Error => why = format!("{path} answered {}", a.status),
            },
            Err(e @ LoadtestError::NoAnswer(_)) => {
                return Some(Read::Failed(format!("{path}: {e}")))
            }
            Err(e) => why = format!("{path}: {e}"),
        }
    }
    Some(Read::Failed(why))
}

/// "reading back 1234/5000 keys" on a terminal's stderr, once reading has
/// lasted a second.
async fn progress(next: Arc<AtomicUsize>, total: usize) {
    if !std::io::stderr().is_terminal() {
        return;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    loop {
        let done = next.load(Ordering::Relaxed).min(total);
        {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\rreading back {done}/{total} keys");
            let _ = err.flush();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the cleanup did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Cleanup {
    /// Keys deleted (or found gone).
    pub deleted: u64,
    /// Keys the storage or fencegate would not delete; the first reason.
    pub failed: u64,
    pub error: Option<String>,
}

/// Deletes the run's keys: those `reads` found (or could not read), or,
/// without a read-back, every key the run tried to write. Through fencegate
/// under a term of a lease of the run's own per lease (deletes are writes);
/// with `--direct`, straight to the storage.
///
/// Once a request of the run got no answer within `--request-timeout`, the
/// cleanup has one more `--request-timeout` (counted from when it began, if
/// later): the keys it has not deleted by then are counted as failed.
pub(super) async fn clean_up(
    shared: &Arc<Shared>,
    writes: &[ClientWrite],
    reads: Option<&HashMap<String, Read>>,
) -> Cleanup {
    let began_ms = shared.started.elapsed_ms();
    let mut by_lease: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (lease, key) in keys(writes) {
        if reads.is_some_and(|r| r.get(&key) == Some(&Read::Absent)) {
            continue;
        }
        by_lease.entry(lease).or_default().push(key);
    }
    let tasks: Vec<_> = by_lease
        .into_iter()
        .map(|(lease, keys)| {
            let shared = shared.clone();
            tokio::spawn(async move { clean_lease(&shared, &lease, &keys, began_ms).await })
        })
        .collect();
    let mut total = Cleanup::default();
    for task in tasks {
        let done = task.await.unwrap_or_else(|e| Cleanup {
            failed: 1,
            error: Some(e.to_string()),
            ..Cleanup::default()
        });
        total.deleted += done.deleted;
        total.failed += done.failed;
        total.error = total.error.or(done.error);
    }
    total
}

/// A term the cleanup holds.
struct Held {
    token: String,
    lease_id: String,
    renewed: Stopwatch,
}

/// Why a key of the cleanup was not deleted.
enum NotDeleted {
    /// The delete failed; the next key is tried.
    Failed(LoadtestError),
    /// No term of the lease could be acquired: the rest of its keys are
    /// not tried (the cleanup is bounded even when fencegate is not there).
    NoTerm(LoadtestError),
}

/// Deletes `keys` of `lease`, within what is left of a cleanup that began
/// at `began_ms` (see [`clean_up`]).
async fn clean_lease(shared: &Shared, lease: &str, keys: &[String], began_ms: u64) -> Cleanup {
    let mut done = Cleanup::default();
    let mut held: Option<Held> = None;
    let time_left = || shared.time_left(began_ms, shared.unanswered_since_ms());
    for (i, key) in keys.iter().enumerate() {
        let path = shared.path.render(lease, key);
        let deleting = delete_key(shared, lease, path, &mut held);
        let outcome = match time_left() {
            Some(left) => tokio::time::timeout(left, deleting).await.ok(),
            None => Some(deleting.await),
        };
        match outcome {
            Some(Ok(())) => done.deleted += 1,
            Some(Err(NotDeleted::Failed(e))) => {
                done.failed += 1;
                done.error.get_or_insert(e.to_string());
            }
            Some(Err(NotDeleted::NoTerm(e))) => {
                done.failed += (keys.len() - i) as u64;
                done.error.get_or_insert(e.to_string());
                return done;
            }
            None => {
                done.failed += (keys.len() - i) as u64;
                done.error.get_or_insert(format!(
                    "not tried: stopped once a request had got no answer within {} ms (--request-timeout)",
                    shared.args.request_timeout
                ));
                return done;
            }
        }
    }
    if let Some(h) = held {
        let headers = [
            (FENCING_TOKEN, h.token.as_str()),
            (FENCING_LEASE_ID, h.lease_id.as_str()),
        ];
        let to = To::Lease(lease.to_owned(), format!("/_fence/leases/{lease}"));
        let release = call(shared, Method::DELETE, to, &headers, Bytes::new());
        // Out of time, the term is left to expire (a TTL).
        match time_left() {
            Some(left) => {
                let _ = tokio::time::timeout(left, release).await;
            }
            None => {
                let _ = release.await;
            }
        }
    }
    done
}

/// Deletes the key of `lease` at `path`: straight to the storage with
/// `--direct`, else through fencegate under the cleanup's term of the lease
/// (`held`, acquired or renewed as needed).
async fn delete_key(
    shared: &Shared,
    lease: &str,
    path: String,
    held: &mut Option<Held>,
) -> Result<(), NotDeleted> {
    if let Some(direct) = &shared.args.direct {
        let to = To::Url(format!("{direct}{path}"));
        return delete(shared, to, &[]).await.map_err(NotDeleted::Failed);
    }
    // A refused delete (the term ended meanwhile) is tried once more under
    // a fresh term; one that got no answer is not.
    let mut outcome = Err(LoadtestError::Failed(String::new()));
    for _ in 0..2 {
        let h = hold(shared, lease, held)
            .await
            .map_err(NotDeleted::NoTerm)?;
        let headers = [
            (FENCING_TOKEN, h.token.as_str()),
            (FENCING_LEASE_ID, h.lease_id.as_str()),
        ];
        outcome = delete(shared, To::Lease(lease.to_owned(), path.clone()), &headers).await;
        if matches!(outcome, Ok(()) | Err(LoadtestError::NoAnswer(_))) {
            break;
        }
        *held = None;
    }
    outcome.map_err(NotDeleted::Failed)
}

/// The cleanup's term of `lease`: acquired (waiting for the lease), or
/// renewed once a third of its TTL has passed.
async fn hold<'a>(
    shared: &Shared,
    lease: &str,
    held: &'a mut Option<Held>,
) -> Result<&'a Held, LoadtestError> {
    let ttl = shared.args.ttl;
    if let Some(h) = held.as_ref() {
        if h.renewed.elapsed_ms() < ttl / 3 {
            return Ok(held.as_ref().expect("just seen"));
        }
        let headers = [
            (FENCING_TOKEN, h.token.as_str()),
            (FENCING_LEASE_ID, h.lease_id.as_str()),
        ];
        let to = To::Lease(lease.to_owned(), format!("/_fence/leases/{lease}/renew"));
        let renewed = Stopwatch::start();
        match call(shared, Method::POST, to, &headers, Bytes::new()).await {
            Ok(a) if a.status == StatusCode::OK => {
                let h = held.as_mut().expect("just seen");
                h.renewed = renewed;
                return Ok(h);
            }
            _ => *held = None,
        }
    }
    let mut body = json!({"ttl_ms": ttl, "wait_ms": shared.lease_wait_ms(ttl)});
    if shared.bearer.is_none() {
        body["holder"] = format!("{}-cleanup", shared.run_id).into();
    }
    let mut last = String::new();
    for _ in 0..3 {
        let to = To::Lease(lease.to_owned(), format!("/_fence/leases/{lease}"));
        let sent = Stopwatch::start();
        let headers = [("content-type", "application/json")];
        match call(
            shared,
            Method::POST,
            to,
            &headers,
            Bytes::from(body.to_string()),
        )
        .await
        {
            Ok(a) if a.status == StatusCode::CREATED => {
                let h = Held {
                    token: a.json["token"].as_u64().unwrap_or(0).to_string(),
                    lease_id: a.json["lease_id"].as_str().unwrap_or_default().to_owned(),
                    renewed: sent,
                };
                return Ok(held.insert(h));
            }
            Ok(a) => last = format!("acquiring {lease} answered {}", a.status),
            Err(e) => last = format!("acquiring {lease}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(LoadtestError::Failed(last))
}

/// A delete: done if the key is gone (with `http`: 2xx, or 404: it was
/// never there).
async fn delete(shared: &Shared, to: To, headers: &[(&str, &str)]) -> Result<(), LoadtestError> {
    let store = &shared.storage;
    let (to, request) = match to {
        To::Url(url) => {
            // `--direct`: the storage's base URL and the key's path.
            let base = shared.args.direct.clone().unwrap_or_default();
            let request = store.delete(url.strip_prefix(&base).unwrap_or(&url));
            (To::Url(format!("{base}{}", request.path)), request)
        }
        To::Target(path) => {
            let request = store.delete(&path);
            (To::Target(request.path.clone()), request)
        }
        To::Lease(lease, path) => {
            let request = store.delete(&path);
            (To::Lease(lease, request.path.clone()), request)
        }
    };
    let shown = match &to {
        To::Url(url) | To::Target(url) | To::Lease(_, url) => url.clone(),
    };
    let mut all = headers.to_vec();
    all.extend(request.headers());
    // On a route with preconditions a key not seen since a restart is read
    // first (428).
    match super::write_reading_first(shared, request.method, to, &all, request.body).await {
        Ok(a) if store.deleted(a.status) => Ok(()),
        Ok(a) => Err(LoadtestError::Failed(format!(
            "deleting {shown} answered {}",
            a.status
        ))),
        Err(e @ LoadtestError::NoAnswer(_)) => {
            Err(LoadtestError::NoAnswer(format!("DELETE {shown}: {e}")))
        }
        Err(e) => Err(LoadtestError::Failed(format!("DELETE {shown}: {e}"))),
    }
}
