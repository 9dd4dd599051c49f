//! The durable journal: an append-only, checksummed log in the data directory,
//! with group commit and compaction.
//!
//! # Why a log and not an embedded database
//!
//! Measured on the 2-core development machines (ext4 on a virtual disk): one
//! 100-byte append plus `fdatasync` costs about 170 µs, while a redb 2 commit
//! of one small insert costs about 230 µs (and 500 µs for 64 inserts). A grant
//! is one small record that must be durable before it is returned, recovery is
//! one sequential scan, and batching many grants behind one `fdatasync` (group
//! commit) is natural in a single writer thread. A log does all of that in a
//! few hundred lines without a dependency; `benches/journal.rs` measures the
//! result (durable acquires per second at 1, 16 and 64 clients; recovery time
//! of 100,000 leases).
//!
//! # How it works
//!
//! One writer thread owns the file. Callers send records over a channel; the
//! thread takes everything queued, appends it in one `write`, and calls
//! `fdatasync` once if any record in the batch is waiting for durability
//! (grants). Renewals and releases are appended lazily: they ride along with
//! the next sync, and losing them is safe (the restart rule holds a live term
//! for a full TTL, and an unreleased term only delays the next holder).
//!
//! When a write or sync fails (disk full, EIO, read-only), every waiting grant
//! fails, the file is cut back to its last good length, the journal reports
//! itself unhealthy (readiness turns 503), and a probe retries once a second
//! until the disk accepts writes again.
//!
//! On open, the log is read front to back. A bad frame at the tail (a torn
//! write) is cut off; a bad frame followed by any valid frame means the
//! journal is corrupt, and the start fails rather than silently losing tokens.
//! When the log grows past a threshold the writer rewrites it as one state
//! record per lease (compaction): it replays the log from disk, writes the
//! result to a temporary file, syncs it, and renames it over the log. The
//! writer keeps no copy of the lease state between compactions: the lease
//! store holds the only one in memory, so a held lease costs memory once.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::record::{read_frame, Frame, LeaseRecord, Record, FILE_MAGIC};
use super::{GrantRecord, Journal, JournalError, JournalFuture};

/// The log's file name in the data directory.
pub const JOURNAL_FILE: &str = "journal.log";
const COMPACT_TMP: &str = "journal.log.compact";
const LOCK_FILE: &str = "LOCK";

/// Tuning of the file journal.
#[derive(Clone, Debug)]
pub struct FileJournalOptions {
    /// Compact once the log is this large and at least 4 times its size after
    /// the last compaction.
    pub compact_min_bytes: u64,
    /// How often an unhealthy journal retries the disk.
    pub probe_interval_ms: u64,
}

impl Default for FileJournalOptions {
    fn default() -> Self {
        Self {
            compact_min_bytes: 16 * 1024 * 1024,
            probe_interval_ms: 1000,
        }
    }
}

/// A test seam: makes the writer's disk operations fail as a full disk would.
#[derive(Clone, Debug, Default)]
pub struct FaultInjector(Arc<AtomicU8>);

impl FaultInjector {
    /// `true`: every write and sync fails with ENOSPC until set back.
    pub fn set_disk_full(&self, full: bool) {
        self.0.store(u8::from(full), Ordering::Release);
    }

    fn check(&self) -> io::Result<()> {
        if self.0.load(Ordering::Acquire) == 1 {
            Err(io::Error::from_raw_os_error(28)) // ENOSPC
        } else {
            Ok(())
        }
    }
}

type Ack = oneshot::Sender<Result<(), JournalError>>;

struct Command {
    record: Record,
    /// Present for records that must be durable before the caller goes on.
    ack: Option<Ack>,
}

/// The durable journal; see the module docs.
pub struct FileJournal {
    tx: mpsc::Sender<Command>,
    healthy: Arc<AtomicBool>,
    faults: FaultInjector,
}

impl std::fmt::Debug for FileJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileJournal")
            .field("healthy", &self.healthy.load(Ordering::Relaxed))
            .finish()
    }
}

/// What opening a journal found.
#[derive(Debug)]
pub struct Recovered {
    /// Every lease ever granted, with its latest term.
    pub leases: Vec<LeaseRecord>,
    /// Bytes cut from a torn tail (0 if the log ended cleanly).
    pub torn_bytes: u64,
}

fn err(context: &str, path: &Path, e: impl std::fmt::Display) -> JournalError {
    JournalError(format!("{context} {}: {e}", path.display()))
}

impl FileJournal {
    /// Opens (or creates) the journal in `dir`, replays it, and starts the
    /// writer thread.
    pub fn open(
        dir: &Path,
        options: FileJournalOptions,
    ) -> Result<(Self, Recovered), JournalError> {
        std::fs::create_dir_all(dir).map_err(|e| err("cannot create data directory", dir, e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| err("cannot open", &lock_path, e))?;
        lock.try_lock().map_err(|_| {
            JournalError(format!(
                "data directory {} is in use by another fencegate",
                dir.display()
            ))
        })?;

        let path = dir.join(JOURNAL_FILE);
        let _ = std::fs::remove_file(dir.join(COMPACT_TMP));
        let mut file = open_log(&path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| err("cannot read", &path, e))?;
        if bytes.is_empty() {
            file.write_all(FILE_MAGIC)
                .and_then(|()| file.sync_all())
                .map_err(|e| err("cannot initialise", &path, e))?;
            sync_dir(dir).map_err(|e| err("cannot sync", dir, e))?;
            bytes.extend_from_slice(FILE_MAGIC);
        }
        let (state, good_len) = replay(&bytes, &path)?;
        let torn_bytes = bytes.len() as u64 - good_len;
        if torn_bytes > 0 {
            tracing::warn!(
                journal = %path.display(),
                offset = good_len,
                bytes = torn_bytes,
                "journal tail torn (an unfinished write): cutting it off"
            );
            file.set_len(good_len)
                .and_then(|()| file.sync_all())
                .map_err(|e| err("cannot cut the torn tail of", &path, e))?;
        }
        file.seek(SeekFrom::Start(good_len))
            .map_err(|e| err("cannot seek", &path, e))?;

        let leases: Vec<LeaseRecord> = state.values().cloned().collect();
        let (tx, rx) = mpsc::channel();
        let healthy = Arc::new(AtomicBool::new(true));
        let faults = FaultInjector::default();
        let writer = Writer {
            dir: dir.to_owned(),
            path,
            file,
            len: good_len,
            compacted_len: good_len,
            healthy: healthy.clone(),
            faults: faults.clone(),
            options,
            _lock: lock,
        };
        std::thread::Builder::new()
            .name("fencegate-journal".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| JournalError(format!("cannot start the journal writer: {e}")))?;
        Ok((
            Self {
                tx,
                healthy,
                faults,
            },
            Recovered { leases, torn_bytes },
        ))
    }

    /// The fault-injection seam of this journal (for tests).
    pub fn faults(&self) -> FaultInjector {
        self.faults.clone()
    }

    fn send_lazy(&self, record: Record) {
        // A closed channel means the writer is gone; the record is not needed
        // for safety (see the module docs), so it is dropped.
        let _ = self.tx.send(Command { record, ack: None });
    }
}

impl Journal for FileJournal {
    fn persist_grant(&self, record: GrantRecord) -> JournalFuture {
        let (ack, done) = oneshot::channel();
        let command = Command {
            record: Record::Grant {
                lease: record.lease,
                token: record.token,
                holder: record.holder,
                ttl_ms: record.ttl_ms,
                lease_id: record.lease_id,
            },
            ack: Some(ack),
        };
        let sent = self.tx.send(command).is_ok();
        Box::pin(async move {
            if !sent {
                return Err(JournalError("the journal writer has stopped".into()));
            }
            done.await
                .unwrap_or_else(|_| Err(JournalError("the journal writer has stopped".into())))
        })
    }

    fn record_renew(&self, lease: &str, token: u64, ttl_ms: u64) {
        self.send_lazy(Record::Renew {
            lease: lease.to_owned(),
            token,
            ttl_ms,
        });
    }

    fn record_release(&self, lease: &str, token: u64) {
        self.send_lazy(Record::Release {
            lease: lease.to_owned(),
            token,
        });
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }
}

fn open_log(path: &Path) -> Result<File, JournalError> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        // The journal holds lease ids: readable by fencegate's user only.
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    options.open(path).map_err(|e| err("cannot open", path, e))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Folds every valid frame of `bytes`; returns the state and the length of
/// the valid prefix. A bad frame with any valid frame after it is corruption.
fn replay(bytes: &[u8], path: &Path) -> Result<(HashMap<String, LeaseRecord>, u64), JournalError> {
    if bytes.len() < FILE_MAGIC.len() || &bytes[..FILE_MAGIC.len()] != FILE_MAGIC {
        return Err(JournalError(format!(
            "{} is not a fencegate journal (bad header); refusing to start",
            path.display()
        )));
    }
    let mut state: HashMap<String, LeaseRecord> = HashMap::new();
    let mut at = FILE_MAGIC.len();
    while at < bytes.len() {
        match read_frame(&bytes[at..]) {
            Frame::Record(record, len) => {
                if let Some(lease) = record.lease() {
                    let entry = state
                        .entry(lease.to_owned())
                        .or_insert_with(|| LeaseRecord {
                            lease: lease.to_owned(),
                            ..LeaseRecord::default()
                        });
                    record.apply(entry);
                }
                at += len;
            }
            Frame::Invalid(why) => {
                if let Some(next) = find_valid_frame(&bytes[at + 1..]) {
                    return Err(JournalError(format!(
                        "{} is corrupt: bad record at byte {at} ({why}) followed by a valid record at byte {}; \
                         refusing to start rather than lose fencing tokens (restore the file or move it away)",
                        path.display(),
                        at + 1 + next
                    )));
                }
                break;
            }
        }
    }
    Ok((state, at as u64))
}

/// The offset of the first position in `bytes` where a valid frame starts.
fn find_valid_frame(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len()).find(|&i| {
        bytes[i] == super::record::FRAME_MAGIC
            && matches!(read_frame(&bytes[i..]), Frame::Record(..))
    })
}

struct Writer {
    dir: PathBuf,
    path: PathBuf,
    file: File,
    /// Length of the log that was written successfully.
    len: u64,
    /// Length right after the last compaction (or open).
    compacted_len: u64,
    healthy: Arc<AtomicBool>,
    faults: FaultInjector,
    options: FileJournalOptions,
    /// Held for the writer's life: one fencegate per data directory.
    _lock: File,
}

/// Most records taken into one batch.
const MAX_BATCH: usize = 4096;

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Command>) {
        let probe = Duration::from_millis(self.options.probe_interval_ms);
        let mut buf = Vec::with_capacity(64 * 1024);
        let mut batch = Vec::with_capacity(256);
        loop {
            let first = if self.healthy.load(Ordering::Acquire) {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(probe)
            };
            match first {
                Ok(cmd) => batch.push(cmd),
                Err(RecvTimeoutError::Timeout) => {
                    batch.push(Command {
                        record: Record::Noop,
                        ack: None,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(cmd) => batch.push(cmd),
                    Err(_) => break,
                }
            }
            buf.clear();
            for cmd in &batch {
                cmd.record.encode_frame(&mut buf);
            }
            // An unhealthy journal syncs every batch, so a probe proves the
            // disk takes durable writes again.
            let sync =
                !self.healthy.load(Ordering::Acquire) || batch.iter().any(|c| c.ack.is_some());
            match self.append(&buf, sync) {
                Ok(()) => {
                    if !self.healthy.swap(true, Ordering::AcqRel) {
                        tracing::warn!(journal = %self.path.display(), "journal writable again; lease store ready");
                    }
                    for cmd in batch.drain(..) {
                        if let Some(ack) = cmd.ack {
                            let _ = ack.send(Ok(()));
                        }
                    }
                    self.maybe_compact();
                }
                Err(e) => {
                    if self.healthy.swap(false, Ordering::AcqRel) {
                        tracing::error!(journal = %self.path.display(), error = %e, "journal cannot persist; refusing grants until it can");
                    }
                    self.cut_back();
                    for cmd in batch.drain(..) {
                        if let Some(ack) = cmd.ack {
                            let _ =
                                ack.send(Err(JournalError(format!("journal write failed: {e}"))));
                        }
                    }
                }
            }
        }
        let _ = self.file.sync_data();
    }

    fn append(&mut self, buf: &[u8], sync: bool) -> io::Result<()> {
        self.faults.check()?;
        self.file.write_all(buf)?;
        if sync {
            self.faults.check()?;
            self.file.sync_data()?;
        }
        self.len += buf.len() as u64;
        Ok(())
    }

    /// Drops whatever part of a failed batch reached the file.
    fn cut_back(&mut self) {
        let len = self.len;
        if let Err(e) = self
            .file
            .set_len(len)
            .and_then(|()| self.file.seek(SeekFrom::Start(len)).map(|_| ()))
        {
            tracing::warn!(journal = %self.path.display(), error = %e, "cannot cut a failed write back; will retry");
        }
    }

    fn maybe_compact(&mut self) {
        if self.len < self.options.compact_min_bytes
            || self.len < self.compacted_len.saturating_mul(4)
        {
            return;
        }
        match self.compact() {
            Ok((len, leases)) => {
                tracing::info!(journal = %self.path.display(), before = self.len, after = len, leases, "journal compacted");
                self.len = len;
                self.compacted_len = len;
            }
            Err(e) => {
                // The old log is intact; try again after the next growth.
                tracing::warn!(journal = %self.path.display(), error = %e, "journal compaction failed");
                self.compacted_len = self.len;
                let _ = std::fs::remove_file(self.dir.join(COMPACT_TMP));
            }
        }
    }

    /// Rewrites the log as one state record per lease; returns the new
    /// length and the number of leases.
    fn compact(&mut self) -> io::Result<(u64, usize)> {
        self.faults.check()?;
        let tmp_path = self.dir.join(COMPACT_TMP);
        // Everything up to `len` was written and synced by this writer.
        let mut bytes = std::fs::read(&self.path)?;
        bytes.truncate(usize::try_from(self.len).unwrap_or(usize::MAX));
        let (state, good_len) = replay(&bytes, &self.path).map_err(|e| io::Error::other(e.0))?;
        if good_len != self.len {
            return Err(io::Error::other(format!(
                "the log reads back {good_len} good bytes of {}",
                self.len
            )));
        }
        drop(bytes);
        let leases = state.len();
        let mut buf = Vec::with_capacity(leases * 96 + FILE_MAGIC.len());
        buf.extend_from_slice(FILE_MAGIC);
        for lease in state.into_values() {
            Record::State(lease).encode_frame(&mut buf);
        }
        let mut tmp = open_log(&tmp_path).map_err(|e| io::Error::other(e.0))?;
        tmp.set_len(0)?;
        tmp.write_all(&buf)?;
        tmp.sync_all()?;
        std::fs::rename(&tmp_path, &self.path)?;
        sync_dir(&self.dir)?;
        tmp.seek(SeekFrom::Start(buf.len() as u64))?;
        self.file = tmp;
        Ok((buf.len() as u64, leases))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("fencegate-journal-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn grant(lease: &str, token: u64) -> GrantRecord {
        GrantRecord {
            lease: lease.into(),
            token,
            holder: "h".into(),
            ttl_ms: 1000,
            lease_id: [b'0'; 32],
        }
    }

    #[tokio::test]
    async fn grants_survive_reopen_and_compaction() {
        let dir = temp_dir("reopen");
        let options = FileJournalOptions {
            compact_min_bytes: 4096,
            ..FileJournalOptions::default()
        };
        {
            let (j, rec) = FileJournal::open(&dir, options.clone()).unwrap();
            assert!(rec.leases.is_empty());
            for token in 1..=200 {
                j.persist_grant(grant("a", token)).await.unwrap();
                j.record_renew("a", token, 2000);
            }
            j.persist_grant(grant("b", 1)).await.unwrap();
            j.record_release("b", 1);
            // One more durable record so the lazy ones are surely written.
            j.persist_grant(grant("c", 1)).await.unwrap();
        }
        // The writer thread has released the lock once it drained.
        let (j, rec) = loop {
            match FileJournal::open(&dir, options.clone()) {
                Ok(opened) => break opened,
                Err(e) if e.0.contains("in use") => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("{e}"),
            }
        };
        let mut leases = rec.leases;
        leases.sort_by(|x, y| x.lease.cmp(&y.lease));
        assert_eq!(leases.len(), 3);
        assert_eq!((leases[0].last_token, leases[0].transitions), (200, 200));
        assert_eq!(leases[0].term.as_ref().unwrap().ttl_ms, 2000);
        assert!(leases[1].term.as_ref().unwrap().released);
        let size = std::fs::metadata(dir.join(JOURNAL_FILE)).unwrap().len();
        assert!(size < 4096 * 2, "the log was compacted ({size} bytes)");
        drop(j);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_full_disk_fails_grants_and_recovers() {
        let dir = temp_dir("full");
        let (j, _) = FileJournal::open(
            &dir,
            FileJournalOptions {
                probe_interval_ms: 10,
                ..FileJournalOptions::default()
            },
        )
        .unwrap();
        j.persist_grant(grant("a", 1)).await.unwrap();
        j.faults().set_disk_full(true);
        assert!(j.persist_grant(grant("a", 2)).await.is_err());
        assert!(!j.is_healthy());
        j.faults().set_disk_full(false);
        // The probe brings it back without any caller.
        for _ in 0..500 {
            if j.is_healthy() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(j.is_healthy());
        j.persist_grant(grant("a", 3)).await.unwrap();
        drop(j);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_journal_on_the_same_directory_is_refused() {
        let dir = temp_dir("lock");
        let (_j, _) = FileJournal::open(&dir, FileJournalOptions::default()).unwrap();
        let e = FileJournal::open(&dir, FileJournalOptions::default()).unwrap_err();
        assert!(e.0.contains("in use"), "{e}");
    }

    #[test]
    fn replay_cuts_torn_tails_and_refuses_corruption() {
        let path = Path::new("test.log");
        let mut bytes = FILE_MAGIC.to_vec();
        for token in 1..=3 {
            Record::Release {
                lease: "a".into(),
                token,
            }
            .encode_frame(&mut bytes);
        }
        let good = bytes.len() as u64;
        let mut torn = bytes.clone();
        torn.extend_from_slice(&bytes[8..20]);
        assert_eq!(replay(&torn, path).unwrap().1, good);
        let mut zeros = bytes.clone();
        zeros.extend_from_slice(&[0; 100]);
        assert_eq!(replay(&zeros, path).unwrap().1, good);
        let mut corrupt = bytes.clone();
        corrupt[12] ^= 1;
        assert!(replay(&corrupt, path).unwrap_err().0.contains("corrupt"));
        assert!(replay(b"NOTAJRNL", path)
            .unwrap_err()
            .0
            .contains("not a fencegate journal"));
    }
}
