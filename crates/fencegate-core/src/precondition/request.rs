//! What a request on a route with preconditions asks of the storage, read
//! the way the storage reads it: which operation a write is, and so which
//! preconditions the storage evaluates on it ([`Operation`]); whether a
//! read reads the key's current representation ([`reads_the_key`]); and
//! whether a client's own precondition names a state the storage will
//! compare ([`Own::protects`]).
//!
//! Storages read the same request differently: S3 executes `PUT
//! ?comp=block` as a PutObject, Azure executes `PUT ?tagging` as a Put
//! Blob. So a route says which storage's API it fronts ([`Dialect`]), and
//! only that API's rules apply.
//!
//! Every rule here errs one way. A write is sorted as one that changes no
//! key ([`Operation::Aside`]) only for the exact pairs of method and
//! sub-resource that the route's storage documents as such (none for a
//! storage fencegate knows nothing of); anything else, a parameter
//! fencegate does not know among them, is a key write and gets a
//! precondition, or, for an Azure operation that changes the blob but
//! evaluates no precondition (Undelete Blob, Set Blob Expiry, ...), is
//! refused ([`Operation::Unconditional`]). Only a key write whose query has
//! nothing but neutral parameters teaches the state its answer shows; the
//! answer of any other may be a part's, a version's, a staged block's. A read teaches the key's state only when every
//! parameter of its query is one that leaves it a read of the key (an
//! SDK's hint, a presigned URL's or a SAS token's signature, a response
//! override); anything else teaches nothing. Parameter names and values
//! are compared after percent-decoding, as the storage decodes them
//! (`version%49d` is `versionId`), and case-sensitively, as S3 does; a
//! name that cannot be decoded one way only (a `+`, a broken escape, bytes
//! that are not UTF-8) counts as one fencegate does not know.

use std::borrow::Cow;

use crate::mutant::{planted, Mutant};

/// Whose API a route's storage speaks: what its sub-resources mean.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dialect {
    /// Nothing known of it: no write is sorted aside, every write carries
    /// a precondition (the embedded store, WebDAV servers).
    #[default]
    Any,
    /// Amazon S3 and the stores that copy its API (R2, Ceph, MinIO, GCS's
    /// XML API, moto, Garage).
    S3,
    /// Azure Blob Storage (and Azurite).
    Azure,
}

/// What a write on a route with preconditions does at the storage, by its
/// method and query ([`Operation::of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    /// It sets what the key holds (S3's PutObject, CopyObject and
    /// CompleteMultipartUpload; Azure's Put Blob, Put Block List, Set Blob
    /// Metadata; any method or sub-resource fencegate does not know). The
    /// storage evaluates `If-Match` with one strong entity tag, and
    /// `If-None-Match: *`.
    Write,
    /// It removes the key (S3's DeleteObject, Azure's Delete Blob). S3
    /// evaluates `If-Match` only: `If-None-Match` on a DELETE is ignored, so
    /// no precondition a storage evaluates names a key that is absent.
    Delete,
    /// A DELETE of one version or snapshot (`versionId`, Azure's
    /// `versionid` or `snapshot`): conditioned as a [`Operation::Delete`],
    /// but the key may still hold a representation afterwards (an older
    /// version becomes the current one), so its answer teaches nothing.
    DeleteVersion,
    /// It changes neither what the key holds nor its entity tag, or stages
    /// data the key shows only once a later write makes it visible:
    /// exactly S3's PutObjectTagging, PutObjectAcl, PutObjectRetention and
    /// PutObjectLegalHold (`PUT ?tagging`, `?acl`, `?retention`,
    /// `?legal-hold`), UploadPart and UploadPartCopy (`PUT
    /// ?partNumber&uploadId`), CreateMultipartUpload (`POST ?uploads`),
    /// RestoreObject (`POST ?restore`), SelectObjectContent (`POST
    /// ?select&select-type=2`), AbortMultipartUpload (`DELETE ?uploadId`)
    /// and DeleteObjectTagging (`DELETE ?tagging`); Azure's Put Block (`PUT
    /// ?comp=block&blockid=…`). Storages evaluate no precondition on
    /// these: they go as they are and teach nothing.
    Aside,
    /// It changes what the key holds (or may), but the storage evaluates
    /// no precondition on it: Azure's Undelete Blob (`comp=undelete`, which
    /// brings back what a later term deleted), Set Blob Expiry
    /// (`comp=expiry`), Abort Copy Blob (`comp=copy`), and any `comp`
    /// fencegate does not know. Refused (`428`): no precondition protects
    /// it.
    Unconditional,
}

/// A write as [`Operation::of`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Classified {
    pub op: Operation,
    /// Its query has only neutral parameters (an SDK's hint, a signature):
    /// the request is the plain write of the key, and its answer shows the
    /// state it left. The answer of any other write teaches nothing (a
    /// part's, a version's, a sub-resource's entity tag is not the key's).
    pub plain: bool,
}

/// A parameter name fencegate knows, as a bit of a request's set.
mod bit {
    pub(super) const TAGGING: u32 = 1;
    pub(super) const ACL: u32 = 1 << 1;
    pub(super) const RETENTION: u32 = 1 << 2;
    pub(super) const LEGAL_HOLD: u32 = 1 << 3;
    pub(super) const PART_NUMBER: u32 = 1 << 4;
    pub(super) const UPLOAD_ID: u32 = 1 << 5;
    pub(super) const UPLOADS: u32 = 1 << 6;
    pub(super) const RESTORE: u32 = 1 << 7;
    pub(super) const SELECT: u32 = 1 << 8;
    pub(super) const SELECT_TYPE: u32 = 1 << 9;
    /// `comp=block` (Azure).
    pub(super) const COMP_BLOCK: u32 = 1 << 10;
    /// `comp=tags` (Azure).
    pub(super) const COMP_TAGS: u32 = 1 << 15;
    /// A `comp` whose operation evaluates preconditions
    /// ([`super::AZURE_CONDITIONED`]).
    pub(super) const COMP_CONDITIONED: u32 = 1 << 16;
    /// Any other `comp`.
    pub(super) const COMP_OTHER: u32 = 1 << 17;
    pub(super) const BLOCK_ID: u32 = 1 << 11;
    /// `versionId`, or (compared without case, as Azure does) `versionid`
    /// or `snapshot`.
    pub(super) const VERSION: u32 = 1 << 12;
    /// A name fencegate does not know, or one it knows given twice.
    pub(super) const OTHER: u32 = 1 << 13;
    /// A name or value that cannot be decoded one way only.
    pub(super) const UNDECODABLE: u32 = 1 << 14;
}

/// S3's writes that change no key: a method, the parameters it must have,
/// and those it may have besides (parameters that never change what is
/// done, [`NEUTRAL`], aside).
const S3_ASIDE: [(&str, u32, u32); 10] = [
    ("PUT", bit::TAGGING, bit::VERSION),
    ("PUT", bit::ACL, bit::VERSION),
    ("PUT", bit::RETENTION, bit::VERSION),
    ("PUT", bit::LEGAL_HOLD, bit::VERSION),
    ("PUT", bit::PART_NUMBER | bit::UPLOAD_ID, 0),
    ("POST", bit::UPLOADS, 0),
    ("POST", bit::RESTORE, bit::VERSION),
    ("POST", bit::SELECT, bit::SELECT_TYPE | bit::VERSION),
    ("DELETE", bit::UPLOAD_ID, 0),
    ("DELETE", bit::TAGGING, bit::VERSION),
];

/// Azure's: Put Block stages a block only a Put Block List makes visible;
/// Set Blob Tags changes neither the content nor the entity tag.
const AZURE_ASIDE: [(&str, u32, u32); 2] = [
    ("PUT", bit::COMP_BLOCK | bit::BLOCK_ID, 0),
    ("PUT", bit::COMP_TAGS, bit::VERSION),
];

/// Azure's `comp` values whose operation evaluates `If-Match` and
/// `If-None-Match` on the blob: Put Block List, Set Blob Metadata and
/// Properties, Put Page, Append Block, Snapshot Blob, Lease Blob. Any
/// other `comp` (but `block` and `tags`, aside) is
/// [`Operation::Unconditional`].
const AZURE_CONDITIONED: [&str; 7] = [
    "blocklist",
    "metadata",
    "properties",
    "page",
    "appendblock",
    "snapshot",
    "lease",
];

/// Parameters that leave a request what it is: SDK hints (`x-id`), the
/// signature of a presigned URL (AWS Signature V4 and V2) or of an Azure
/// SAS token, Azure's `timeout`, and the response overrides of a read
/// (S3's `response-*`, Azure's `rsc*`).
const NEUTRAL: [&str; 44] = [
    "x-id",
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
    "AWSAccessKeyId",
    "Signature",
    "Expires",
    "response-content-type",
    "response-content-language",
    "response-expires",
    "response-cache-control",
    "response-content-disposition",
    "response-content-encoding",
    "sv",
    "ss",
    "srt",
    "sp",
    "se",
    "st",
    "spr",
    "sig",
    "sr",
    "si",
    "sip",
    "ses",
    "sdd",
    "skoid",
    "sktid",
    "skt",
    "ske",
    "sks",
    "skv",
    "saoid",
    "suoid",
    "scid",
    "timeout",
    "rscc",
    "rscd",
    "rsce",
    "rscl",
];

/// `raw` percent-decoded, as a storage decodes a query's names and values;
/// `None` if it cannot be decoded one way only: a `+` (a space to some
/// storages, a plus to others), a `%` not followed by two hex digits, or
/// bytes that are not UTF-8. Borrowed unless it had an escape.
pub fn decode(raw: &str) -> Option<Cow<'_, str>> {
    let bytes = raw.as_bytes();
    if bytes.contains(&b'+') {
        return None;
    }
    if !bytes.contains(&b'%') {
        return Some(Cow::Borrowed(raw));
    }
    let well_formed = bytes.iter().enumerate().all(|(i, b)| {
        *b != b'%'
            || bytes
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
    });
    if !well_formed {
        return None;
    }
    percent_encoding::percent_decode_str(raw).decode_utf8().ok()
}

/// The query's parameters as `(name, value)`, each as sent (empty ones, as
/// in `a&&b`, are skipped, as storages skip them).
fn params(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
}

/// The bit of a decoded parameter `name` with `value`.
fn bit_of(name: &str, value: &str) -> u32 {
    match name {
        "tagging" => bit::TAGGING,
        "acl" => bit::ACL,
        "retention" => bit::RETENTION,
        "legal-hold" => bit::LEGAL_HOLD,
        "partNumber" => bit::PART_NUMBER,
        "uploadId" => bit::UPLOAD_ID,
        "uploads" => bit::UPLOADS,
        "restore" => bit::RESTORE,
        "select" => bit::SELECT,
        "select-type" => bit::SELECT_TYPE,
        "blockid" => bit::BLOCK_ID,
        "comp" => match decode(value) {
            Some(v) if v == "block" => bit::COMP_BLOCK,
            Some(v) if v == "tags" => bit::COMP_TAGS,
            Some(v) if AZURE_CONDITIONED.contains(&v.as_ref()) => bit::COMP_CONDITIONED,
            Some(_) => bit::COMP_OTHER,
            None => bit::UNDECODABLE,
        },
        _ if name.eq_ignore_ascii_case("versionid") || name.eq_ignore_ascii_case("snapshot") => {
            bit::VERSION
        }
        _ if is_neutral(name) => 0,
        _ => bit::OTHER,
    }
}

/// Whether `name` (decoded) is one of the [`NEUTRAL`] parameters.
fn is_neutral(name: &str) -> bool {
    NEUTRAL.contains(&name)
}

/// The set of parameters `query` has, as bits; a name given twice is
/// [`bit::OTHER`] (which of its values a storage takes is its own).
fn bits(query: &str) -> u32 {
    let mut set = 0;
    for (raw_name, value) in params(query) {
        let b = match decode(raw_name) {
            Some(name) => bit_of(&name, value),
            None => bit::UNDECODABLE,
        };
        let comp = bit::COMP_BLOCK | bit::COMP_TAGS | bit::COMP_CONDITIONED | bit::COMP_OTHER;
        let twice =
            b & set & !(bit::OTHER | bit::UNDECODABLE) != 0 || (b & comp != 0 && set & comp != 0);
        if twice {
            set |= bit::OTHER;
        }
        set |= b;
    }
    set
}

impl Operation {
    /// The operation a write of `method` (`PUT`, `DELETE`, …) with `query`
    /// (the request's query string, without `?`) is at a storage that
    /// speaks `dialect`: see [`Operation`]'s variants. `snapshots_only`:
    /// the request carries Azure's `x-ms-delete-snapshots: only` (a DELETE
    /// of the blob's snapshots, not of the blob).
    pub fn of(
        dialect: Dialect,
        method: &str,
        query: Option<&str>,
        snapshots_only: bool,
    ) -> Classified {
        let set = query.map_or(0, bits);
        let plain = set == 0;
        let by_name = planted(Mutant::AsideByName);
        let pairs: &[(&str, u32, u32)] = match dialect {
            Dialect::Any => &[],
            Dialect::S3 => &S3_ASIDE,
            Dialect::Azure => &AZURE_ASIDE,
        };
        let aside = set != 0
            && pairs.iter().any(|&(m, must, may)| {
                (m == method || by_name) && set & must == must && set & !(must | may) == 0
            });
        let op = if aside {
            Operation::Aside
        } else if dialect == Dialect::Azure
            && set & (bit::COMP_OTHER | bit::COMP_BLOCK | bit::COMP_TAGS) != 0
        {
            // A comp whose operation evaluates no precondition (Put Block
            // and Set Blob Tags with more than their own parameters too).
            Operation::Unconditional
        } else {
            match method {
                // A name that may decode to `versionId` may delete a
                // version; Azure's snapshots-only DELETE leaves the blob.
                "DELETE" if set & (bit::VERSION | bit::UNDECODABLE) != 0 || snapshots_only => {
                    Operation::DeleteVersion
                }
                "DELETE" => Operation::Delete,
                _ => Operation::Write,
            }
        };
        Classified { op, plain }
    }

    /// Whether the storage evaluates preconditions on it and it changes
    /// what the key holds: it must carry one.
    pub fn is_key_write(self) -> bool {
        !matches!(self, Operation::Aside | Operation::Unconditional)
    }

    /// Whether it deletes (the key, or a version of it).
    pub fn is_delete(self) -> bool {
        matches!(self, Operation::Delete | Operation::DeleteVersion)
    }
}

/// Whether a request of `method` with `query` reads the key's current
/// representation, so that its answer shows the key's state: a `GET` or
/// `HEAD` whose every parameter is one of the [`NEUTRAL`] ones (an
/// unknown one may name another version, a part or a sub-resource, whose
/// entity tag or absence is not the key's).
pub fn reads_the_key(method: &str, query: Option<&str>) -> bool {
    if !matches!(method, "GET" | "HEAD") {
        return false;
    }
    let Some(query) = query else {
        return true;
    };
    if planted(Mutant::ReadParamsIgnored) {
        return true;
    }
    params(query).all(|(name, _)| decode(name).is_some_and(|n| is_neutral(&n)))
}

/// How a request carries one precondition header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sent<'a> {
    /// Not at all.
    #[default]
    Absent,
    /// One line, with this value.
    One(&'a [u8]),
    /// More than one line.
    Several,
}

impl Sent<'_> {
    fn is_absent(&self) -> bool {
        *self == Sent::Absent
    }
}

/// A write's own `If-Match` and `If-None-Match`, as sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Own<'a> {
    pub if_match: Sent<'a>,
    pub if_none_match: Sent<'a>,
}

/// Why a client's own precondition protects nothing: the storage will not
/// compare it with a state the key held, so a late write that carries it
/// lands whatever a later term wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unprotected {
    /// Both `If-Match` and `If-None-Match`, or either more than once.
    NotOne,
    /// `If-Match` that is not one strong entity tag: `*` (which any
    /// representation matches, a later term's too), an empty value, a
    /// list, a weak tag.
    NotOneTag,
    /// `If-None-Match` other than `*` on a write: S3 evaluates only `*`.
    NoneMatchNotAny,
    /// `If-None-Match` on a DELETE: S3's DeleteObject ignores it.
    NoneMatchOnDelete,
}

impl Unprotected {
    /// What the problem document says.
    pub fn why(self) -> &'static str {
        match self {
            Unprotected::NotOne => "send one precondition, If-Match or If-None-Match, once",
            Unprotected::NotOneTag => {
                "If-Match must name one strong entity tag (\"…\"): * or a list matches a later term's writes too"
            }
            Unprotected::NoneMatchNotAny => {
                "If-None-Match on a write is evaluated only as * (the key is absent)"
            }
            Unprotected::NoneMatchOnDelete => {
                "If-None-Match on a DELETE is not evaluated (S3's DeleteObject compares If-Match only)"
            }
        }
    }
}

impl Own<'_> {
    /// It carries no precondition of its own.
    pub fn is_none(&self) -> bool {
        self.if_match.is_absent() && self.if_none_match.is_absent()
    }

    /// Whether this precondition, sent with `op`, names a state the storage
    /// will compare with the key's: one strong entity tag in `If-Match`, or
    /// (not on a DELETE) `If-None-Match: *`. An [`Operation::Aside`] write
    /// takes anything (it changes no key).
    pub fn protects(&self, op: Operation) -> Result<(), Unprotected> {
        if op == Operation::Aside || planted(Mutant::OwnPreconditionTrusted) {
            return Ok(());
        }
        match (self.if_match, self.if_none_match) {
            (Sent::One(tag), Sent::Absent) => match super::strong_tag(tag) {
                Some(_) => Ok(()),
                None => Err(Unprotected::NotOneTag),
            },
            (Sent::Absent, Sent::One(_)) if op.is_delete() => Err(Unprotected::NoneMatchOnDelete),
            (Sent::Absent, Sent::One(b"*")) => Ok(()),
            (Sent::Absent, Sent::One(_)) => Err(Unprotected::NoneMatchNotAny),
            (Sent::Absent, Sent::Several) if op.is_delete() => Err(Unprotected::NoneMatchOnDelete),
            _ => Err(Unprotected::NotOne),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Operation::{Aside, Delete, DeleteVersion, Unconditional, Write};

    fn op(dialect: Dialect, method: &str, query: Option<&str>) -> Operation {
        Operation::of(dialect, method, query, false).op
    }

    #[test]
    fn s3_writes_are_aside_only_for_exact_pairs() {
        for (method, query, want) in [
            ("PUT", None, Write),
            ("DELETE", None, Delete),
            ("POST", None, Write),
            ("PATCH", None, Write),
            ("PUT", Some("x-id=PutObject"), Write),
            ("PUT", Some("tagging"), Aside),
            ("PUT", Some("tagging&versionId=3"), Aside),
            ("PUT", Some("acl="), Aside),
            ("PUT", Some("retention"), Aside),
            ("PUT", Some("legal-hold"), Aside),
            ("PUT", Some("partNumber=1&uploadId=x"), Aside),
            (
                "PUT",
                Some("uploadId=x&partNumber=2&x-id=UploadPart"),
                Aside,
            ),
            ("POST", Some("uploads"), Aside),
            ("POST", Some("restore&versionId=1"), Aside),
            ("POST", Some("select&select-type=2"), Aside),
            (
                "DELETE",
                Some("uploadId=x&x-id=AbortMultipartUpload"),
                Aside,
            ),
            ("DELETE", Some("tagging"), Aside),
            // The shapes: a sub-resource of another method is the
            // method's key write at the storage (moto: PutObject,
            // DeleteObject, CompleteMultipartUpload).
            ("PUT", Some("uploads"), Write),
            ("PUT", Some("restore"), Write),
            ("PUT", Some("select"), Write),
            ("DELETE", Some("acl"), Delete),
            ("DELETE", Some("uploads"), Delete),
            ("DELETE", Some("retention"), Delete),
            ("DELETE", Some("legal-hold"), Delete),
            ("DELETE", Some("restore"), Delete),
            ("POST", Some("uploadId=U&partNumber=1"), Write),
            ("POST", Some("uploadId=U"), Write),
            ("POST", Some("tagging"), Write),
            // Azure's sub-resources are nothing to S3: PutObject.
            ("PUT", Some("comp=block&blockid=YQ"), Write),
            ("PUT", Some("comp=undelete"), Write),
            ("DELETE", Some("comp=block"), Delete),
            // A pair plus anything fencegate does not know, or twice.
            ("PUT", Some("tagging&x=1"), Write),
            ("PUT", Some("tagging&tagging"), Write),
            ("PUT", Some("partNumber=1&uploadId=x&tagging"), Write),
            // Case counts, as at S3.
            ("PUT", Some("Tagging"), Write),
            // Decoded as the storage decodes: a sub-resource still.
            ("PUT", Some("%74agging"), Aside),
            // A DELETE of a version may leave the key holding another.
            ("DELETE", Some("versionId=3"), DeleteVersion),
            ("DELETE", Some("version%49d=3"), DeleteVersion),
            ("DELETE", Some("versionid=3"), DeleteVersion),
            ("DELETE", Some("acl&versionId=3"), DeleteVersion),
            ("DELETE", Some("ver%zzsionId=3"), DeleteVersion),
            ("DELETE", Some("x-id=DeleteObject"), Delete),
        ] {
            assert_eq!(op(Dialect::S3, method, query), want, "{method} {query:?}");
        }
    }

    /// Azure reads S3's sub-resources as nothing (Put Blob, Delete Blob),
    /// and refuses no precondition on the comps that evaluate none (seen
    /// against Azurite: `PUT ?tagging` replaced the blob).
    #[test]
    fn azure_writes_are_aside_only_for_its_own_pairs() {
        for (method, query, want) in [
            ("PUT", None, Write),
            ("PUT", Some("comp=block&blockid=YQ"), Aside),
            ("PUT", Some("comp=bl%6Fck&blockid=YQ"), Aside),
            ("PUT", Some("comp=tags"), Aside),
            ("PUT", Some("comp=blocklist"), Write),
            ("PUT", Some("comp=metadata"), Write),
            ("PUT", Some("comp=properties"), Write),
            ("PUT", Some("comp=page"), Write),
            ("PUT", Some("comp=appendblock"), Write),
            ("PUT", Some("comp=snapshot"), Write),
            ("PUT", Some("comp=lease"), Write),
            ("PUT", Some("comp=undelete"), Unconditional),
            ("PUT", Some("comp=expiry"), Unconditional),
            ("PUT", Some("comp=copy&copyid=1"), Unconditional),
            ("PUT", Some("comp=tier"), Unconditional),
            ("PUT", Some("comp=block"), Unconditional),
            ("PUT", Some("comp=block&blockid=YQ&x=1"), Unconditional),
            (
                "PUT",
                Some("comp=block&comp=blocklist&blockid=YQ"),
                Unconditional,
            ),
            ("PUT", Some("tagging"), Write),
            ("PUT", Some("partNumber=1&uploadId=x"), Write),
            ("POST", Some("uploads"), Write),
            ("DELETE", None, Delete),
            ("DELETE", Some("tagging"), Delete),
            ("DELETE", Some("uploadId=x"), Delete),
            ("DELETE", Some("snapshot=2026-01-01"), DeleteVersion),
            ("DELETE", Some("versionid=2026-01-01"), DeleteVersion),
        ] {
            assert_eq!(
                op(Dialect::Azure, method, query),
                want,
                "{method} {query:?}"
            );
        }
        let snapshots = Operation::of(Dialect::Azure, "DELETE", None, true);
        assert_eq!(snapshots.op, DeleteVersion);
    }

    /// A storage fencegate knows nothing of: no write is aside.
    #[test]
    fn any_storage_has_no_writes_aside() {
        for query in [
            "tagging",
            "uploads",
            "partNumber=1&uploadId=x",
            "comp=block&blockid=YQ",
        ] {
            assert_eq!(op(Dialect::Any, "PUT", Some(query)), Write, "{query}");
            assert_eq!(op(Dialect::Any, "POST", Some(query)), Write, "{query}");
        }
        assert_eq!(op(Dialect::Any, "DELETE", Some("uploadId=x")), Delete);
    }

    /// Only a write whose query has nothing but neutral parameters is the
    /// plain write of the key, whose answer shows its state (seen failing:
    /// `PUT ?partNumber=1&uploadId=U&x=1`, moto's UploadPart, taught the
    /// part's tag as the key's).
    #[test]
    fn only_plain_writes_teach() {
        for (query, plain) in [
            (None, true),
            (Some("x-id=PutObject"), true),
            (Some("X-Amz-Signature=ab&X-Amz-Date=1"), true),
            (Some("partNumber=1&uploadId=U&x=1"), false),
            (Some("x=1"), false),
            (Some("comp=blocklist"), false),
            (Some("versionId=1"), false),
        ] {
            assert_eq!(
                Operation::of(Dialect::S3, "PUT", query, false).plain,
                plain,
                "{query:?}"
            );
        }
    }

    #[test]
    fn names_that_decode_more_than_one_way_are_unknown() {
        assert_eq!(decode("version%49d").as_deref(), Some("versionId"));
        assert_eq!(decode("plain").as_deref(), Some("plain"));
        for ambiguous in ["a+b", "%zz", "%4", "%", "%ff"] {
            assert_eq!(decode(ambiguous), None, "{ambiguous}");
        }
        assert_eq!(op(Dialect::S3, "PUT", Some("tag+ging")), Write);
        assert_eq!(op(Dialect::S3, "PUT", Some("tagging&%zz")), Write);
    }

    #[test]
    fn reads_of_the_key_have_only_neutral_parameters() {
        for query in [
            None,
            Some("x-id=GetObject"),
            Some("sv=2021-08-06&sig=abc&se=2030"),
            Some("response-content-type=a"),
            Some("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=ab"),
            Some("x%2Did=GetObject"),
            Some(""),
        ] {
            assert!(reads_the_key("GET", query), "{query:?}");
        }
        for query in [
            "versionId=1",
            "version%49d=x",
            "versionid=1",
            "snapshot=2026-01-01",
            "comp=metadata",
            "partNumber=1",
            "uploadId=x",
            "tagging",
            "x=1",
            "x-id=GetObject&a+b",
            "X-ID=GetObject",
        ] {
            assert!(!reads_the_key("HEAD", Some(query)), "{query}");
        }
        assert!(!reads_the_key("PUT", None));
        assert!(!reads_the_key("OPTIONS", None));
    }

    fn own<'a>(if_match: Sent<'a>, if_none_match: Sent<'a>) -> Own<'a> {
        Own {
            if_match,
            if_none_match,
        }
    }

    #[test]
    fn own_preconditions_must_name_a_state_the_storage_compares() {
        use Sent::{Absent, One, Several};
        let tag = One(b"\"a\"");
        assert!(own(Absent, Absent).is_none());
        for op in [Write, Delete, DeleteVersion] {
            assert_eq!(own(tag, Absent).protects(op), Ok(()), "{op:?}");
            for bad in [One(b"*"), One(b""), One(b"\"a\", \"b\""), One(b"W/\"a\"")] {
                assert_eq!(
                    own(bad, Absent).protects(op),
                    Err(Unprotected::NotOneTag),
                    "{op:?} {bad:?}"
                );
            }
            assert_eq!(own(Several, Absent).protects(op), Err(Unprotected::NotOne));
            assert_eq!(own(tag, One(b"*")).protects(op), Err(Unprotected::NotOne));
        }
        assert_eq!(own(Absent, One(b"*")).protects(Write), Ok(()));
        assert_eq!(
            own(Absent, One(b"\"x\"")).protects(Write),
            Err(Unprotected::NoneMatchNotAny)
        );
        for op in [Delete, DeleteVersion] {
            assert_eq!(
                own(Absent, One(b"*")).protects(op),
                Err(Unprotected::NoneMatchOnDelete)
            );
        }
        // A write that changes no key takes anything.
        assert_eq!(own(One(b"*"), One(b"x")).protects(Aside), Ok(()));
    }
}
