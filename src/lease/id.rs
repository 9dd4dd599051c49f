//! Lease ids: the credential that proves a writer holds a term.

use std::fmt;

use subtle::ConstantTimeEq;

/// Number of random bytes in a lease id (128 bits).
const ID_BYTES: usize = 16;
/// Length of the text form: lowercase hex.
pub const LEASE_ID_LEN: usize = ID_BYTES * 2;

/// An unguessable lease id: 128 bits from the OS RNG, kept in its text form.
///
/// `Debug` and `Display` redact it, so a stray `{:?}` in a log line cannot leak
/// it; the only way to read it is [`LeaseId::expose`], which the lease API uses
/// to answer the acquirer. Comparisons with a presented id run in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseId([u8; LEASE_ID_LEN]);

impl LeaseId {
    /// A fresh id from the OS random number generator.
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut raw = [0u8; ID_BYTES];
        getrandom::fill(&mut raw)?;
        Ok(Self::from_bytes(raw))
    }

    /// The id with these random bytes (tests and journal replay).
    pub fn from_bytes(raw: [u8; ID_BYTES]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = [0u8; LEASE_ID_LEN];
        for (i, b) in raw.iter().enumerate() {
            text[2 * i] = HEX[usize::from(b >> 4)];
            text[2 * i + 1] = HEX[usize::from(b & 0x0f)];
        }
        Self(text)
    }

    /// The text form as bytes, for the journal.
    pub fn to_text(&self) -> [u8; LEASE_ID_LEN] {
        self.0
    }

    /// An id from its text form (as the journal stores it); `None` unless it
    /// is 32 lowercase hex digits.
    pub fn from_text(text: [u8; LEASE_ID_LEN]) -> Option<Self> {
        text.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .then_some(Self(text))
    }

    /// Whether `presented` is this id. Constant time in the content of the id;
    /// only the (public) length can short-circuit.
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_slice().ct_eq(presented).into()
    }

    /// The text form, for the one response that hands it to the acquirer.
    pub fn expose(&self) -> &str {
        // The text form is built from ASCII hex digits only.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseId(<redacted>)")
    }
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
    fn debug_never_shows_the_id() {
        let id = LeaseId::from_bytes([0x11; 16]);
        assert!(!format!("{id:?}").contains("11"));
    }

    #[test]
    fn generated_ids_differ() {
        let a = LeaseId::generate().unwrap();
        let b = LeaseId::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), LEASE_ID_LEN);
    }
}
