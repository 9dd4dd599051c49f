//! What a start decides about a journal it finds: its bytes and its meta
//! file in, the leases to restore and the floors to keep out. The file
//! journal reads the files, calls these, and writes what they decide.
//!
//! The rules, in the order a start applies them:
//! - a log that starts with neither magic is not a journal: refuse;
//! - replay every valid frame; past the header's durable length a bad
//!   frame is a torn write (never acknowledged), before it a bad frame
//!   followed by any valid frame is corruption: refuse rather than guess;
//! - the log is intact when the meta file names it (its identity), its
//!   tokens reach the meta file's reserved floor, its header is readable and
//!   the valid records reach the durable length; then whatever follows is
//!   cut off and the leases continue as recorded;
//! - otherwise acknowledged records may be lost ([`after_loss`]): every
//!   lease continues above the highest floor known and every recovered term
//!   is ended, so no token is issued again and no ended term is revived.
//!
//! [`open_plan`] applies them all: what a start found in, the steps to
//! take on the disk and what it recovered out.

use std::collections::HashMap;

use crate::mutant::{planted, Mutant};

use super::record::{
    self, log_image, read_frame, Frame, Header, LeaseRecord, Record, FILE_MAGIC, FILE_MAGIC_V1,
    FRAME_MAGIC, HEADER_LEN,
};

/// The log's file name in the data directory.
pub const JOURNAL_FILE: &str = "journal.log";
/// The store's meta file: it exists once the directory was initialised and
/// holds the token floor.
pub const META_FILE: &str = "store.meta";
/// The first bytes of a meta file (format version 2).
pub const META_MAGIC: &[u8; 8] = b"FGMETA02";
/// A meta file without the log's identity (before it was kept).
pub const META_MAGIC_V1: &[u8; 8] = b"FGMETA01";

/// Why a start refuses a log. The text follows the log's path in the
/// message the shell shows ("journal.log is corrupt: …").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal(pub String);

/// The store's meta file: its token floors, and which log it goes with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// No token above this was ever returned (raised before grants pass it).
    pub reserved: u64,
    /// Every lease's tokens continue above this (set when records were lost).
    pub floor: u64,
    /// The identity of the log ([`Record::Identity`]) this file was last
    /// written with (0: a log that carries none).
    pub identity: u64,
    /// The identity the log had before, also accepted: a change of identity
    /// names the new one here first, then gives it to the log, then drops
    /// the old one from here, so a crash at any point leaves the log with
    /// one of the two.
    pub previous: u64,
}

impl Meta {
    /// The file's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = META_MAGIC.to_vec();
        for field in [self.reserved, self.floor, self.identity, self.previous] {
            out.extend_from_slice(&field.to_le_bytes());
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Reads a meta file of either version (a version 1 file names no log).
    pub fn decode(b: &[u8]) -> Option<Self> {
        let fields = match b.get(..8)? {
            m if m == META_MAGIC => 4,
            m if m == META_MAGIC_V1 => 2,
            _ => return None,
        };
        let end = 8 + 8 * fields;
        if b.len() != end + 4 {
            return None;
        }
        let crc = u32::from_le_bytes(b[end..].try_into().ok()?);
        if crc32fast::hash(&b[..end]) != crc {
            return None;
        }
        let field = |i: usize| -> u64 {
            u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"))
        };
        Some(Self {
            reserved: field(0),
            floor: field(1),
            identity: if fields == 4 { field(2) } else { 0 },
            previous: if fields == 4 { field(3) } else { 0 },
        })
    }

    /// Whether a log of identity `log` (0: none) is the one this file was
    /// last written with.
    pub fn names(&self, log: u64) -> bool {
        log == self.identity || log == self.previous
    }
}

/// What the data directory's meta file says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaFile {
    Missing,
    Corrupt,
    Found(Meta),
}

impl MetaFile {
    /// The meta file's bytes read (`None`: there is no such file).
    pub fn read(bytes: Option<&[u8]>) -> Self {
        match bytes {
            None => MetaFile::Missing,
            Some(b) => Meta::decode(b).map_or(MetaFile::Corrupt, MetaFile::Found),
        }
    }
}

/// What the start of a log says about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// A version 1 log: no header.
    V1,
    /// A version 2 log with a readable header.
    V2(Header),
    /// A version 2 log whose header is damaged or cut off.
    V2Damaged,
}

/// The log's format, and where its records begin.
pub fn read_start(bytes: &[u8]) -> Result<(usize, Start), Refusal> {
    if bytes.starts_with(FILE_MAGIC_V1) {
        return Ok((FILE_MAGIC_V1.len(), Start::V1));
    }
    let magic = bytes.len().min(FILE_MAGIC.len());
    if bytes[..magic] != FILE_MAGIC[..magic] {
        return Err(Refusal(
            "is not a fencegate journal (bad header); refusing to start".to_owned(),
        ));
    }
    if bytes.len() < HEADER_LEN {
        // Cut inside its header: whatever it held is gone.
        return Ok((bytes.len(), Start::V2Damaged));
    }
    match Header::read(bytes) {
        Some(header) => Ok((HEADER_LEN, Start::V2(header))),
        None => Ok((HEADER_LEN, Start::V2Damaged)),
    }
}

/// The valid records of a log, folded.
#[derive(Debug)]
pub struct Folded {
    pub leases: HashMap<String, LeaseRecord>,
    /// The length of the valid prefix.
    pub good_len: u64,
    /// Leases not in the log continue above this (forgotten ones).
    pub forgotten_above: u64,
    /// The last identity the log was given (0: none).
    pub identity: u64,
}

/// Folds every valid frame of `bytes` from `start`, in the order they were
/// written. A bad frame before `torn_from` with any valid frame after it is
/// corruption.
pub fn replay(bytes: &[u8], start: usize, torn_from: u64) -> Result<Folded, Refusal> {
    let mut state: HashMap<String, LeaseRecord> = HashMap::new();
    let mut forgotten_above = 0;
    let mut identity = 0;
    let mut at = start;
    while at < bytes.len() {
        match read_frame(&bytes[at..]) {
            Frame::Record(record, len) => {
                if let Record::Identity { id } = record {
                    identity = id;
                } else if let Some((lease, last_token)) = record.forgets() {
                    state.remove(lease);
                    forgotten_above = record::forgotten_above(forgotten_above, last_token);
                } else if let Some(lease) = record.lease() {
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
                if (at as u64) < torn_from {
                    if let Some(next) = find_valid_frame(&bytes[at + 1..]) {
                        return Err(Refusal(format!(
                            "is corrupt: bad record at byte {at} ({why}) followed by a valid \
                             record at byte {}; refusing to start rather than lose fencing \
                             tokens (restore the file or move it away)",
                            at + 1 + next
                        )));
                    }
                }
                break;
            }
        }
    }
    Ok(Folded {
        leases: state,
        good_len: at as u64,
        forgotten_above,
        identity,
    })
}

/// The offset of the first position in `bytes` where a valid frame starts.
fn find_valid_frame(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len())
        .find(|&i| bytes[i] == FRAME_MAGIC && matches!(read_frame(&bytes[i..]), Frame::Record(..)))
}

/// The records of a log, replayed.
#[derive(Debug)]
pub struct Replayed {
    pub leases: HashMap<String, LeaseRecord>,
    /// Where the valid records end.
    pub good_len: u64,
    /// Bytes past them.
    pub torn_bytes: u64,
    /// The highest token of any lease, forgotten ones too.
    pub max_token: u64,
    /// Leases not in the log continue above this (forgotten ones).
    pub forgotten_above: u64,
    /// The log's identity (its last [`Record::Identity`]; 0: none).
    pub identity: u64,
}

/// Reads a log with bytes: its start, and its records replayed. Past the
/// durable length nothing was acknowledged: a bad frame there is a torn
/// write (a power loss may leave zeros before later, valid bytes), never
/// corruption.
pub fn read_log(bytes: &[u8]) -> Result<(Start, Replayed), Refusal> {
    let (offset, start) = read_start(bytes)?;
    let torn_from = match start {
        Start::V2(h) => h.durable_len,
        Start::V1 | Start::V2Damaged => u64::MAX,
    };
    let folded = replay(bytes, offset, torn_from)?;
    let replayed = Replayed {
        max_token: folded
            .leases
            .values()
            .map(|l| l.last_token)
            .fold(folded.forgotten_above, u64::max),
        forgotten_above: folded.forgotten_above,
        identity: folded.identity,
        leases: folded.leases,
        good_len: folded.good_len,
        torn_bytes: bytes.len() as u64 - folded.good_len,
    };
    Ok((start, replayed))
}

/// Why acknowledged records may be missing from a log ([`intact`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Loss {
    /// The meta file was last written with another log.
    OtherLog { identity: u64, named: u64 },
    /// The log's tokens end far below the meta file's floor.
    BelowFloor { max_token: u64, reserved: u64 },
    /// The header is damaged or cut off.
    HeaderDamaged,
    /// The valid records end before what was synced.
    Torn { good_len: u64, durable_len: u64 },
    /// The directory was restored from a backup
    /// ([`OpenSettings::restored_from_backup`]).
    RestoredFromBackup { bump: u64 },
    /// The log was gone, and the start was told to go on without it
    /// ([`OpenSettings::accept_journal_loss`]).
    Accepted { what: &'static str },
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::OtherLog { identity, named } => write!(
                f,
                "it is not the log {META_FILE} was last written with (its identity is {identity:016x}, \
                 {META_FILE} names {named:016x}): it is an older copy, or another store's"
            ),
            Self::BelowFloor {
                max_token,
                reserved,
            } => write!(
                f,
                "its highest token is {max_token}, far below the floor of {reserved} in {META_FILE}: \
                 it is an older copy"
            ),
            Self::HeaderDamaged => f.write_str("its header is damaged or cut off"),
            Self::Torn {
                good_len,
                durable_len,
            } => write!(
                f,
                "the valid records end at byte {good_len}, but {durable_len} bytes were synced"
            ),
            Self::RestoredFromBackup { bump } => write!(
                f,
                "the data directory was restored from a backup (--restored-from-backup {bump})"
            ),
            Self::Accepted { what } => write!(
                f,
                "{JOURNAL_FILE} was {what} (started with --accept-journal-loss)"
            ),
        }
    }
}

impl std::error::Error for Loss {}

/// Whether the log holds every acknowledged record: then its header (`None`
/// for a version 1 log, which has none); else why records may be missing.
/// `floor_block` is how far ahead of the highest token the meta file's
/// floor is raised.
pub fn intact(
    start: Start,
    meta: &MetaFile,
    replayed: &Replayed,
    floor_block: u64,
) -> Result<Option<Header>, Loss> {
    // Whatever the log's version: a log other than the one the meta file
    // was last written with is an older copy put back (or another store's);
    // and the floor is raised only a block ahead of the highest token, so a
    // log whose tokens end far below it is an older copy too.
    if let MetaFile::Found(m) = meta {
        if !m.names(replayed.identity) {
            return Err(Loss::OtherLog {
                identity: replayed.identity,
                named: m.identity,
            });
        }
        if m.reserved > replayed.max_token.saturating_add(2 * floor_block) {
            return Err(Loss::BelowFloor {
                max_token: replayed.max_token,
                reserved: m.reserved,
            });
        }
    }
    let header = match start {
        Start::V1 => return Ok(None),
        Start::V2Damaged => return Err(Loss::HeaderDamaged),
        Start::V2(header) => header,
    };
    if replayed.good_len < header.durable_len && !planted(Mutant::TornTailTrusted) {
        return Err(Loss::Torn {
            good_len: replayed.good_len,
            durable_len: header.durable_len,
        });
    }
    Ok(Some(header))
}

/// The floors of an intact log: every lease continues above `floor`, and
/// the meta file's reserved floor stays (`Some`) or is rebuilt from the log
/// (`None`: a missing meta file, a version 1 log, a header floor above the
/// meta file's).
pub fn intact_floors(
    header: Option<Header>,
    meta: &MetaFile,
    max_token: u64,
) -> (u64, Option<u64>) {
    let header_floor = header.map_or(0, |h| h.token_floor);
    let floor = match meta {
        MetaFile::Found(m) => m.floor.max(header_floor),
        _ => header_floor,
    };
    let reserved = match meta {
        MetaFile::Found(m) if m.reserved >= max_token && m.floor >= header_floor => {
            Some(m.reserved)
        }
        _ => None,
    };
    (floor, reserved)
}

/// A log that may have lost acknowledged records: no token may be issued
/// again, and no recovered term may come back to life (a later one may
/// have been lost). Every lease continues above the highest token known,
/// plus `bump` (tokens a restored backup may not know of); every recovered
/// term is ended, and not quiet (its writes may still be at the storage).
/// Returns the new floor.
pub fn after_loss(
    leases: &mut HashMap<String, LeaseRecord>,
    max_token: u64,
    start: Start,
    meta: Meta,
    bump: u64,
) -> u64 {
    let header_floor = match start {
        Start::V2(h) => h.token_floor,
        Start::V1 | Start::V2Damaged => 0,
    };
    let floor = meta
        .reserved
        .max(meta.floor)
        .max(max_token)
        .max(header_floor)
        .saturating_add(bump);
    for lease in leases.values_mut() {
        if !planted(Mutant::TokenFloorIgnored) {
            lease.last_token = lease.last_token.max(floor);
        }
        if planted(Mutant::LostRecordsKeepTerms) {
            continue;
        }
        if let Some(term) = lease.term.as_mut() {
            // Ended, and not quiet: a later term may have been lost with
            // the records, and its writes may still be at the storage, so
            // the next start (even a quick one after this) must hold back
            // the lease's new terms for its restart window.
            term.released = true;
            term.granted_quiet = false;
            term.released_quiet = false;
        }
    }
    floor
}

/// What a start found in the data directory.
#[derive(Clone, Copy, Debug)]
pub struct Found<'a> {
    /// The log's bytes (none: the log is missing or empty).
    pub log: &'a [u8],
    /// Whether there was no log file at all (rather than an empty one).
    pub log_missing: bool,
    /// The meta file.
    pub meta: MetaFile,
}

/// How a start may treat what it found.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenSettings {
    /// How far ahead of the highest token the meta file's floor is raised.
    pub floor_block: u64,
    /// A missing or empty log beside a meta file: go on without it, every
    /// lease free and above the meta file's floor (`--accept-journal-loss`).
    pub accept_journal_loss: bool,
    /// The directory was restored from a backup that may lack this many of
    /// the tokens issued since (`--restored-from-backup`).
    pub restored_from_backup: Option<u64>,
}

/// One I/O step of a start, in the order [`open_plan`] lists them: a crash
/// between two steps leaves files the next start reads the same way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpenStep {
    /// Keep a copy of the log as found, beside it (never over an earlier
    /// copy): it may have lost acknowledged records.
    KeepDamagedCopy,
    /// Replace the log with these bytes, durably (a temporary file synced
    /// and renamed over it, the directory synced).
    WriteLog(Vec<u8>),
    /// Cut the log at this length, durably: a torn tail nobody was told of.
    CutLog(u64),
    /// Replace the meta file, durably.
    WriteMeta(Meta),
}

/// What a start recovered, for the lease store to restore.
#[derive(Debug)]
pub struct Recovered {
    /// Every lease the log holds, with its latest term, by name.
    pub leases: Vec<LeaseRecord>,
    /// Bytes cut from a torn tail (0 if the log ended cleanly).
    pub torn_bytes: u64,
    /// Every lease's tokens, known or new, continue above this.
    pub token_floor: u64,
    /// Leases the log no longer holds (forgotten ones, and names never
    /// seen) continue above this.
    pub forgotten_above: u64,
    /// Set when acknowledged records may have been lost (and how): every
    /// recovered term was ended and every lease continues above the floor.
    pub lost_records: Option<Loss>,
}

/// What a start does: the steps, then the log and meta file the journal
/// writer goes on with, and what it recovered.
#[derive(Debug)]
pub struct OpenPlan {
    pub steps: Vec<OpenStep>,
    /// The log's header once the steps are done.
    pub header: Header,
    /// The log's length once the steps are done.
    pub len: u64,
    /// The meta file's reserved floor once the steps are done.
    pub reserved: u64,
    /// The log's identity (0: none yet; the start gives it one).
    pub identity: u64,
    pub recovered: Recovered,
}

impl OpenPlan {
    /// The meta file as the journal writer goes on with it (what the steps
    /// left on the disk, or what the start's change of identity writes
    /// next).
    pub fn meta(&self) -> Meta {
        Meta {
            reserved: self.reserved,
            floor: self.header.token_floor,
            identity: self.identity,
            previous: self.identity,
        }
    }
}

/// Why a start cannot go on with what it found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unopenable {
    /// The log is not one this version can read.
    Refused(Refusal),
    /// No log (`what`: "missing" or "empty") and a damaged meta file.
    GoneUnbounded { what: &'static str },
    /// No log, but the meta file says the directory held a lease store
    /// whose tokens continue above `floor`.
    Gone { what: &'static str, floor: u64 },
    /// Acknowledged records may be lost, and there is no meta file to
    /// bound the tokens already issued.
    LostUnbounded(Loss),
}

/// What a start does with what it `found`: the rules of the module docs,
/// as steps for the file journal (and the simulator) to carry out.
pub fn open_plan(found: Found<'_>, options: OpenSettings) -> Result<OpenPlan, Unopenable> {
    if found.log.is_empty() {
        return open_empty(found, options);
    }
    let (start, replayed) = read_log(found.log).map_err(Unopenable::Refused)?;
    let verdict = match options.restored_from_backup {
        Some(bump) => Err((Loss::RestoredFromBackup { bump }, bump)),
        None => intact(start, &found.meta, &replayed, options.floor_block).map_err(|l| (l, 0)),
    };
    match verdict {
        Ok(header) => Ok(open_intact(replayed, header, found.meta, options)),
        Err((loss, bump)) => open_after_loss(replayed, start, found.meta, loss, bump),
    }
}

/// The header of a log just written as `image`: one durable write.
fn written(image: &[u8], token_floor: u64) -> Header {
    let len = image.len() as u64;
    Header {
        seq: 1,
        durable_len: len,
        compacted_len: len,
        token_floor,
    }
}

fn by_name(leases: HashMap<String, LeaseRecord>) -> Vec<LeaseRecord> {
    let mut leases: Vec<LeaseRecord> = leases.into_values().collect();
    leases.sort_unstable_by(|a, b| a.lease.cmp(&b.lease));
    leases
}

/// No log (or an empty one): a new store, or a lost log. The new log is
/// written first, then the meta file that says the directory was
/// initialised.
fn open_empty(found: Found<'_>, options: OpenSettings) -> Result<OpenPlan, Unopenable> {
    let what = if found.log_missing {
        "missing"
    } else {
        "empty"
    };
    let meta = match found.meta {
        MetaFile::Missing => Meta::default(),
        MetaFile::Corrupt => return Err(Unopenable::GoneUnbounded { what }),
        MetaFile::Found(meta) if options.accept_journal_loss => Meta {
            reserved: meta.reserved,
            floor: meta.reserved.max(meta.floor),
            ..Meta::default()
        },
        MetaFile::Found(meta) => {
            return Err(Unopenable::Gone {
                what,
                floor: meta.reserved.max(meta.floor),
            })
        }
    };
    let image = log_image(std::iter::empty(), meta.floor, 0, 0);
    let header = written(&image, meta.floor);
    Ok(OpenPlan {
        steps: vec![OpenStep::WriteLog(image), OpenStep::WriteMeta(meta)],
        header,
        len: header.durable_len,
        reserved: meta.reserved,
        identity: 0,
        recovered: Recovered {
            leases: Vec::new(),
            torn_bytes: 0,
            token_floor: meta.floor,
            forgotten_above: 0,
            lost_records: (meta.floor > 0).then_some(Loss::Accepted { what }),
        },
    })
}

/// A log that lost nothing acknowledged: whatever follows the valid records
/// was never acknowledged and is cut off; a version 1 log (`header` `None`)
/// is rewritten as version 2. A meta file that must be rebuilt from the log
/// is written first.
fn open_intact(
    replayed: Replayed,
    header: Option<Header>,
    meta: MetaFile,
    options: OpenSettings,
) -> OpenPlan {
    let Replayed {
        leases,
        good_len,
        torn_bytes,
        max_token,
        forgotten_above,
        identity,
    } = replayed;
    let leases = by_name(leases);
    let (floor, reserved) = intact_floors(header, &meta, max_token);
    let mut steps = Vec::new();
    let reserved = reserved.unwrap_or_else(|| {
        // Rebuilt from the log (a missing meta file, a version 1 log).
        let meta = Meta {
            reserved: max_token.max(floor).saturating_add(options.floor_block),
            floor,
            identity,
            previous: identity,
        };
        steps.push(OpenStep::WriteMeta(meta));
        meta.reserved
    });
    let (header, len) = match header {
        None => {
            let image = log_image(leases.iter(), floor, forgotten_above, identity);
            let header = written(&image, floor);
            steps.push(OpenStep::WriteLog(image));
            (header, header.durable_len)
        }
        Some(header) => {
            if torn_bytes > 0 {
                steps.push(OpenStep::CutLog(good_len));
            }
            let header = Header {
                token_floor: floor,
                ..header
            };
            (header, good_len)
        }
    };
    OpenPlan {
        steps,
        header,
        len,
        reserved,
        identity,
        recovered: Recovered {
            leases,
            torn_bytes,
            token_floor: floor,
            forgotten_above,
            lost_records: None,
        },
    }
}

/// A log that may have lost acknowledged records (`loss`): [`after_loss`].
/// The meta file with the new floor is written first; then a copy of the
/// log as found is kept, and the fresh log replaces it in one rename, so a
/// crash in between finds the damaged log again and repeats this.
fn open_after_loss(
    replayed: Replayed,
    start: Start,
    meta: MetaFile,
    loss: Loss,
    bump: u64,
) -> Result<OpenPlan, Unopenable> {
    let Replayed {
        mut leases,
        torn_bytes,
        max_token,
        forgotten_above,
        ..
    } = replayed;
    let MetaFile::Found(meta) = meta else {
        return Err(Unopenable::LostUnbounded(loss));
    };
    let floor = after_loss(&mut leases, max_token, start, meta, bump);
    let leases = by_name(leases);
    // The fresh log carries no identity until the start gives it one.
    let meta = Meta {
        reserved: floor,
        floor,
        ..Meta::default()
    };
    let image = log_image(leases.iter(), floor, forgotten_above, 0);
    let header = written(&image, floor);
    Ok(OpenPlan {
        steps: vec![
            OpenStep::WriteMeta(meta),
            OpenStep::KeepDamagedCopy,
            OpenStep::WriteLog(image),
        ],
        header,
        len: header.durable_len,
        reserved: floor,
        identity: 0,
        recovered: Recovered {
            leases,
            torn_bytes,
            token_floor: floor,
            forgotten_above,
            lost_records: Some(loss),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meta_file_round_trips_and_refuses_damage() {
        let m = Meta {
            reserved: 4096,
            floor: 7,
            identity: 0xabc,
            previous: 0xdef,
        };
        let bytes = m.encode();
        assert_eq!(Meta::decode(&bytes), Some(m));
        assert!(m.names(0xabc) && m.names(0xdef) && !m.names(1));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert_eq!(Meta::decode(&bad), None, "a flip at byte {i}");
        }
        assert_eq!(MetaFile::read(None), MetaFile::Missing);
        assert_eq!(MetaFile::read(Some(b"x")), MetaFile::Corrupt);
    }

    fn settings() -> OpenSettings {
        OpenSettings {
            floor_block: 16,
            ..OpenSettings::default()
        }
    }

    fn grant(lease: &str, token: u64) -> Record {
        Record::Grant {
            lease: lease.into(),
            token,
            holder: "h".into(),
            ttl_ms: 1000,
            lease_id: [7; 32],
            quiet: false,
            wall_ms: 0,
        }
    }

    /// A log of `records`, its header claiming all of them synced.
    fn log_of(records: &[Record]) -> Vec<u8> {
        let mut log = log_image(std::iter::empty(), 0, 0, 0);
        for r in records {
            r.encode_frame(&mut log);
        }
        let header = Header {
            seq: 2,
            durable_len: log.len() as u64,
            compacted_len: HEADER_LEN as u64,
            token_floor: 0,
        };
        let slot = header.encode();
        log[FILE_MAGIC.len()..FILE_MAGIC.len() + slot.len()].copy_from_slice(&slot);
        log
    }

    fn found(log: &[u8], meta: MetaFile) -> Found<'_> {
        Found {
            log,
            log_missing: log.is_empty(),
            meta,
        }
    }

    #[test]
    fn a_new_directory_gets_its_log_before_its_meta_file() {
        let plan = open_plan(found(&[], MetaFile::Missing), settings()).unwrap();
        assert!(matches!(
            plan.steps.as_slice(),
            [OpenStep::WriteLog(_), OpenStep::WriteMeta(m)] if *m == Meta::default()
        ));
        assert_eq!(plan.len, plan.header.durable_len);
        assert!(plan.recovered.lost_records.is_none());
        // A meta file without its log: refused, unless told to go on.
        let meta = Meta {
            reserved: 40,
            floor: 3,
            ..Meta::default()
        };
        let gone = open_plan(found(&[], MetaFile::Found(meta)), settings());
        assert_eq!(
            gone.unwrap_err(),
            Unopenable::Gone {
                what: "missing",
                floor: 40
            }
        );
        let accepted = OpenSettings {
            accept_journal_loss: true,
            ..settings()
        };
        let plan = open_plan(found(&[], MetaFile::Found(meta)), accepted).unwrap();
        assert_eq!(plan.recovered.token_floor, 40);
        assert!(plan.recovered.lost_records.is_some());
        let corrupt = open_plan(found(&[], MetaFile::Corrupt), accepted);
        assert_eq!(
            corrupt.unwrap_err(),
            Unopenable::GoneUnbounded { what: "missing" }
        );
    }

    #[test]
    fn an_intact_log_keeps_its_leases_and_loses_its_torn_tail() {
        let mut log = log_of(&[grant("b", 2), grant("a", 1)]);
        let good_len = log.len() as u64;
        log.extend_from_slice(&[0xff; 9]);
        let meta = Meta {
            reserved: 16,
            ..Meta::default()
        };
        let plan = open_plan(found(&log, MetaFile::Found(meta)), settings()).unwrap();
        assert_eq!(plan.steps, [OpenStep::CutLog(good_len)]);
        assert_eq!((plan.len, plan.reserved), (good_len, 16));
        let names: Vec<&str> = plan
            .recovered
            .leases
            .iter()
            .map(|l| l.lease.as_str())
            .collect();
        assert_eq!(names, ["a", "b"], "by name");
        assert_eq!(plan.recovered.torn_bytes, 9);
        // Without its meta file, the file is rebuilt from the log first.
        let plan = open_plan(found(&log, MetaFile::Missing), settings()).unwrap();
        assert_eq!(
            plan.steps[0],
            OpenStep::WriteMeta(Meta {
                reserved: 2 + 16,
                ..Meta::default()
            })
        );
    }

    #[test]
    fn a_log_that_lost_records_is_kept_aside_after_the_new_floor_is_written() {
        let log = log_of(&[grant("a", 5)]);
        let meta = Meta {
            reserved: 16,
            floor: 0,
            identity: 9,
            previous: 8,
        };
        let plan = open_plan(found(&log, MetaFile::Found(meta)), settings()).unwrap();
        let [OpenStep::WriteMeta(m), OpenStep::KeepDamagedCopy, OpenStep::WriteLog(image)] =
            plan.steps.as_slice()
        else {
            panic!("{:?}", plan.steps)
        };
        assert_eq!((m.reserved, m.floor), (16, 16));
        assert_eq!(plan.header.durable_len, image.len() as u64);
        assert!(matches!(
            plan.recovered.lost_records,
            Some(Loss::OtherLog {
                identity: 0,
                named: 9
            })
        ));
        let a = &plan.recovered.leases[0];
        assert!(a.last_token >= 16 && a.term.as_ref().is_some_and(|t| t.released));
        // A restored backup is a loss whatever the log says.
        let restored = OpenSettings {
            restored_from_backup: Some(100),
            ..settings()
        };
        let meta = Meta {
            reserved: 16,
            ..Meta::default()
        };
        let plan = open_plan(found(&log, MetaFile::Found(meta)), restored).unwrap();
        assert_eq!(plan.recovered.token_floor, 116);
        // And with no meta file, the tokens issued cannot be bounded.
        let plan = open_plan(found(&log, MetaFile::Missing), restored);
        assert!(matches!(plan, Err(Unopenable::LostUnbounded(_))));
    }

    #[test]
    fn a_log_of_another_format_is_refused() {
        assert!(read_start(b"NOTAJOURNAL").is_err());
        assert_eq!(read_start(b"FGJR").unwrap().1, Start::V2Damaged);
    }
}
