//! Bearer-token authentication (off by default).
//!
//! The config lists callers by name with the SHA-256 of their secret, never
//! the secret itself. With authentication on, every request but the health
//! checks needs `Authorization: Bearer <secret>`; the caller's name is then
//! the holder of the leases it acquires, and only that caller may renew,
//! release, inspect or write under them. Admin callers may also use the
//! clock, metrics and apply-log endpoints and inspect every lease.

use crate::hex;
use crate::names::Holder;

use std::collections::HashMap;
use std::sync::Arc;

use http::header::AUTHORIZATION;
use http::HeaderMap;
use sha2::{Digest, Sha256};

use serde::{Deserialize, Serialize};

/// Authentication of callers.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Require `Authorization: Bearer <secret>` on every request but health.
    pub enabled: bool,
    /// Allow listening on a non-loopback address with authentication off.
    pub allow_unauthenticated_non_loopback: bool,
    /// Known callers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<AuthToken>,
}

/// One caller's credential.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AuthToken {
    /// The caller's name: the holder of the leases it acquires.
    pub name: String,
    /// SHA-256 of the bearer secret, as 64 hex digits.
    pub sha256: String,
    /// May use the clock, metrics and apply-log endpoints, and inspect every lease.
    #[serde(default)]
    pub admin: bool,
}

/// Who is calling.
#[derive(Debug, PartialEq, Eq)]
pub struct Identity {
    pub name: Holder,
    pub admin: bool,
}

/// The authenticated caller (in the request's context, see
/// `backend::RequestContext`).
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<Identity>);

/// Why the configured tokens cannot be used.
#[derive(Debug)]
pub enum AuthError {
    /// Authentication is on with no token.
    NoTokens,
    /// A token's name is not a valid holder name.
    Name { name: String, why: String },
    /// A token's digest is not 64 hex digits.
    Digest { name: String },
    /// Two tokens have the same secret.
    SameSecret { name: String },
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthError::NoTokens => {
                f.write_str("auth.enabled needs at least one [[auth.tokens]] entry")
            }
            AuthError::Name { name, why } => write!(f, "auth token name {name:?}: {why}"),
            AuthError::Digest { name } => {
                write!(f, "auth token {name:?}: sha256 must be 64 hex digits")
            }
            AuthError::SameSecret { name } => {
                write!(f, "auth token {name:?}: the same secret is listed twice")
            }
        }
    }
}

impl std::error::Error for AuthError {}

/// Checks bearer tokens against the configured digests.
#[derive(Debug)]
pub struct Authenticator {
    by_digest: HashMap<[u8; 32], Arc<Identity>>,
}

impl Authenticator {
    /// The authenticator the config asks for (`None` when auth is off).
    pub fn from_config(config: &AuthConfig) -> Result<Option<Self>, AuthError> {
        if !config.enabled {
            return Ok(None);
        }
        if config.tokens.is_empty() {
            return Err(AuthError::NoTokens);
        }
        let mut by_digest = HashMap::new();
        for t in &config.tokens {
            let name = Holder::new(t.name.as_str()).map_err(|e| AuthError::Name {
                name: t.name.clone(),
                why: e.to_string(),
            })?;
            let digest = hex::decode32(&t.sha256).ok_or_else(|| AuthError::Digest {
                name: t.name.clone(),
            })?;
            let identity = Arc::new(Identity {
                name,
                admin: t.admin,
            });
            if by_digest.insert(digest, identity).is_some() {
                return Err(AuthError::SameSecret {
                    name: t.name.clone(),
                });
            }
        }
        Ok(Some(Self { by_digest }))
    }

    /// The caller presenting `headers`, if its bearer token is known.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<Arc<Identity>> {
        let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
        let (scheme, secret) = value.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("bearer") || secret.is_empty() {
            return None;
        }
        // Lookup by digest: the secret itself is never stored or compared.
        let digest: [u8; 32] = Sha256::digest(secret.trim().as_bytes()).into();
        self.by_digest.get(&digest).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(s: &str) -> String {
        Sha256::digest(s.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn bearer_tokens_map_to_identities() {
        let config = AuthConfig {
            enabled: true,
            tokens: vec![AuthToken {
                name: "w1".into(),
                sha256: sha("s3cret"),
                admin: false,
            }],
            ..AuthConfig::default()
        };
        let auth = Authenticator::from_config(&config).unwrap().unwrap();
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, v.parse().unwrap());
            auth.authenticate(&h)
        };
        assert_eq!(with("Bearer s3cret").unwrap().name.as_str(), "w1");
        assert_eq!(with("bearer s3cret").unwrap().name.as_str(), "w1");
        assert!(with("Bearer wrong").is_none());
        assert!(with("Basic s3cret").is_none());
        assert!(with("Bearer ").is_none());
        assert!(auth.authenticate(&HeaderMap::new()).is_none());
    }

    #[test]
    fn bad_auth_config_is_refused() {
        let token = |sha256: &str| AuthToken {
            name: "w".into(),
            sha256: sha256.into(),
            admin: false,
        };
        let cfg = |tokens| AuthConfig {
            enabled: true,
            tokens,
            ..AuthConfig::default()
        };
        assert!(Authenticator::from_config(&cfg(vec![])).is_err());
        assert!(Authenticator::from_config(&cfg(vec![token("abc")])).is_err());
        assert!(
            Authenticator::from_config(&cfg(vec![token(&sha("a")), token(&sha("a"))])).is_err()
        );
        assert!(Authenticator::from_config(&AuthConfig::default())
            .unwrap()
            .is_none());
    }
}
