//! Journal records and their framing on disk.
//!
//! A journal file starts with [`FILE_MAGIC`] and two header slots
//! ([`Header`], [`HEADER_LEN`] bytes in all), followed by frames:
//!
//! ```text
//! 0xF7 | payload length: u32 LE | CRC-32 of payload: u32 LE | payload
//! ```
//!
//! The header slots are written in turn, each with a sequence number and a
//! checksum, so a slot torn by a crash leaves the other one readable.
//! Version 1 files ([`FILE_MAGIC_V1`]) have no header; they are read and
//! rewritten as version 2.
//!
//! A payload is a kind byte followed by the kind's fields: integers are
//! little-endian u64, strings a length (u8 for lease names, u16 for holders)
//! and UTF-8 bytes, lease ids their 32-byte text form.

use crate::mutant::{planted, Mutant};
use bytes::{Buf, BufMut};

/// The first bytes of every journal file (format version 2).
pub const FILE_MAGIC: &[u8; 8] = b"FGJRNL02";
/// The first bytes of a version 1 journal (no header slots).
pub const FILE_MAGIC_V1: &[u8; 8] = b"FGJRNL01";
/// Bytes of one header slot.
pub const SLOT_LEN: usize = 40;
/// Bytes before the first frame of a version 2 journal.
pub const HEADER_LEN: usize = FILE_MAGIC.len() + 2 * SLOT_LEN;

/// What a journal's header says. Written with every synced batch, in the
/// same `fdatasync` as the batch, so after a crash the valid records reach
/// at least `durable_len`, unless records that were acknowledged were lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Which write of the header this is (the newer valid slot wins).
    pub seq: u64,
    /// The file was this long, all of it synced, when the slot was written.
    pub durable_len: u64,
    /// The file's length right after its last compaction.
    pub compacted_len: u64,
    /// Every lease's tokens continue above this (0 unless records were once
    /// lost); a copy of the store's meta file.
    pub token_floor: u64,
}

impl Header {
    /// The slot's bytes.
    pub fn encode(&self) -> [u8; SLOT_LEN] {
        let mut out = [0u8; SLOT_LEN];
        out[0..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.durable_len.to_le_bytes());
        out[16..24].copy_from_slice(&self.compacted_len.to_le_bytes());
        out[24..32].copy_from_slice(&self.token_floor.to_le_bytes());
        let crc = crc32fast::hash(&out[..32]);
        out[32..36].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Where this header's slot lives in the file.
    pub fn offset(&self) -> u64 {
        (FILE_MAGIC.len() + SLOT_LEN * (self.seq % 2) as usize) as u64
    }

    /// The newest valid slot of a version 2 file's first [`HEADER_LEN`]
    /// bytes; `None` if neither slot is valid.
    pub fn read(file: &[u8]) -> Option<Self> {
        let slot = |i: usize| {
            let at = FILE_MAGIC.len() + i * SLOT_LEN;
            let b = file.get(at..at + SLOT_LEN)?;
            let crc = u32::from_le_bytes(b[32..36].try_into().expect("4 bytes"));
            if crc32fast::hash(&b[..32]) != crc || b[36..] != [0; 4] {
                return None;
            }
            let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
            Some(Self {
                seq: u(0),
                durable_len: u(8),
                compacted_len: u(16),
                token_floor: u(24),
            })
        };
        match (slot(0), slot(1)) {
            (Some(a), Some(b)) => Some(if a.seq >= b.seq { a } else { b }),
            (a, b) => a.or(b),
        }
    }
}
/// The first byte of every frame.
pub const FRAME_MAGIC: u8 = 0xF7;
/// Bytes of a frame before its payload.
pub const FRAME_HEADER: usize = 9;
/// Largest payload accepted when reading (a record is far smaller).
pub const MAX_PAYLOAD: usize = 64 * 1024;

const KIND_GRANT: u8 = 1;
const KIND_RENEW: u8 = 2;
const KIND_RELEASE: u8 = 3;
const KIND_STATE: u8 = 4;
const KIND_NOOP: u8 = 5;
const KIND_FORGET: u8 = 6;
const KIND_IDENTITY: u8 = 7;
// Since the restart window and the wall-clock hints: the kinds above with
// their flags and hints (the older kinds are still read, without them).
const KIND_GRANT_2: u8 = 8;
const KIND_RENEW_2: u8 = 9;
const KIND_RELEASE_2: u8 = 10;
const KIND_STATE_2: u8 = 11;

/// Flag bits of a term in [`KIND_GRANT_2`], [`KIND_RELEASE_2`] and
/// [`KIND_STATE_2`] records (and in the etcd journal's records).
pub const GRANTED_QUIET: u8 = 1;
pub const RELEASED_QUIET: u8 = 2;

/// The latest term of a lease, as the journal knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TermRecord {
    pub token: u64,
    pub holder: String,
    pub ttl_ms: u64,
    /// The lease id's text form, so the holder can renew after a restart.
    pub lease_id: [u8; 32],
    pub released: bool,
    /// When the term was granted, no write of an earlier term could still
    /// be unfinished at the storage: after a restart, the term's own writes
    /// have nothing to wait for.
    pub granted_quiet: bool,
    /// The term was released with no write of it (or of an earlier term)
    /// unfinished: after a restart, the next term has nothing to wait for.
    pub released_quiet: bool,
    /// The Unix time (ms, the wall clock) at which the term ends unless it
    /// was renewed after the last record of it; 0 if unknown. A hint, used
    /// only to end a term early after a restart, never to extend one.
    pub wall_deadline_ms: u64,
}

impl TermRecord {
    /// The term's flag bits (see [`term_flags`]).
    pub fn flags(&self) -> u8 {
        term_flags(self.granted_quiet, self.released_quiet)
    }
}

/// A term's flag bits: [`GRANTED_QUIET`], [`RELEASED_QUIET`].
pub fn term_flags(granted_quiet: bool, released_quiet: bool) -> u8 {
    let mut flags = 0;
    if granted_quiet {
        flags |= GRANTED_QUIET;
    }
    if released_quiet {
        flags |= RELEASED_QUIET;
    }
    flags
}

/// Everything the journal keeps of one lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseRecord {
    pub lease: String,
    /// The highest token ever made durable for this lease.
    pub last_token: u64,
    /// How many terms were granted.
    pub transitions: u64,
    pub term: Option<TermRecord>,
}

/// A grant as the lease store hands it to its journal
/// ([`crate::lease::slot::Slot::grant`]): [`Record::Grant`]'s fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantRecord {
    pub lease: String,
    pub token: u64,
    pub holder: String,
    pub ttl_ms: u64,
    /// The lease id's text form, so the holder can renew after a restart.
    pub lease_id: [u8; 32],
    /// No write of an earlier term could still be unfinished at the storage
    /// (after a restart, this term's writes have nothing to wait for).
    pub quiet: bool,
    /// The wall clock at the grant (Unix ms), a hint used only to end the
    /// term early after a restart.
    pub wall_ms: u64,
}

impl From<GrantRecord> for Record {
    fn from(g: GrantRecord) -> Self {
        Record::Grant {
            lease: g.lease,
            token: g.token,
            holder: g.holder,
            ttl_ms: g.ttl_ms,
            lease_id: g.lease_id,
            quiet: g.quiet,
            wall_ms: g.wall_ms,
        }
    }
}

/// One entry of the journal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A term was granted (always fsync'd before the token is returned).
    Grant {
        lease: String,
        token: u64,
        holder: String,
        ttl_ms: u64,
        lease_id: [u8; 32],
        /// No write of an earlier term was unfinished at the grant.
        quiet: bool,
        /// The wall clock at the grant (Unix ms; 0: unknown).
        wall_ms: u64,
    },
    /// A term was renewed (recorded lazily: when its TTL changes, and when
    /// the wall-clock hint of its end falls behind).
    Renew {
        lease: String,
        token: u64,
        ttl_ms: u64,
        /// The wall clock at the renewal (Unix ms; 0: unknown).
        wall_ms: u64,
    },
    /// A term was released.
    Release {
        lease: String,
        token: u64,
        /// No write of it, or of an earlier term, was unfinished.
        quiet: bool,
    },
    /// A lease's whole state, written by compaction.
    State(LeaseRecord),
    /// Carries nothing; written by the health probe.
    Noop,
    /// The lease was forgotten (retention): what the log held of it ends
    /// here, and a lease the log no longer holds continues above
    /// `last_token`. With an empty name (written by compaction, first) it
    /// carries only that mark for every name forgotten before.
    Forget { lease: String, last_token: u64 },
    /// The log's identity from here on: `store.meta` names the identity of
    /// the log it was last written with, so an older copy of the log put
    /// back beside it is caught (the last one in a log counts).
    Identity { id: u64 },
}

/// The mark every lease not in the store continues above, after a lease
/// whose own mark ([`crate::lease::retention::forgotten_mark`]) is `mark` was forgotten: it only
/// rises (a lower mark would let a lease forgotten before start below its
/// own tokens).
pub fn forgotten_above(above: u64, mark: u64) -> u64 {
    if planted(Mutant::ForgottenAboveLowered) {
        return mark;
    }
    above.max(mark)
}

/// What a record records, for whether anyone waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Grant,
    Renew,
    Release,
    Forget,
    /// The journal's own: a lease's state, a probe, an identity.
    Own,
}

/// Whether the lease store waits for a record of `kind` to be durable
/// before it answers: a grant (its token must survive any crash once a
/// client holds it) and a release (an answered release must stay one).
/// Renewals and forgets are lazy: losing one is safe (a renewal's hint
/// only ends a term earlier after a restart; a lease not forgotten is
/// still kept). The writer syncs a batch holding an awaited record
/// ([`crate::journal::writer::batch_syncs`]).
pub fn awaited(kind: Kind) -> bool {
    match kind {
        Kind::Grant => true,
        Kind::Release => !planted(Mutant::ReleaseLazy),
        Kind::Renew | Kind::Forget | Kind::Own => false,
    }
}

/// Why bytes are not a record.
#[derive(Debug, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl Record {
    /// Folds this record into the lease's state.
    pub fn apply(&self, state: &mut LeaseRecord) {
        match self {
            Record::Grant {
                token,
                holder,
                ttl_ms,
                lease_id,
                quiet,
                wall_ms,
                ..
            } => {
                state.last_token = state.last_token.max(*token);
                state.transitions += 1;
                // Only a newer term replaces the current one: a replay never
                // revives an older term, whatever order records arrive in.
                if state.term.as_ref().is_some_and(|t| t.token >= *token) {
                    return;
                }
                state.term = Some(TermRecord {
                    token: *token,
                    holder: holder.clone(),
                    ttl_ms: *ttl_ms,
                    lease_id: *lease_id,
                    released: false,
                    granted_quiet: *quiet,
                    released_quiet: false,
                    wall_deadline_ms: wall_deadline(*wall_ms, *ttl_ms),
                });
            }
            Record::Renew {
                token,
                ttl_ms,
                wall_ms,
                ..
            } => {
                if let Some(term) = state.term.as_mut().filter(|t| t.token == *token) {
                    term.ttl_ms = *ttl_ms;
                    if *wall_ms != 0 {
                        term.wall_deadline_ms = wall_deadline(*wall_ms, *ttl_ms);
                    }
                }
            }
            Record::Release { .. } if planted(Mutant::ReplayDropsReleases) => {}
            Record::Release { token, quiet, .. } => {
                if let Some(term) = state.term.as_mut().filter(|t| t.token == *token) {
                    term.released = true;
                    term.released_quiet = *quiet;
                }
            }
            Record::State(s) => *state = s.clone(),
            // The replay removes the lease (see `Record::forgets`).
            Record::Noop | Record::Forget { .. } | Record::Identity { .. } => {}
        }
    }

    /// For [`Record::Forget`]: the lease it removes (`""`: none) and the
    /// mark every name not in the log continues above.
    pub fn forgets(&self) -> Option<(&str, u64)> {
        match self {
            Record::Forget { lease, last_token } => Some((lease, *last_token)),
            _ => None,
        }
    }

    /// What the record records ([`awaited`] reads it).
    pub fn kind(&self) -> Kind {
        match self {
            Record::Grant { .. } => Kind::Grant,
            Record::Renew { .. } => Kind::Renew,
            Record::Release { .. } => Kind::Release,
            Record::Forget { .. } => Kind::Forget,
            Record::State(_) | Record::Noop | Record::Identity { .. } => Kind::Own,
        }
    }

    /// Whether the lease store waits for this record ([`awaited`]).
    pub fn awaited(&self) -> bool {
        awaited(self.kind())
    }

    /// The lease the record is about (`None` for [`Record::Noop`]).
    pub fn lease(&self) -> Option<&str> {
        match self {
            Record::Grant { lease, .. }
            | Record::Renew { lease, .. }
            | Record::Release { lease, .. } => Some(lease),
            Record::State(s) => Some(&s.lease),
            Record::Noop | Record::Forget { .. } | Record::Identity { .. } => None,
        }
    }

    /// Appends the framed record to `out`.
    pub fn encode_frame(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.put_u8(FRAME_MAGIC);
        out.put_u32_le(0);
        out.put_u32_le(0);
        self.encode_payload(out);
        let payload = &out[start + FRAME_HEADER..];
        let len = u32::try_from(payload.len()).expect("records are small");
        let crc = crc32fast::hash(payload);
        out[start + 1..start + 5].copy_from_slice(&len.to_le_bytes());
        out[start + 5..start + 9].copy_from_slice(&crc.to_le_bytes());
    }

    fn encode_payload(&self, out: &mut Vec<u8>) {
        match self {
            Record::Grant {
                lease,
                token,
                holder,
                ttl_ms,
                lease_id,
                quiet,
                wall_ms,
            } => {
                out.put_u8(KIND_GRANT_2);
                put_name(out, lease);
                out.put_u64_le(*token);
                out.put_u64_le(*ttl_ms);
                put_holder(out, holder);
                out.put_slice(lease_id);
                out.put_u8(if *quiet { GRANTED_QUIET } else { 0 });
                out.put_u64_le(*wall_ms);
            }
            Record::Renew {
                lease,
                token,
                ttl_ms,
                wall_ms,
            } => {
                out.put_u8(KIND_RENEW_2);
                put_name(out, lease);
                out.put_u64_le(*token);
                out.put_u64_le(*ttl_ms);
                out.put_u64_le(*wall_ms);
            }
            Record::Release {
                lease,
                token,
                quiet,
            } => {
                out.put_u8(KIND_RELEASE_2);
                put_name(out, lease);
                out.put_u64_le(*token);
                out.put_u8(if *quiet { RELEASED_QUIET } else { 0 });
            }
            Record::State(s) => {
                out.put_u8(KIND_STATE_2);
                put_name(out, &s.lease);
                out.put_u64_le(s.last_token);
                out.put_u64_le(s.transitions);
                match &s.term {
                    None => out.put_u8(0),
                    Some(t) => {
                        out.put_u8(if t.released { 2 } else { 1 });
                        out.put_u64_le(t.token);
                        out.put_u64_le(t.ttl_ms);
                        put_holder(out, &t.holder);
                        out.put_slice(&t.lease_id);
                        out.put_u8(t.flags());
                        out.put_u64_le(t.wall_deadline_ms);
                    }
                }
            }
            Record::Noop => out.put_u8(KIND_NOOP),
            Record::Forget { lease, last_token } => {
                out.put_u8(KIND_FORGET);
                put_name(out, lease);
                out.put_u64_le(*last_token);
            }
            Record::Identity { id } => {
                out.put_u8(KIND_IDENTITY);
                out.put_u64_le(*id);
            }
        }
    }

    /// Decodes one payload (without its frame).
    pub fn decode_payload(mut buf: &[u8]) -> Result<Self, DecodeError> {
        let kind = get_u8(&mut buf)?;
        let record = match kind {
            KIND_GRANT | KIND_GRANT_2 => {
                let lease = get_name(&mut buf)?;
                let token = get_u64(&mut buf)?;
                let ttl_ms = get_u64(&mut buf)?;
                let holder = get_holder(&mut buf)?;
                let lease_id = get_id(&mut buf)?;
                let (flags, wall_ms) = if kind == KIND_GRANT_2 {
                    (get_u8(&mut buf)?, get_u64(&mut buf)?)
                } else {
                    (0, 0)
                };
                Record::Grant {
                    lease,
                    token,
                    holder,
                    ttl_ms,
                    lease_id,
                    quiet: flags & GRANTED_QUIET != 0,
                    wall_ms,
                }
            }
            KIND_RENEW | KIND_RENEW_2 => Record::Renew {
                lease: get_name(&mut buf)?,
                token: get_u64(&mut buf)?,
                ttl_ms: get_u64(&mut buf)?,
                wall_ms: if kind == KIND_RENEW_2 {
                    get_u64(&mut buf)?
                } else {
                    0
                },
            },
            KIND_RELEASE | KIND_RELEASE_2 => Record::Release {
                lease: get_name(&mut buf)?,
                token: get_u64(&mut buf)?,
                quiet: kind == KIND_RELEASE_2 && get_u8(&mut buf)? & RELEASED_QUIET != 0,
            },
            KIND_STATE | KIND_STATE_2 => {
                let lease = get_name(&mut buf)?;
                let last_token = get_u64(&mut buf)?;
                let transitions = get_u64(&mut buf)?;
                let term = match get_u8(&mut buf)? {
                    0 => None,
                    tag @ (1 | 2) => {
                        let token = get_u64(&mut buf)?;
                        let ttl_ms = get_u64(&mut buf)?;
                        let holder = get_holder(&mut buf)?;
                        let lease_id = get_id(&mut buf)?;
                        let (flags, wall_deadline_ms) = if kind == KIND_STATE_2 {
                            (get_u8(&mut buf)?, get_u64(&mut buf)?)
                        } else {
                            (0, 0)
                        };
                        Some(TermRecord {
                            token,
                            holder,
                            ttl_ms,
                            lease_id,
                            released: tag == 2,
                            granted_quiet: flags & GRANTED_QUIET != 0,
                            released_quiet: flags & RELEASED_QUIET != 0,
                            wall_deadline_ms,
                        })
                    }
                    _ => return Err(DecodeError("bad term tag")),
                };
                Record::State(LeaseRecord {
                    lease,
                    last_token,
                    transitions,
                    term,
                })
            }
            KIND_NOOP => Record::Noop,
            KIND_FORGET => Record::Forget {
                lease: get_name(&mut buf)?,
                last_token: get_u64(&mut buf)?,
            },
            KIND_IDENTITY => Record::Identity {
                id: get_u64(&mut buf)?,
            },
            _ => return Err(DecodeError("unknown record kind")),
        };
        if buf.has_remaining() {
            return Err(DecodeError("trailing bytes in record"));
        }
        Ok(record)
    }
}

/// The outcome of reading one frame at the start of `buf`.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// A valid record and the frame's total length.
    Record(Record, usize),
    /// Not a valid frame here.
    Invalid(&'static str),
}

/// Reads the frame at the start of `buf`.
pub fn read_frame(buf: &[u8]) -> Frame {
    if buf.len() < FRAME_HEADER {
        return Frame::Invalid("short frame header");
    }
    if buf[0] != FRAME_MAGIC {
        return Frame::Invalid("bad frame magic");
    }
    let len = u32::from_le_bytes(buf[1..5].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(buf[5..9].try_into().expect("4 bytes"));
    if len > MAX_PAYLOAD {
        return Frame::Invalid("frame length out of range");
    }
    let Some(payload) = buf.get(FRAME_HEADER..FRAME_HEADER + len) else {
        return Frame::Invalid("frame runs past the end of the file");
    };
    if crc32fast::hash(payload) != crc {
        return Frame::Invalid("checksum mismatch");
    }
    match Record::decode_payload(payload) {
        Ok(record) => Frame::Record(record, FRAME_HEADER + len),
        Err(DecodeError(why)) => Frame::Invalid(why),
    }
}

/// The wall-clock deadline of a term granted or renewed at `wall_ms` for
/// `ttl_ms` (0, unknown, if the wall clock was).
pub fn wall_deadline(wall_ms: u64, ttl_ms: u64) -> u64 {
    if wall_ms == 0 {
        0
    } else {
        wall_ms.saturating_add(ttl_ms)
    }
}

/// A whole version 2 log holding one state record per lease (a new log, a
/// compacted one, the log a start writes after lost records): its header
/// claims every byte, with `token_floor`; leases not in it continue above
/// `forgotten_above`; `identity` 0 gives it none.
pub fn log_image<'a>(
    leases: impl Iterator<Item = &'a LeaseRecord>,
    token_floor: u64,
    forgotten_above: u64,
    identity: u64,
) -> Vec<u8> {
    let mut out = FILE_MAGIC.to_vec();
    out.resize(HEADER_LEN, 0);
    if identity != 0 {
        Record::Identity { id: identity }.encode_frame(&mut out);
    }
    if forgotten_above > 0 {
        Record::Forget {
            lease: String::new(),
            last_token: forgotten_above,
        }
        .encode_frame(&mut out);
    }
    for lease in leases {
        Record::State(lease.clone()).encode_frame(&mut out);
    }
    let len = out.len() as u64;
    let header = Header {
        seq: 1,
        durable_len: len,
        compacted_len: len,
        token_floor,
    };
    let at = header.offset() as usize;
    out[at..at + SLOT_LEN].copy_from_slice(&header.encode());
    out
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    let len = u8::try_from(s.len()).expect("lease names are at most 128 bytes");
    out.put_u8(len);
    out.put_slice(s.as_bytes());
}

fn put_holder(out: &mut Vec<u8>, s: &str) {
    let len = u16::try_from(s.len()).expect("holders are at most 256 bytes");
    out.put_u16_le(len);
    out.put_slice(s.as_bytes());
}

fn get_u8(buf: &mut &[u8]) -> Result<u8, DecodeError> {
    if buf.remaining() < 1 {
        return Err(DecodeError("truncated record"));
    }
    Ok(buf.get_u8())
}

fn get_u64(buf: &mut &[u8]) -> Result<u64, DecodeError> {
    if buf.remaining() < 8 {
        return Err(DecodeError("truncated record"));
    }
    Ok(buf.get_u64_le())
}

fn get_str(buf: &mut &[u8], len: usize) -> Result<String, DecodeError> {
    if buf.remaining() < len {
        return Err(DecodeError("truncated record"));
    }
    let s = std::str::from_utf8(&buf[..len])
        .map_err(|_| DecodeError("string is not UTF-8"))?
        .to_owned();
    buf.advance(len);
    Ok(s)
}

fn get_name(buf: &mut &[u8]) -> Result<String, DecodeError> {
    let len = usize::from(get_u8(buf)?);
    get_str(buf, len)
}

fn get_holder(buf: &mut &[u8]) -> Result<String, DecodeError> {
    if buf.remaining() < 2 {
        return Err(DecodeError("truncated record"));
    }
    let len = usize::from(buf.get_u16_le());
    get_str(buf, len)
}

fn get_id(buf: &mut &[u8]) -> Result<[u8; 32], DecodeError> {
    if buf.remaining() < 32 {
        return Err(DecodeError("truncated record"));
    }
    let mut id = [0u8; 32];
    buf.copy_to_slice(&mut id);
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Record> {
        vec![
            Record::Grant {
                lease: "orders".into(),
                token: 7,
                holder: "worker-1".into(),
                ttl_ms: 5000,
                lease_id: [b'a'; 32],
                quiet: true,
                wall_ms: 1_700_000_000_000,
            },
            Record::Renew {
                lease: "orders".into(),
                token: 7,
                ttl_ms: 9000,
                wall_ms: 1_700_000_001_000,
            },
            Record::Release {
                lease: "orders".into(),
                token: 7,
                quiet: true,
            },
            Record::State(LeaseRecord {
                lease: "x".repeat(128),
                last_token: u64::MAX,
                transitions: 3,
                term: Some(TermRecord {
                    token: u64::MAX,
                    holder: "h".repeat(256),
                    ttl_ms: 100,
                    lease_id: [b'f'; 32],
                    released: true,
                    granted_quiet: false,
                    released_quiet: true,
                    wall_deadline_ms: 42,
                }),
            }),
            Record::State(LeaseRecord {
                lease: "empty".into(),
                ..LeaseRecord::default()
            }),
            Record::Noop,
            Record::Identity {
                id: 0x0123_4567_89ab_cdef,
            },
        ]
    }

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        for r in samples() {
            r.encode_frame(&mut buf);
        }
        let mut at = 0;
        for want in samples() {
            match read_frame(&buf[at..]) {
                Frame::Record(got, len) => {
                    assert_eq!(got, want);
                    at += len;
                }
                Frame::Invalid(why) => panic!("{why} at {at}"),
            }
        }
        assert_eq!(at, buf.len());
    }

    #[test]
    fn every_single_byte_flip_or_cut_is_detected() {
        let mut frame = Vec::new();
        samples()[0].encode_frame(&mut frame);
        for i in 0..frame.len() {
            let mut bad = frame.clone();
            bad[i] ^= 0x01;
            assert!(matches!(read_frame(&bad), Frame::Invalid(_)), "flip at {i}");
            assert!(
                matches!(read_frame(&frame[..i]), Frame::Invalid(_)),
                "cut at {i}"
            );
        }
    }

    #[test]
    fn the_newer_valid_header_slot_wins() {
        let mut file = vec![0u8; HEADER_LEN];
        file[..8].copy_from_slice(FILE_MAGIC);
        assert_eq!(Header::read(&file), None, "zeroed slots are not valid");
        let h = |seq| Header {
            seq,
            durable_len: 100 + seq,
            compacted_len: 88,
            token_floor: 7,
        };
        for seq in [1, 2, 3] {
            let at = h(seq).offset() as usize;
            file[at..at + SLOT_LEN].copy_from_slice(&h(seq).encode());
        }
        assert_eq!(Header::read(&file), Some(h(3)));
        // A torn newest slot leaves the older one.
        let at = h(3).offset() as usize;
        file[at + 9] ^= 1;
        assert_eq!(Header::read(&file), Some(h(2)));
    }

    #[test]
    fn folding_follows_the_terms() {
        let mut s = LeaseRecord::default();
        for r in &samples()[..3] {
            r.apply(&mut s);
        }
        let t = s.term.clone().unwrap();
        assert_eq!(
            (s.last_token, s.transitions, t.ttl_ms, t.released),
            (7, 1, 9000, true)
        );
        assert!(t.granted_quiet && t.released_quiet);
        assert_eq!(t.wall_deadline_ms, 1_700_000_010_000);
        // A renew or release of another token changes nothing.
        Record::Renew {
            lease: "orders".into(),
            token: 6,
            ttl_ms: 1,
            wall_ms: 1,
        }
        .apply(&mut s);
        assert_eq!(s.term.unwrap().ttl_ms, 9000);
    }

    /// Records of the kinds written before the flags and hints are read as
    /// not quiet, with no wall-clock hint: the restart window applies to
    /// them as it did.
    #[test]
    fn older_kinds_are_read_without_flags() {
        let frame = |payload: Vec<u8>| {
            let mut out = vec![FRAME_MAGIC];
            out.extend((payload.len() as u32).to_le_bytes());
            out.extend(crc32fast::hash(&payload).to_le_bytes());
            out.extend(payload);
            out
        };
        let mut grant = vec![KIND_GRANT];
        put_name(&mut grant, "orders");
        grant.extend(7u64.to_le_bytes());
        grant.extend(5000u64.to_le_bytes());
        put_holder(&mut grant, "w");
        grant.extend([b'a'; 32]);
        let mut release = vec![KIND_RELEASE];
        put_name(&mut release, "orders");
        release.extend(7u64.to_le_bytes());
        let read = |payload| match read_frame(&frame(payload)) {
            Frame::Record(r, _) => r,
            Frame::Invalid(why) => panic!("{why}"),
        };
        let mut s = LeaseRecord::default();
        let g = read(grant);
        assert!(matches!(
            g,
            Record::Grant {
                quiet: false,
                wall_ms: 0,
                ..
            }
        ));
        g.apply(&mut s);
        let r = read(release);
        assert!(matches!(r, Record::Release { quiet: false, .. }));
        r.apply(&mut s);
        let t = s.term.unwrap();
        assert!(t.released && !t.released_quiet && !t.granted_quiet);
        assert_eq!(t.wall_deadline_ms, 0);
    }

    /// Seen failing before grants compared tokens: the grant of term 6,
    /// replayed after term 7's, made term 6 current again.
    #[test]
    fn an_older_grant_never_replaces_a_newer_term() {
        let grant = |token| Record::Grant {
            lease: "orders".into(),
            token,
            holder: format!("h{token}"),
            ttl_ms: 1000,
            lease_id: [b'a'; 32],
            quiet: false,
            wall_ms: 0,
        };
        let mut s = LeaseRecord::default();
        grant(7).apply(&mut s);
        grant(6).apply(&mut s);
        let t = s.term.unwrap();
        assert_eq!((s.last_token, t.token, t.holder.as_str()), (7, 7, "h7"));
    }
}
