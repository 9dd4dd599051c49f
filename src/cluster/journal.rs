//! The lease state cluster members share, kept in etcd as a log that only
//! the primary writes, each write conditional on its election key.
//!
//! Under the cluster's prefix:
//! - `log/{seq}`: one entry per transaction, the whole stored state of
//!   every lease it changed (a JSON array); `seq` has 20 digits, so the
//!   keys sort in the order they were written.
//! - `snap/{generation}/{chunk}`: a snapshot of every lease, in chunks.
//! - `snapshot`: the generation that is whole (`{"generation","chunks"}`);
//!   the log is replayed over it from entry `generation` on.
//!
//! A log rather than a key per lease because etcd's cost is mostly per key
//! written: one transaction putting 100 small keys costs its process
//! about three times the CPU of one putting their 100 values as one key
//! (measured through the JSON gateway, see docs/cluster.md's figures).
//!
//! Every record is a lease's whole state, so replaying any complete suffix
//! of the log over states taken at or after that suffix's start gives the
//! latest state. That is what lets a snapshot be taken chunk by chunk while
//! grants go on: entries before the snapshot's generation are committed
//! before it starts, every lease is read at some point after that, and the
//! entries from the generation on are replayed over it. The snapshot's last
//! transaction moves `snapshot` to the new generation and deletes the log
//! before it and every older snapshot, atomically. The states a snapshot
//! reads are the primary's, which change before their entry commits: if
//! that entry then fails (and the member steps down), the snapshot may hold
//! a change nobody was told of, such as a grant that was refused. That
//! costs a lease its TTL after the failover, never a token: a token in etcd
//! is only ever above the ones acknowledged.
//!
//! [`EtcdJournal`] fills the lease store's [`Journal`] seam. Records are
//! queued in the order of the calls (the store calls while the lease is
//! locked) and written by one task, in order, many per entry (group
//! commit). Every transaction compares the election key's create revision
//! with the one this member won: a deposed primary's write fails and its
//! grant is never acknowledged. Any failed log write marks the journal
//! failed, and the member steps down: its next term of primacy starts from
//! what etcd holds.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::etcd::{Compare, EtcdClient, EtcdError, Op};

use super::committer::Committer;
use crate::hex;
use crate::journal::record::{GRANTED_QUIET, RELEASED_QUIET};
use crate::journal::{GrantRecord, Journal, JournalError, JournalFuture, LeaseRecord};

pub use fencegate_core::journal::stored::{StoredGrant, StoredLease, StoredState, StoredTerm};

/// One queued write: a lease's whole stored state, and who waits for it.
/// The writer task makes its log record, so no JSON is written while the
/// cache's lock (and the lease store's lock of the lease) is held.
struct Write {
    lease: String,
    state: StoredLease,
    /// The log record, made by the writer.
    record: Vec<u8>,
    ack: Option<oneshot::Sender<Result<(), JournalError>>>,
}

type Ack = oneshot::Sender<Result<(), JournalError>>;

impl Write {
    fn new(lease: &str, state: StoredLease, ack: Option<Ack>) -> Self {
        Self {
            lease: lease.to_owned(),
            state,
            record: Vec::new(),
            ack,
        }
    }

    /// With its log record made.
    fn encoded(mut self) -> Self {
        self.record = Record::bytes(&self.lease, &self.state);
        self
    }
}

/// One record of the log or a snapshot, as a JSON array (etcd's cost
/// grows with the bytes written, so no field names):
/// `[lease, last_token, transitions, term]`, where `term` is `null`,
/// `[token, holder, ttl_ms, lease id's SHA-256 in hex, released, flags,
/// wall_deadline_ms]` (flags: 1 granted quiet, 2 released quiet; records
/// written before them have neither of the last two), or
/// `"forgotten"` for a lease forgotten (the empty name: the mark of every
/// lease forgotten before).
struct Record<'a> {
    lease: &'a str,
    state: &'a StoredLease,
}

impl Record<'_> {
    /// The record of `lease` in `state`, as JSON.
    fn bytes(lease: &str, state: &StoredLease) -> Vec<u8> {
        serde_json::to_vec(&Record { lease, state })
            .expect("a record of strings and numbers serialises")
    }
}

impl Serialize for Record<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.state.forgotten {
            return (
                self.lease,
                self.state.last_token,
                self.state.transitions,
                FORGOTTEN,
            )
                .serialize(s);
        }
        let term = self.state.term.as_ref().map(|t| {
            let mut digest = [0u8; 64];
            hex::encode_into(&t.lease_id_sha256, &mut digest);
            (
                t.token,
                &t.holder,
                t.ttl_ms,
                Hex(digest),
                t.released,
                t.flags(),
                t.wall_deadline_ms,
            )
        });
        (
            self.lease,
            self.state.last_token,
            self.state.transitions,
            term,
        )
            .serialize(s)
    }
}

/// A digest's hex digits, serialized as a string.
struct Hex([u8; 64]);

impl Serialize for Hex {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Hex digits are ASCII.
        s.serialize_str(std::str::from_utf8(&self.0).unwrap_or_default())
    }
}

/// The term of a forgotten lease's record.
const FORGOTTEN: &str = "forgotten";

/// A record read back.
#[derive(Deserialize)]
struct OwnedRecord(String, u64, u64, Option<TermField>);

/// A term's fields: token, holder, TTL, the lease id's digest in hex,
/// released, flags, wall-clock deadline.
type TermFields = (u64, String, u64, String, bool, u8, u64);

/// The fourth field of a record.
#[derive(Deserialize)]
#[serde(untagged)]
enum TermField {
    Term(TermFields),
    /// A term written before its flags and wall-clock hint.
    Term1(u64, String, u64, String, bool),
    Mark(String),
}

/// Why the lease state in etcd cannot be read back.
#[derive(Debug)]
pub enum StateError {
    /// etcd could not be reached, or refused a read.
    Etcd(EtcdError),
    /// A value is not what this build writes.
    Unreadable {
        what: &'static str,
        why: serde_json::Error,
    },
    /// A lease carries a mark this build does not know.
    UnknownMark { lease: String, mark: String },
    /// A lease's lease id digest is malformed.
    MalformedDigest { lease: String },
    /// The lease state is in the layout before the log, under this key.
    OlderLayout(String),
    /// A snapshot lacks one of its chunks.
    MissingChunk {
        generation: u64,
        chunk: u64,
        chunks: u64,
    },
    /// A key in the log that names no entry.
    UnexpectedKey(Vec<u8>),
    /// The log's last entry has the largest number there is.
    LogFull,
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Etcd(e) => e.fmt(f),
            Self::Unreadable { what, why } => write!(f, "{what} in etcd is unreadable: {why}"),
            Self::UnknownMark { lease, mark } => {
                write!(f, "lease {lease:?} has an unknown mark {mark:?}")
            }
            Self::MalformedDigest { lease } => {
                write!(f, "lease {lease:?} has a malformed lease id digest")
            }
            Self::OlderLayout(under) => write!(
                f,
                "etcd holds lease state in the older layout (one key per lease under {under:?}); \
                 this build reads only its log"
            ),
            Self::MissingChunk {
                generation,
                chunk,
                chunks,
            } => write!(
                f,
                "snapshot {generation} in etcd is missing chunk {chunk} of its {chunks} chunks"
            ),
            Self::UnexpectedKey(key) => write!(f, "unexpected key {key:?} in the log"),
            Self::LogFull => f.write_str("the log's last entry has the largest number there is"),
        }
    }
}

impl std::error::Error for StateError {}

impl From<EtcdError> for StateError {
    fn from(e: EtcdError) -> Self {
        Self::Etcd(e)
    }
}

/// Why a write of the lease state to etcd failed.
#[derive(Debug)]
enum WriteError {
    /// This member stepped down.
    SteppedDown,
    /// The write's comparison failed: this member is no longer the
    /// primary (or a log entry's number was taken).
    NotPrimary { entry: bool },
    /// etcd could not be reached, or refused: why.
    Etcd(String),
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SteppedDown => f.write_str("this member stepped down"),
            Self::NotPrimary { entry: false } => {
                f.write_str("this member is no longer the primary")
            }
            Self::NotPrimary { entry: true } => f.write_str(
                "this member is no longer the primary (or its log entry's number was taken)",
            ),
            Self::Etcd(why) => f.write_str(why),
        }
    }
}

impl OwnedRecord {
    fn into_parts(self) -> Result<(String, StoredLease), StateError> {
        let OwnedRecord(lease, last_token, transitions, term) = self;
        let mut forgotten = false;
        let term = match term {
            None => None,
            Some(TermField::Mark(mark)) if mark == FORGOTTEN => {
                forgotten = true;
                None
            }
            Some(TermField::Mark(mark)) => return Err(StateError::UnknownMark { lease, mark }),
            Some(TermField::Term1(token, holder, ttl_ms, digest, released)) => Some(stored_term(
                &lease,
                (token, holder, ttl_ms, digest, released, 0, 0),
            )?),
            Some(TermField::Term(fields)) => Some(stored_term(&lease, fields)?),
        };
        let state = StoredLease {
            last_token,
            transitions,
            term,
            forgotten,
        };
        Ok((lease, state))
    }
}

/// A term's fields read back.
fn stored_term(lease: &str, fields: TermFields) -> Result<StoredTerm, StateError> {
    let (token, holder, ttl_ms, digest, released, flags, wall_deadline_ms) = fields;
    Ok(StoredTerm {
        token,
        holder,
        ttl_ms,
        lease_id_sha256: hex::decode32(&digest).ok_or_else(|| StateError::MalformedDigest {
            lease: lease.to_owned(),
        })?,
        released,
        granted_quiet: flags & GRANTED_QUIET != 0,
        released_quiet: flags & RELEASED_QUIET != 0,
        wall_deadline_ms,
    })
}

/// The `snapshot` key's value.
#[derive(Serialize, Deserialize)]
struct Pointer {
    generation: u64,
    chunks: u64,
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

/// How big the journal lets things grow.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// A snapshot is taken once this many records were logged since the
    /// last one, and at least as many as there are leases (so a snapshot's
    /// cost per record logged is bounded).
    pub snapshot_after: usize,
    /// About how many bytes of records one snapshot chunk holds.
    pub chunk_bytes: usize,
    /// Most records waiting for the writer. Past it a grant fails (the
    /// member stays primary) and a lazy change (renewal, release) is
    /// written later from the cached state.
    pub queue: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            snapshot_after: 10_000,
            chunk_bytes: 256 * 1024,
            queue: 16 * 1024,
        }
    }
}

/// About the bytes of a record besides its lease name and holder (the
/// numbers, the digest, the punctuation).
const RECORD_OVERHEAD: usize = 110;

/// Most records in one log entry.
const ENTRY_RECORDS: usize = 1000;

/// About the most bytes in one log entry (etcd refuses requests over
/// 1.5 MiB by default; a record is under 1 KiB: names are bounded).
const ENTRY_BYTES: usize = 256 * 1024;

/// Log entries read per request when a member takes over (each about
/// [`ENTRY_BYTES`] at most).
const LOAD_PAGE: i64 = 64;

/// The keys under a cluster's prefix.
#[derive(Clone)]
struct Keys {
    prefix: Vec<u8>,
}

impl Keys {
    fn key(&self, rest: &str) -> Vec<u8> {
        [self.prefix.as_slice(), rest.as_bytes()].concat()
    }

    fn pointer(&self) -> Vec<u8> {
        self.key("snapshot")
    }

    fn log(&self, seq: u64) -> Vec<u8> {
        self.key(&format!("log/{seq:020}"))
    }

    fn snapshot(&self, generation: u64) -> Vec<u8> {
        self.key(&format!("snap/{generation:020}/"))
    }

    fn chunk(&self, generation: u64, chunk: u64) -> Vec<u8> {
        self.key(&format!("snap/{generation:020}/{chunk:08}"))
    }
}

/// What etcd held when a member took over.
pub struct Loaded {
    state: StoredState,
    next_seq: u64,
}

impl Loaded {
    /// Leases not loaded (forgotten, or never granted) continue above this.
    pub fn forgotten_above(&self) -> u64 {
        self.state.forgotten_above()
    }

    /// Every lease, for the lease store to restore.
    pub fn records(&self) -> Vec<LeaseRecord> {
        self.state.records()
    }
}

/// Reads the lease state under `prefix`: the whole snapshot, then every
/// log entry over it, in order. Only a primary writes there, and a
/// deposed one's writes fail their comparison once another member won, so
/// the reads of a member that just won see one unchanging state.
pub async fn load(client: &EtcdClient, prefix: &[u8]) -> Result<Loaded, StateError> {
    let keys = Keys {
        prefix: prefix.to_vec(),
    };
    let mut state = StoredState::default();
    let mut apply = |what: &'static str, value: &[u8]| -> Result<(), StateError> {
        let records: Vec<OwnedRecord> =
            serde_json::from_slice(value).map_err(|why| StateError::Unreadable { what, why })?;
        for r in records {
            let (lease, stored) = r.into_parts()?;
            state.apply(lease, stored);
        }
        Ok(())
    };
    // The layout before the log kept a key per lease: starting from nothing
    // beside it would issue its tokens again.
    let (legacy, _) = client
        .get_range(&keys.key("leases/"), &keys.key("leases0"), 1)
        .await?;
    if !legacy.is_empty() {
        return Err(StateError::OlderLayout(
            String::from_utf8_lossy(&keys.key("leases/")).into_owned(),
        ));
    }
    let mut next_seq = 0;
    if let Some(kv) = client.get(&keys.pointer()).await? {
        let pointer: Pointer =
            serde_json::from_slice(&kv.value).map_err(|why| StateError::Unreadable {
                what: "the snapshot pointer",
                why,
            })?;
        // One chunk per request: each answer stays small.
        for chunk in 0..pointer.chunks {
            let kv = client
                .get(&keys.chunk(pointer.generation, chunk))
                .await?
                .ok_or(StateError::MissingChunk {
                    generation: pointer.generation,
                    chunk,
                    chunks: pointer.chunks,
                })?;
            apply("a snapshot chunk", &kv.value)?;
        }
        next_seq = pointer.generation;
    }
    // The log from the snapshot's generation on, in pages ("log0" is where
    // "log/" ends).
    let log = keys.key("log/");
    let end = keys.key("log0");
    let mut from = keys.log(next_seq);
    loop {
        let (entries, more) = client.get_range(&from, &end, LOAD_PAGE).await?;
        for kv in &entries {
            let seq: u64 = std::str::from_utf8(&kv.key[log.len()..])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| StateError::UnexpectedKey(kv.key.clone()))?;
            apply("a log entry", &kv.value)?;
            let after = seq.checked_add(1).ok_or(StateError::LogFull)?;
            next_seq = next_seq.max(after);
        }
        match entries.last() {
            Some(last) if more => from = [last.key.as_slice(), b"\0"].concat(),
            _ => break,
        }
    }
    Ok(Loaded { state, next_seq })
}

/// The lease store's journal on a cluster's primary.
pub struct EtcdJournal {
    cache: Arc<Mutex<BTreeMap<String, StoredLease>>>,
    /// Leases whose lazy change found the queue full: the writer writes
    /// their cached state later. Lock order: cache, then this.
    spilled: Arc<Mutex<BTreeSet<String>>>,
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
    /// continuing what [`load`] read there.
    pub fn start(
        client: EtcdClient,
        prefix: Vec<u8>,
        election: Election,
        loaded: Loaded,
        limits: Limits,
    ) -> Self {
        Self::start_with(client, prefix, election, loaded, limits, None)
    }

    /// [`EtcdJournal::start`], its log entries sent through `committer`
    /// (one transaction with other shards' entries) when given.
    pub fn start_with(
        client: EtcdClient,
        prefix: Vec<u8>,
        election: Election,
        loaded: Loaded,
        limits: Limits,
        committer: Option<Committer>,
    ) -> Self {
        let cache = Arc::new(Mutex::new(loaded.state.into_leases()));
        let spilled = Arc::new(Mutex::new(BTreeSet::new()));
        let (tx, rx) = mpsc::channel(limits.queue.max(1));
        let state = Arc::new(Failure::default());
        let writer = Writer {
            client,
            committer,
            keys: Keys { prefix },
            election,
            cache: cache.clone(),
            spilled: spilled.clone(),
            state: state.clone(),
            limits,
            next_seq: loaded.next_seq,
            since_snapshot: 0,
            snapshotting: Arc::new(AtomicBool::new(false)),
        };
        tokio::spawn(writer.run(rx));
        Self {
            cache,
            spilled,
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
        let mut cache = lock(&self.cache);
        // A lease is kept only once a change was written for it.
        let before = cache.get(lease).cloned();
        let mut changed = before.clone().unwrap_or_default();
        if !change(&mut changed) {
            return Ok(());
        }
        let write = Write::new(lease, changed.clone(), ack);
        cache.insert(lease.to_owned(), changed);
        // Sent under the cache's lock, so the queue's order is the order
        // of the changes.
        match self.tx.try_send(write) {
            Ok(()) => Ok(()),
            // A lazy change is not lost: the cache holds it, and the writer
            // writes the lease's state once it catches up.
            Err(mpsc::error::TrySendError::Full(w)) if w.ack.is_none() => {
                lock(&self.spilled).insert(w.lease);
                Ok(())
            }
            // A grant (or release) fails alone; the member stays primary,
            // and the cache goes back to what was written (a refused grant
            // must not reach the next snapshot).
            Err(_) => {
                match before {
                    Some(before) => cache.insert(lease.to_owned(), before),
                    None => cache.remove(lease),
                };
                Err(JournalError("the etcd write queue is full".into()))
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Journal for EtcdJournal {
    fn persist_grant(&self, record: GrantRecord) -> JournalFuture {
        let (ack, done) = oneshot::channel();
        let lease = record.lease.clone();
        let record = crate::journal::record::Record::from(record);
        let queued = self.queue(&lease, Some(ack), |stored| {
            crate::lease::slot::record_into(stored, &record)
        });
        Box::pin(async move {
            queued?;
            done.await
                .unwrap_or_else(|_| Err(JournalError("the etcd writer stopped".into())))
        })
    }

    fn record_renew(&self, lease: &str, token: u64, ttl_ms: u64, wall_ms: u64) -> bool {
        self.queue(lease, None, |stored| stored.renew(token, ttl_ms, wall_ms))
            .is_ok()
    }

    fn persist_release(&self, lease: &str, token: u64, quiet: bool) -> JournalFuture {
        let (ack, done) = oneshot::channel();
        let mut changed = false;
        let queued = self.queue(lease, Some(ack), |stored| {
            changed = stored.release(token, quiet);
            changed
        });
        Box::pin(async move {
            queued?;
            if !changed {
                // Released already (or never written): nothing to wait for.
                return Ok(());
            }
            done.await
                .unwrap_or_else(|_| Err(JournalError("the etcd writer stopped".into())))
        })
    }

    fn record_forget(&self, lease: &str, last_token: u64) {
        if self.state.is_failed() {
            return;
        }
        // The record is sent, the lease dropped from the cache and the mark
        // raised there in one step under the cache's lock, so a snapshot
        // sees either the lease or the mark above it, never neither.
        let mut cache = lock(&self.cache);
        let mut gone = cache.get(lease).cloned().unwrap_or_default();
        gone.forget(last_token);
        let mark_above = gone.last_token;
        let write = Write::new(lease, gone, None);
        // A full queue: the lease stays in the cache and so in etcd, which
        // is safe (this store's mark is above it already): after a failover
        // it is simply kept.
        if self.tx.try_send(write).is_ok() {
            cache.remove(lease);
            let mark = cache
                .entry(String::new())
                .or_insert_with(|| StoredLease::forgotten_mark(0));
            mark.last_token = crate::journal::record::forgotten_above(mark.last_token, mark_above);
        }
    }

    fn is_healthy(&self) -> bool {
        !self.state.is_failed()
    }
}

/// The task that writes the log, and starts snapshots.
struct Writer {
    client: EtcdClient,
    /// Where log entries go when the member leads several shards.
    committer: Option<Committer>,
    keys: Keys,
    election: Election,
    cache: Arc<Mutex<BTreeMap<String, StoredLease>>>,
    spilled: Arc<Mutex<BTreeSet<String>>>,
    state: Arc<Failure>,
    limits: Limits,
    next_seq: u64,
    since_snapshot: usize,
    snapshotting: Arc<AtomicBool>,
}

impl Writer {
    fn compare(&self) -> [Compare; 1] {
        [Compare::CreateRevision(
            self.election.key.clone(),
            self.election.revision,
        )]
    }

    /// Writes queued records in order, many per log entry, each entry
    /// conditional on the election.
    async fn run(mut self, mut rx: mpsc::Receiver<Write>) {
        let mut batch: Vec<Write> = Vec::new();
        loop {
            // Spilled leases are written without waiting for the queue.
            if lock(&self.spilled).is_empty() {
                match rx.recv().await {
                    Some(first) => batch.push(first.encoded()),
                    None => break,
                }
            }
            let mut bytes: usize = batch.iter().map(|w| w.record.len()).sum();
            while batch.len() < ENTRY_RECORDS && bytes < ENTRY_BYTES {
                match rx.try_recv() {
                    Ok(write) => {
                        let write = write.encoded();
                        bytes += write.record.len();
                        batch.push(write);
                    }
                    Err(_) => break,
                }
            }
            // Then spilled leases, after what was queued: their cached state
            // is at least as new.
            for write in self.take_spilled(ENTRY_RECORDS.saturating_sub(batch.len())) {
                let write = write.encoded();
                bytes += write.record.len();
                batch.push(write);
            }
            if batch.is_empty() {
                continue;
            }
            // A lease changed twice in one entry: its last state is enough.
            let mut last: HashMap<&str, usize> = HashMap::new();
            for (i, w) in batch.iter().enumerate() {
                last.insert(w.lease.as_str(), i);
            }
            let mut indices: Vec<usize> = last.into_values().collect();
            indices.sort_unstable();
            let mut entry = Vec::with_capacity(bytes + indices.len() + 1);
            entry.push(b'[');
            for (n, &i) in indices.iter().enumerate() {
                if n > 0 {
                    entry.push(b',');
                }
                entry.extend_from_slice(&batch[i].record);
            }
            entry.push(b']');
            let records = indices.len();
            let outcome = self.append(entry).await;
            match &outcome {
                Ok(()) => {
                    self.since_snapshot += records;
                    self.maybe_snapshot();
                }
                Err(why) => self.state.fail(&why.to_string()),
            }
            for w in batch.drain(..) {
                if let Some(ack) = w.ack {
                    let _ = ack.send(
                        outcome
                            .as_ref()
                            .map(|_| ())
                            .map_err(|why| JournalError(why.to_string())),
                    );
                }
            }
        }
    }

    /// Up to `most` spilled leases, each with its cached state.
    fn take_spilled(&self, most: usize) -> Vec<Write> {
        let names: Vec<String> = {
            let mut spilled = lock(&self.spilled);
            let mut names = Vec::new();
            while names.len() < most {
                match spilled.pop_first() {
                    Some(name) => names.push(name),
                    None => break,
                }
            }
            names
        };
        if names.is_empty() {
            return Vec::new();
        }
        let cache = lock(&self.cache);
        names
            .into_iter()
            .filter_map(|lease| Some(Write::new(&lease, cache.get(&lease)?.clone(), None)))
            .collect()
    }

    /// Writes one log entry.
    async fn append(&mut self, entry: Vec<u8>) -> Result<(), WriteError> {
        if self.state.is_failed() {
            return Err(WriteError::SteppedDown);
        }
        let key = self.keys.log(self.next_seq);
        // An entry is never overwritten: a number already taken fails too.
        let [election] = self.compare();
        let compare = [election, Compare::CreateRevision(key.clone(), 0)];
        let put = [Op::Put {
            key,
            value: entry,
            lease: 0,
        }];
        let succeeded = match &self.committer {
            Some(committer) => committer.txn(compare.to_vec(), put.to_vec()).await,
            None => self
                .client
                .txn(&compare, &put, &[])
                .await
                .map(|r| r.succeeded),
        };
        match succeeded {
            Ok(true) => {
                self.next_seq += 1;
                Ok(())
            }
            Ok(false) => Err(WriteError::NotPrimary { entry: true }),
            Err(EtcdError::Unavailable(e) | EtcdError::Refused(e)) => Err(WriteError::Etcd(e)),
        }
    }

    /// Starts a snapshot in the background when the log since the last one
    /// is long enough and none is under way.
    fn maybe_snapshot(&mut self) {
        let leases = lock(&self.cache).len();
        if self.since_snapshot < self.limits.snapshot_after.max(leases)
            || self.snapshotting.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.since_snapshot = 0;
        let snapshot = Snapshot {
            client: self.client.clone(),
            keys: self.keys.clone(),
            compare: self.compare(),
            cache: self.cache.clone(),
            state: self.state.clone(),
            chunk_bytes: self.limits.chunk_bytes,
            // Every entry before it is committed.
            generation: self.next_seq,
        };
        let snapshotting = self.snapshotting.clone();
        tokio::spawn(async move {
            snapshot.write().await;
            snapshotting.store(false, Ordering::Release);
        });
    }
}

/// One snapshot being written.
struct Snapshot {
    client: EtcdClient,
    keys: Keys,
    compare: [Compare; 1],
    cache: Arc<Mutex<BTreeMap<String, StoredLease>>>,
    state: Arc<Failure>,
    chunk_bytes: usize,
    generation: u64,
}

impl Snapshot {
    async fn write(self) {
        match self.chunks().await {
            Ok((chunks, leases)) => tracing::info!(
                generation = self.generation,
                chunks,
                leases,
                "lease state snapshot written to etcd"
            ),
            // The log is still whole: the next snapshot tries again.
            Err(why) => tracing::warn!(
                generation = self.generation,
                error = %why,
                "lease state snapshot not written"
            ),
        }
    }

    /// Writes every lease in chunks, then moves the pointer and deletes
    /// what the new snapshot replaces; the chunks and leases written.
    async fn chunks(&self) -> Result<(u64, usize), WriteError> {
        let mut after: Option<String> = None;
        let mut chunks = 0;
        let mut leases = 0;
        loop {
            if self.state.is_failed() {
                return Err(WriteError::SteppedDown);
            }
            // The lock is held for one chunk at a time; leases created
            // meanwhile are in log entries from the generation on.
            // The lock is held to copy one chunk's states (sized by their
            // names and holders, about what their records weigh); the JSON
            // is written after it is let go.
            let states: Vec<(String, StoredLease)> = {
                let cache = lock(&self.cache);
                let from = match &after {
                    Some(a) => Bound::Excluded(a.as_str()),
                    None => Bound::Unbounded,
                };
                let mut size = 0;
                let mut states = Vec::new();
                for (lease, state) in cache.range::<str, _>((from, Bound::Unbounded)) {
                    size += RECORD_OVERHEAD
                        + lease.len()
                        + state.term.as_ref().map_or(0, |t| t.holder.len());
                    states.push((lease.clone(), state.clone()));
                    if size >= self.chunk_bytes {
                        break;
                    }
                }
                states
            };
            let n = states.len();
            let last = states.last().map(|(lease, _)| lease.clone());
            let mut value = vec![b'['];
            for (i, (lease, state)) in states.iter().enumerate() {
                if i > 0 {
                    value.push(b',');
                }
                value.extend_from_slice(&Record::bytes(lease, state));
            }
            value.push(b']');
            let Some(last) = last else { break };
            self.put_chunk(chunks, value).await?;
            chunks += 1;
            leases += n;
            after = Some(last);
        }
        // The mark of forgotten leases once more, read after every chunk, so
        // the snapshot's mark is at least what it was when its last lease
        // was read (a forget after the generation began is in the log too).
        let mark = lock(&self.cache).get("").cloned();
        if let Some(mark) = mark {
            let mut value = vec![b'['];
            value.extend_from_slice(&Record::bytes("", &mark));
            value.push(b']');
            self.put_chunk(chunks, value).await?;
            chunks += 1;
        }
        let pointer = serde_json::to_vec(&Pointer {
            generation: self.generation,
            chunks,
        })
        .map_err(|e| WriteError::Etcd(e.to_string()))?;
        let swap = [
            Op::Put {
                key: self.keys.pointer(),
                value: pointer,
                lease: 0,
            },
            Op::DeleteRange {
                key: self.keys.log(0),
                end: self.keys.log(self.generation),
            },
            Op::DeleteRange {
                key: self.keys.key("snap/"),
                end: self.keys.snapshot(self.generation),
            },
        ];
        self.commit(&swap).await?;
        Ok((chunks, leases))
    }

    /// Writes chunk `chunk` of the snapshot being made.
    async fn put_chunk(&self, chunk: u64, value: Vec<u8>) -> Result<(), WriteError> {
        let put = [Op::Put {
            key: self.keys.chunk(self.generation, chunk),
            value,
            lease: 0,
        }];
        self.commit(&put).await
    }

    async fn commit(&self, ops: &[Op]) -> Result<(), WriteError> {
        match self.client.txn(&self.compare, ops, &[]).await {
            Ok(r) if r.succeeded => Ok(()),
            Ok(_) => {
                let why = WriteError::NotPrimary { entry: false };
                self.state.fail(&why.to_string());
                Err(why)
            }
            Err(e) => Err(WriteError::Etcd(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn records_are_compact_keep_a_digest_and_round_trip() {
        let id = b"0123456789abcdef0123456789abcdef";
        let digest: [u8; 32] = Sha256::digest(id).into();
        let state = StoredLease {
            last_token: 7,
            transitions: 3,
            term: Some(StoredTerm {
                token: 7,
                holder: "a".into(),
                ttl_ms: 5000,
                lease_id_sha256: digest,
                released: false,
                granted_quiet: true,
                released_quiet: false,
                wall_deadline_ms: 1_700_000_005_000,
            }),
            forgotten: false,
        };
        let bare = StoredLease {
            last_token: 2,
            transitions: 2,
            term: None,
            forgotten: false,
        };
        let gone = StoredLease {
            last_token: 9,
            transitions: 4,
            term: None,
            forgotten: true,
        };
        let json = serde_json::to_string(&[
            Record {
                lease: "orders",
                state: &state,
            },
            Record {
                lease: "idle",
                state: &bare,
            },
            Record {
                lease: "old",
                state: &gone,
            },
        ])
        .unwrap();
        assert_eq!(
            json,
            format!(
                r#"[["orders",7,3,[7,"a",5000,"{}",false,1,1700000005000]],["idle",2,2,null],["old",9,4,"forgotten"]]"#,
                hex::encode(&digest)
            )
        );
        assert!(!json.contains("0123456789abcdef0123456789abcdef"));
        let back: Vec<OwnedRecord> = serde_json::from_str(&json).unwrap();
        let back: Vec<(String, StoredLease)> =
            back.into_iter().map(|r| r.into_parts().unwrap()).collect();
        assert_eq!(
            back,
            [
                ("orders".to_owned(), state.clone()),
                ("idle".to_owned(), bare),
                ("old".to_owned(), gone)
            ]
        );
        assert_eq!(
            state.to_record("orders".into()).term.unwrap().lease_id,
            digest
        );
        let bad: Vec<OwnedRecord> =
            serde_json::from_str(r#"[["x",1,1,[1,"a",5,"zz",false]]]"#).unwrap();
        assert!(bad.into_iter().next().unwrap().into_parts().is_err());
        // A record written before the flags and the hint: not quiet, no hint.
        let old = format!(
            r#"["orders",7,3,[7,"a",5000,"{}",true]]"#,
            hex::encode(&digest)
        );
        let (_, old) = serde_json::from_str::<OwnedRecord>(&old)
            .unwrap()
            .into_parts()
            .unwrap();
        let t = old.term.unwrap();
        assert!(t.released && !t.granted_quiet && !t.released_quiet);
        assert_eq!(t.wall_deadline_ms, 0);
    }

    #[test]
    fn log_keys_sort_in_the_order_written() {
        let keys = Keys {
            prefix: b"/fg/".to_vec(),
        };
        assert_eq!(keys.log(42), b"/fg/log/00000000000000000042".to_vec());
        assert!(keys.log(9) < keys.log(10));
        assert!(keys.chunk(9, 3) < keys.snapshot(10));
        assert!(keys.chunk(10, 0).starts_with(&keys.snapshot(10)));
    }
}
