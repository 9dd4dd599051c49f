//! One etcd transaction for the log appends of several shards.
//!
//! Each shard's journal groups the changes that arrive together into one
//! log entry (group commit), but a member leading several shards would then
//! send one transaction per shard where one primary sent one for all: etcd's
//! cost is mostly per transaction, so its grants per second would fall with
//! the number of shards. The committer merges the appends the member's
//! shards send at the same time into one transaction holding every
//! shard's comparisons (its election key, its entry's number not taken)
//! and every shard's entry. If any comparison fails (a shard lost its
//! election) or the transaction fails, each append is tried again alone,
//! so only the shard at fault fails.
//! Each shard waits for its append's answer before it sends the next, so
//! its entries stay in order.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::etcd::{Compare, EtcdClient, EtcdError, Op};

/// The most appends in one transaction (etcd refuses more than 128
/// operations in one by default; each append is one put).
const MOST_APPENDS: usize = 32;

/// The most bytes of entries in one transaction (etcd refuses requests
/// over 1.5 MiB by default).
const MOST_BYTES: usize = 1024 * 1024;

/// Merged transactions in flight at once: one, as one primary's journal
/// sends one entry at a time, so the appends that arrive meanwhile all
/// join the next.
const IN_FLIGHT: usize = 1;

/// One shard's append: its comparisons and its puts, and who waits.
struct Append {
    compare: Vec<Compare>,
    ops: Vec<Op>,
    bytes: usize,
    done: oneshot::Sender<Result<bool, EtcdError>>,
}

/// Merges the appends of a member's shards; clones share it.
#[derive(Clone, Debug)]
pub struct Committer {
    tx: mpsc::UnboundedSender<Append>,
}

impl Committer {
    /// A committer sending through `client`, its task started.
    pub fn start(client: EtcdClient) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(client, rx));
        Self { tx }
    }

    /// Runs `ops` if every comparison in `compare` holds, possibly in one
    /// transaction with other shards' appends: whether they held.
    pub async fn txn(&self, compare: Vec<Compare>, ops: Vec<Op>) -> Result<bool, EtcdError> {
        let bytes = ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value, .. } => key.len() + value.len(),
                _ => 64,
            })
            .sum();
        let (done, answer) = oneshot::channel();
        self.tx
            .send(Append {
                compare,
                ops,
                bytes,
                done,
            })
            .map_err(|_| EtcdError::Unavailable("the member's committer stopped".into()))?;
        answer.await.unwrap_or_else(|_| {
            Err(EtcdError::Unavailable(
                "the member's committer stopped".into(),
            ))
        })
    }
}

async fn run(client: EtcdClient, mut rx: mpsc::UnboundedReceiver<Append>) {
    let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Wait for a slot first: appends that arrive meanwhile join this
        // transaction.
        let Ok(slot) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let mut bytes = first.bytes;
        let mut group = vec![first];
        while group.len() < MOST_APPENDS {
            match rx.try_recv() {
                Ok(next) if bytes + next.bytes <= MOST_BYTES => {
                    bytes += next.bytes;
                    group.push(next);
                }
                Ok(next) => {
                    // Too big to join: alone, after this one.
                    let client = client.clone();
                    tokio::spawn(async move { commit(&client, vec![next]).await });
                    break;
                }
                Err(_) => break,
            }
        }
        let client = client.clone();
        tokio::spawn(async move {
            commit(&client, group).await;
            drop(slot);
        });
    }
}

/// Commits `group` in one transaction; if a comparison failed there, each
/// append alone.
async fn commit(client: &EtcdClient, group: Vec<Append>) {
    if group.len() == 1 {
        for a in group {
            let result = client.txn(&a.compare, &a.ops, &[]).await;
            let _ = a.done.send(result.map(|r| r.succeeded));
        }
        return;
    }
    let compare: Vec<Compare> = group.iter().flat_map(|a| a.compare.clone()).collect();
    let ops: Vec<Op> = group.iter().flat_map(|a| a.ops.clone()).collect();
    match client.txn(&compare, &ops, &[]).await {
        Ok(r) if r.succeeded => {
            for a in group {
                let _ = a.done.send(Ok(true));
            }
        }
        // A comparison failed, or the transaction's outcome is unknown:
        // each append alone. One that did commit then fails its own
        // comparison (its entry's number is taken), as a lost answer
        // would; the others are not failed for it.
        Ok(_) | Err(_) => {
            for a in group {
                let result = client.txn(&a.compare, &a.ops, &[]).await;
                let _ = a.done.send(result.map(|r| r.succeeded));
            }
        }
    }
}
