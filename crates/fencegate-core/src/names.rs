//! The two names clients choose: a lease's and a holder's. A lease name is
//! checked once where it enters (the lease API, a route, the journal at
//! start); a holder's where it enters (an acquire's body, the auth config).
//! The lease store's acquire takes these types, so a name it keeps was
//! checked; its other operations only look names up, and take strings.

use std::fmt;

use compact_str::CompactString;

/// Longest lease name, in bytes.
pub const MAX_LEASE_NAME_LEN: usize = 128;

/// Longest holder name, in bytes.
pub const MAX_HOLDER_LEN: usize = 256;

/// A lease name: 1-128 bytes of `[A-Za-z0-9._-]`, so it is one path
/// segment that no backend decodes or normalises. Names up to 24 bytes are
/// held inline: naming a request's lease allocates nothing.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseName(CompactString);

/// A holder name (the holder of a term, or an authenticated caller): 1-256
/// bytes without control characters, so it can be logged and shown as is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder(String);

/// A name that breaks its rule; its `Display` states the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidName(&'static str);

impl fmt::Display for InvalidName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for InvalidName {}

impl LeaseName {
    /// `name`, if it is a lease name (checked before it is copied).
    pub fn new(name: &str) -> Result<Self, InvalidName> {
        let valid = (1..=MAX_LEASE_NAME_LEN).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if valid {
            Ok(Self(CompactString::new(name)))
        } else {
            Err(InvalidName(
                "a lease name is 1-128 bytes of letters, digits, '.', '_' and '-'",
            ))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Holder {
    /// `name`, if it is a holder name (checked before it is copied).
    pub fn new(name: &str) -> Result<Self, InvalidName> {
        if (1..=MAX_HOLDER_LEN).contains(&name.len()) && !name.chars().any(char::is_control) {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidName(
                "holder must be 1-256 bytes without control characters",
            ))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for LeaseName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Holder {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LeaseName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<LeaseName> for String {
    fn from(name: LeaseName) -> Self {
        name.0.into_string()
    }
}

impl From<Holder> for String {
    fn from(holder: Holder) -> Self {
        holder.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names() {
        for ok in ["a", "orders", "A.b_c-9", &"x".repeat(128)] {
            assert!(LeaseName::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "a b", "ü", "a%2f", &"x".repeat(129), "a\0"] {
            assert!(LeaseName::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn holder_names() {
        for ok in ["a", "worker 7", "ü", &"x".repeat(256)] {
            assert!(Holder::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a\nb", "\u{7f}", "a\u{85}", &"x".repeat(257)] {
            assert!(Holder::new(bad).is_err(), "{bad:?}");
        }
    }
}
