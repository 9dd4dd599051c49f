//! The lease state cluster members share: one etcd key per lease under
//! `{prefix}leases/`, written only by the primary, each write conditional
//! on its election key.
//!
//! [`EtcdJournal`] fills the lease store's [`Journal`] seam. Records are
//! queued in the order of the calls (the store calls while the lease is
//! locked) and written by one task, in order, several per transaction
//! (group commit). Every transaction compares the election key's create
//! revision with the one this member won: a deposed primary's write fails
//! and its grant is never acknowledged. Any failed write marks the journal
//! failed, and the member steps down: its next term of primacy starts from
//! what etcd holds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::etcd::{Compare, EtcdClient, EtcdError, Op};
use crate::hex;
use crate::journal::{GrantRecord, Journal, JournalError, JournalFuture, LeaseRecord, TermRecord};

/// Most leases written by one transaction (etcd refuses more than 128
/// operations in one by default; one more is the comparison).
const MAX_BATCH: usize = 100;

/// Most records waiting for the writer; past it, grants fail closed.
const QUEUE: usize = 16 * 1024;

/// One lease as etcd keeps it (JSON).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoredLease {
    pub last_token: u64,
    pub transitions: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<StoredTerm>,
}

/// A lease's latest term, with the SHA-256 digest of its lease id in hex
/// (never the id itself).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoredTerm {
    pub token: u64,
    pub holder: String,
    pub ttl_ms: u64,
    pub lease_id_sha256: String,
    pub released: bool,
}

impl StoredLease {
    /// The record the lease store restores from (the term's id as its
    /// digest: see `RestartRule::hashed_ids`).
    pub fn to_record(&self, lease: String) -> Result<LeaseRecord, String> {
        let term = match &self.term {
            None => None,
            Some(t) => Some(TermRecord {
                token: t.token,
                holder: t.holder.clone(),
                ttl_ms: t.ttl_ms,
                lease_id: hex::decode32(&t.lease_id_sha256)
                    .ok_or_else(|| format!("lease {lease:?} has a malformed lease id digest"))?,
                released: t.released,
            }),
        };
        Ok(LeaseRecord {
            lease,
            last_token: self.last_token,
            transitions: self.transitions,
            term,
        })
    }

    /// The stored form of a restored record whose id is already a digest.
    pub fn from_record(record: &LeaseRecord) -> Self {
        Self {
            last_token: record.last_token,
            transitions: record.transitions,
            term: record.term.as_ref().map(|t| StoredTerm {
                token: t.token,
                holder: t.holder.clone(),
                ttl_ms: t.ttl_ms,
                lease_id_sha256: hex::encode(&t.lease_id),
                released: t.released,
            }),
        }
    }
}

/// One queued write: a lease's whole stored state, and who waits for it.
struct Write {
    lease: String,
    value: Vec<u8>,
    ack: Option<oneshot::Sender<Result<(), JournalError>>>,
}

/// Where this member's election stands, for the comparison every write
/// carries.
#[derive(Clone, Debug)]
pub struct Election {
    /// The election key.
    pub key: Vec<u8>,
    /// Its create revision when this member won.
    pub revision: i64,
}

/// The lease store's journal on a cluster's primary.
pub struct EtcdJournal {
    cache: Mutex<HashMap<String, StoredLease>>,
    tx: mpsc::Sender<Write>,
    state: Arc<Failure>,
}

/// Set once any write fails; the member watches it to step down.
#[derive(Default)]
pub struct Failure {
    failed: AtomicBool,
    notify: Notify,
}

impl Failure {
    /// Whether a write failed.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Completes once a write failed.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_failed() {
                return;
            }
            notified.await;
        }
    }

    /// Stops all further writes (the member stepped down).
    pub fn stop(&self) {
        self.failed.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    fn fail(&self, why: &str) {
        if !self.failed.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                error = why,
                "lease state could not be written to etcd; stepping down"
            );
        }
        self.notify.notify_waiters();
    }
}

impl EtcdJournal {
    /// A journal writing under `prefix` as the winner of `election`,
    /// starting from `loaded` (what etcd held at takeover).
    pub fn start(
        client: EtcdClient,
        prefix: Vec<u8>,
        election: Election,
        loaded: &[LeaseRecord],
    ) -> Self {
        let cache = loaded
            .iter()
            .map(|r| (r.lease.clone(), StoredLease::from_record(r)))
            .collect();
        let (tx, rx) = mpsc::channel(QUEUE);
        let state = Arc::new(Failure::default());
        tokio::spawn(write_loop(client, prefix, election, rx, state.clone()));
        Self {
            cache: Mutex::new(cache),
            tx,
            state,
        }
    }

    /// Set once a write failed.
    pub fn failure(&self) -> Arc<Failure> {
        self.state.clone()
    }

    /// Changes the cached state of `lease` with `change` and queues the
    /// result, in call order.
    fn queue(
        &self,
        lease: &str,
        ack: Option<oneshot::Sender<Result<(), JournalError>>>,
        change: impl FnOnce(&mut StoredLease) -> bool,
    ) -> Result<(), JournalError> {
        if self.state.is_failed() {
            return Err(JournalError("this member stepped down".into()));
        }
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let stored = cache.entry(lease.to_owned()).or_default();
        if !change(stored) {
            return Ok(());
        }
        let value = serde_json::to_vec(&*stored).unwrap_or_default();
        let write = Write {
            lease: lease.to_owned(),
            value,
            ack,
        };
        // Sent under the cache's lock, so the queue's order is the order
        // of the changes.
        self.tx.try_send(write).map_err(|_| {
            self.state.fail("the etcd write queue is full");
            JournalError("the etcd write queue is full".into())
        })
    }
}

impl Journal for EtcdJournal {
    fn persist_grant(&self, record: GrantRecord) -> JournalFuture {
        let (ack, done) = oneshot::channel();
        let digest: [u8; 32] = Sha256::digest(record.lease_id).into();
        let queued = self.queue(&record.lease, Some(ack), |stored| {
            stored.last_token = stored.last_token.max(record.token);
            stored.transitions += 1;
            stored.term = Some(StoredTerm {
                token: record.token,
                holder: record.holder.clone(),
                ttl_ms: record.ttl_ms,
                lease_id_sha256: hex::encode(&digest),
                released: false,
            });
            true
        });
        Box::pin(async move {
            queued?;
            done.await
                .unwrap_or_else(|_| Err(JournalError("the etcd writer stopped".into())))
        })
    }

    fn record_renew(&self, lease: &str, token: u64, ttl_ms: u64) {
        let _ = self.queue(lease, None, |stored| match stored.term.as_mut() {
            Some(t) if t.token == token && t.ttl_ms != ttl_ms => {
                t.ttl_ms = ttl_ms;
                true
            }
            _ => false,
        });
    }

    fn record_release(&self, lease: &str, token: u64) {
        let _ = self.queue(lease, None, |stored| match stored.term.as_mut() {
            Some(t) if t.token == token && !t.released => {
                t.released = true;
                true
            }
            _ => false,
        });
    }

    fn is_healthy(&self) -> bool {
        !self.state.is_failed()
    }
}

/// Writes queued records in order, up to [`MAX_BATCH`] leases per
/// transaction, each transaction conditional on the election.
async fn write_loop(
    client: EtcdClient,
    prefix: Vec<u8>,
    election: Election,
    mut rx: mpsc::Receiver<Write>,
    state: Arc<Failure>,
) {
    let mut batch: Vec<Write> = Vec::new();
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(write) => batch.push(write),
                Err(_) => break,
            }
        }
        // etcd refuses two operations on one key in a transaction: the
        // last state of each lease is the one written.
        let mut last: HashMap<&str, usize> = HashMap::new();
        for (i, w) in batch.iter().enumerate() {
            last.insert(w.lease.as_str(), i);
        }
        let mut indices: Vec<usize> = last.into_values().collect();
        indices.sort_unstable();
        let ops: Vec<Op> = indices
            .iter()
            .map(|&i| Op::Put {
                key: [prefix.as_slice(), b"leases/", batch[i].lease.as_bytes()].concat(),
                value: batch[i].value.clone(),
                lease: 0,
            })
            .collect();
        let compare = [Compare::CreateRevision(
            election.key.clone(),
            election.revision,
        )];
        let outcome = if state.is_failed() {
            Err("this member stepped down".to_owned())
        } else {
            match client.txn(&compare, &ops, &[]).await {
                Ok(r) if r.succeeded => Ok(()),
                Ok(_) => Err("this member is no longer the primary".to_owned()),
                Err(EtcdError::Unavailable(e) | EtcdError::Refused(e)) => Err(e),
            }
        };
        if let Err(why) = &outcome {
            state.fail(why);
        }
        for w in batch.drain(..) {
            if let Some(ack) = w.ack {
                let _ = ack.send(outcome.clone().map_err(JournalError));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_leases_keep_a_digest_and_round_trip() {
        let digest: [u8; 32] = Sha256::digest(b"0123456789abcdef0123456789abcdef").into();
        let record = LeaseRecord {
            lease: "orders".into(),
            last_token: 7,
            transitions: 3,
            term: Some(TermRecord {
                token: 7,
                holder: "a".into(),
                ttl_ms: 5000,
                lease_id: digest,
                released: false,
            }),
        };
        let stored = StoredLease::from_record(&record);
        let json = serde_json::to_string(&stored).unwrap();
        assert!(!json.contains("0123456789abcdef0123456789abcdef"));
        let back: StoredLease = serde_json::from_str(&json).unwrap();
        assert_eq!(back.to_record("orders".into()).unwrap(), record);
        let mut bad = back;
        bad.term.as_mut().unwrap().lease_id_sha256 = "zz".into();
        assert!(bad.to_record("orders".into()).is_err());
    }
}
