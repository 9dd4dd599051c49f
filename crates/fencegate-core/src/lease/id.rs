//! Lease ids: the credential that proves a writer holds a term.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::hex;
use subtle::ConstantTimeEq;

/// Number of random bytes in a lease id (128 bits).
pub const ID_BYTES: usize = 16;
/// Length of the text form: lowercase hex.
pub const LEASE_ID_LEN: usize = ID_BYTES * 2;

/// An unguessable lease id: 128 bits from the OS RNG, kept in its text form,
/// or (for a term a cluster member loaded from etcd, which never holds ids in
/// clear) only as the SHA-256 digest of that text.
///
/// `Debug` and `Display` redact it, so a stray `{:?}` in a log line cannot leak
/// it; the only way to read it is [`LeaseId::expose`], which the lease API uses
/// to answer the acquirer. Comparisons with a presented id run in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseId(Form);

#[derive(Clone, PartialEq, Eq)]
enum Form {
    Text([u8; LEASE_ID_LEN]),
    Sha256([u8; 32]),
}

impl LeaseId {
    /// The id with these random bytes: the lease store draws them from the
    /// OS random number generator (the core reads no randomness itself).
    pub fn from_bytes(raw: [u8; ID_BYTES]) -> Self {
        let mut text = [0u8; LEASE_ID_LEN];
        hex::encode_into(&raw, &mut text);
        Self(Form::Text(text))
    }

    /// The text form as bytes, for the journal (all zeros for an id known
    /// only by its digest, which is never journaled: only fresh ids are).
    pub fn to_text(&self) -> [u8; LEASE_ID_LEN] {
        match &self.0 {
            Form::Text(text) => *text,
            Form::Sha256(_) => [0; LEASE_ID_LEN],
        }
    }

    /// An id from its text form (as the journal stores it); `None` unless it
    /// is 32 lowercase hex digits.
    pub fn from_text(text: [u8; LEASE_ID_LEN]) -> Option<Self> {
        text.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .then_some(Self(Form::Text(text)))
    }

    /// An id known only by the SHA-256 digest of its text form.
    pub fn from_sha256(digest: [u8; 32]) -> Self {
        Self(Form::Sha256(digest))
    }

    /// The SHA-256 digest of the text form: what a store shared by several
    /// members keeps instead of the id.
    pub fn sha256(&self) -> [u8; 32] {
        match &self.0 {
            Form::Text(text) => text_digest(text),
            Form::Sha256(digest) => *digest,
        }
    }

    /// Whether `presented` is this id. Constant time in the content of the id;
    /// only the (public) length can short-circuit.
    pub fn matches(&self, presented: &[u8]) -> bool {
        match &self.0 {
            Form::Text(text) => text.as_slice().ct_eq(presented).into(),
            Form::Sha256(digest) => {
                presented.len() == LEASE_ID_LEN
                    && bool::from(Sha256::digest(presented).as_slice().ct_eq(digest))
            }
        }
    }

    /// The text form, for the one response that hands it to the acquirer
    /// (empty for an id known only by its digest; only fresh ids are
    /// handed out).
    pub fn expose(&self) -> &str {
        match &self.0 {
            // The text form is built from ASCII hex digits only.
            Form::Text(text) => std::str::from_utf8(text).unwrap_or_default(),
            Form::Sha256(_) => "",
        }
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseId(<redacted>)")
    }
}

/// The SHA-256 digest of an id's text form, as the journal holds it: what
/// a store shared by several members keeps instead of the id
/// ([`LeaseId::sha256`]).
pub fn text_digest(text: &[u8; LEASE_ID_LEN]) -> [u8; 32] {
    Sha256::digest(text).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_is_hex_and_compares_exactly() {
        let id = LeaseId::from_bytes([0xab; 16]);
        assert_eq!(id.expose(), "ab".repeat(16));
        assert!(id.matches("ab".repeat(16).as_bytes()));
        assert!(!id.matches("ab".repeat(15).as_bytes()));
        assert!(!id.matches(("ab".repeat(15) + "ac").as_bytes()));
        assert!(!id.matches(b""));
    }

    #[test]
    fn text_round_trip() {
        let id = LeaseId::from_bytes([0x5c; 16]);
        assert_eq!(LeaseId::from_text(id.to_text()), Some(id));
        assert_eq!(LeaseId::from_text([b'G'; 32]), None);
    }

    #[test]
    fn an_id_known_by_its_digest_matches_only_its_text() {
        let id = LeaseId::from_bytes([0x3c; 16]);
        let hashed = LeaseId::from_sha256(id.sha256());
        assert_eq!(hashed.sha256(), id.sha256());
        assert!(hashed.matches(id.expose().as_bytes()));
        assert!(!hashed.matches(LeaseId::from_bytes([0x3d; 16]).expose().as_bytes()));
        assert!(!hashed.matches(&id.sha256()));
        assert!(!hashed.matches(b""));
        assert_eq!(hashed.expose(), "");
    }

    #[test]
    fn debug_never_shows_the_id() {
        let id = LeaseId::from_bytes([0x11; 16]);
        assert!(!format!("{id:?}").contains("11"));
    }
}
