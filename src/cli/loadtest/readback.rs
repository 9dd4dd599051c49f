//! After the run: reading back every key it wrote (bounded concurrency,
//! with progress on a terminal), and deleting the run's keys.

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde::Serialize;
use serde_json::json;

use super::check::{ClientWrite, Read};
use super::{call, layout, LoadtestError, Shared, To};
use crate::clock::Stopwatch;
use crate::wire::{FENCING_LEASE_ID, FENCING_TOKEN};

/// Tries per read before it counts as failed.
const READ_TRIES: u32 = 3;

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

/// Reads every key the run tried to write; what each holds, by key.
pub(super) async fn read_keys(
    shared: &Arc<Shared>,
    writes: &[ClientWrite],
) -> HashMap<String, Read> {
    let keys = Arc::new(keys(writes));
    let next = Arc::new(AtomicUsize::new(0));
    let reading = Stopwatch::start();
    let bar = tokio::spawn(progress(next.clone(), keys.len()));
    let readers: Vec<_> = (0..shared.args.read_concurrency.max(1))
        .map(|_| {
            let (shared, keys, next) = (shared.clone(), keys.clone(), next.clone());
            tokio::spawn(async move {
                let mut found = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((lease, key)) = keys.get(i) else {
                        break;
                    };
                    found.push((key.clone(), read_one(&shared, lease, key).await));
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
    if std::io::stderr().is_terminal() && reading.elapsed_ms() >= 1000 {
        eprintln!();
    }
    reads
}

/// Reads one key, a few times if the storage fails to answer.
async fn read_one(shared: &Shared, lease: &str, key: &str) -> Read {
    let path = shared.path.render(lease, key);
    let mut why = String::new();
    for attempt in 0..READ_TRIES {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        let to = read_url(shared, path.clone());
        match call(shared, Method::GET, to, &[], Bytes::new()).await {
            Ok(a) if a.status.is_success() => return Read::Holds(layout::find_value(&a.body)),
            Ok(a) if a.status == StatusCode::NOT_FOUND => return Read::Absent,
            Ok(a) => why = format!("{path} answered {}", a.status),
            Err(e) => why = format!("{path}: {e}"),
        }
    }
    Read::Failed(why)
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
pub(super) async fn clean_up(
    shared: &Arc<Shared>,
    writes: &[ClientWrite],
    reads: Option<&HashMap<String, Read>>,
) -> Cleanup {
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
            tokio::spawn(async move { clean_lease(&shared, &lease, &keys).await })
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

/// Deletes `keys` of `lease`; gives up on the rest once the lease cannot be
/// acquired (the cleanup is bounded even when fencegate is not there).
async fn clean_lease(shared: &Shared, lease: &str, keys: &[String]) -> Cleanup {
    let mut done = Cleanup::default();
    let mut held: Option<Held> = None;
    for (i, key) in keys.iter().enumerate() {
        let path = shared.path.render(lease, key);
        let outcome = match &shared.args.direct {
            Some(direct) => delete(shared, To::Url(format!("{direct}{path}")), &[]).await,
            None => {
                // A refused delete (the term ended meanwhile) is tried once
                // more under a fresh term.
                let mut outcome = Err(LoadtestError::Failed(String::new()));
                for _ in 0..2 {
                    let h = match hold(shared, lease, &mut held).await {
                        Ok(h) => h,
                        Err(e) => {
                            done.failed += (keys.len() - i) as u64;
                            done.error.get_or_insert(e.to_string());
                            return done;
                        }
                    };
                    let headers = [
                        (FENCING_TOKEN, h.token.as_str()),
                        (FENCING_LEASE_ID, h.lease_id.as_str()),
                    ];
                    outcome =
                        delete(shared, To::Lease(lease.to_owned(), path.clone()), &headers).await;
                    if outcome.is_ok() {
                        break;
                    }
                    held = None;
                }
                outcome
            }
        };
        match outcome {
            Ok(()) => done.deleted += 1,
            Err(e) => {
                done.failed += 1;
                done.error.get_or_insert(e.to_string());
            }
        }
    }
    if let Some(h) = held {
        let headers = [
            (FENCING_TOKEN, h.token.as_str()),
            (FENCING_LEASE_ID, h.lease_id.as_str()),
        ];
        let to = To::Lease(lease.to_owned(), format!("/_fence/leases/{lease}"));
        let _ = call(shared, Method::DELETE, to, &headers, Bytes::new()).await;
    }
    done
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
    let mut body = json!({"ttl_ms": ttl, "wait_ms": (ttl * 4).min(60_000)});
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

/// A DELETE: done if the key is gone (2xx, or 404: it was never there).
async fn delete(shared: &Shared, to: To, headers: &[(&str, &str)]) -> Result<(), LoadtestError> {
    let shown = match &to {
        To::Url(url) | To::Target(url) | To::Lease(_, url) => url.clone(),
    };
    // On a route with preconditions a key not seen since a restart is read
    // first (428).
    match super::write_reading_first(shared, Method::DELETE, to, headers, Bytes::new()).await {
        Ok(a) if a.status.is_success() || a.status == StatusCode::NOT_FOUND => Ok(()),
        Ok(a) => Err(LoadtestError::Failed(format!(
            "DELETE {shown} answered {}",
            a.status
        ))),
        Err(e) => Err(LoadtestError::Failed(format!("DELETE {shown}: {e}"))),
    }
}
