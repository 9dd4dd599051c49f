//! The client commands: `fencegate lease`, `fencegate run` and
//! `fencegate loadtest`.
//!
//! Exit codes, the same for every client command:
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | done |
//! | 2 | usage error |
//! | 3 | the lease is held by someone else (`lease-held`) |
//! | 4 | refused: stale, unknown, expired or released term, or wrong lease id |
//! | 5 | the server is unreachable, or cannot persist (`lease-store-unavailable`) |
//! | 6 | `fencegate run`: the lease was lost and the command was stopped |
//! | 7 | any other problem from the server |
//! | 8 | not allowed: no valid bearer secret (`unauthorized`), or another caller's term (`forbidden`) |
//!
//! `fencegate run` otherwise exits with its command's status (128 + signal
//! number if the command was killed by a signal).

pub mod lease;
pub mod loadtest;
pub mod run;

use std::path::PathBuf;

use crate::client::{ClientError, LeaseClient};

/// How a client command reaches fencegate.
#[derive(clap::Args, Clone, Debug)]
pub struct ServerArgs {
    /// The fencegate to talk to (http:// or https://); the members of a
    /// cluster comma-separated, to follow its primary.
    #[arg(long, env = "FENCEGATE_SERVER", default_value = DEFAULT_SERVER, global = true)]
    pub server: String,
    /// Also trust the CA certificates (PEM) in this file, for an https://
    /// server with a private CA or a self-signed certificate.
    #[arg(long, env = "FENCEGATE_CACERT", global = true)]
    pub cacert: Option<PathBuf>,
    /// A file holding the bearer secret, for a fencegate with authentication
    /// on (or put the secret itself in FENCEGATE_TOKEN). Never echoed.
    #[arg(long, env = "FENCEGATE_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
}

/// Why the bearer secret cannot be had.
#[derive(Debug)]
pub enum SecretError {
    /// `--token-file` cannot be read.
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The secret is empty.
    Empty,
}

impl std::fmt::Display for SecretError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Read { path, error } => write!(f, "--token-file {}: {error}", path.display()),
            Self::Empty => f.write_str("the bearer secret is empty"),
        }
    }
}

impl std::error::Error for SecretError {}

/// The bearer secret to send: `--token-file`, else `FENCEGATE_TOKEN`.
pub fn bearer_secret(token_file: Option<&PathBuf>) -> Result<Option<String>, SecretError> {
    let secret = match token_file {
        Some(path) => std::fs::read_to_string(path).map_err(|error| SecretError::Read {
            path: path.clone(),
            error,
        })?,
        None => match std::env::var("FENCEGATE_TOKEN") {
            Ok(secret) => secret,
            Err(_) => return Ok(None),
        },
    };
    let secret = secret.trim();
    if secret.is_empty() {
        return Err(SecretError::Empty);
    }
    Ok(Some(secret.to_owned()))
}

/// A URL that names no server: it starts with neither `http://` nor
/// `https://`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotAServer {
    /// What the URL is (a flag's name).
    pub what: String,
    pub url: String,
}

impl std::fmt::Display for NotAServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:?} must start with http:// or https://",
            self.what, self.url
        )
    }
}

impl std::error::Error for NotAServer {}

/// Checks that `url` names a server: `http://` or `https://`.
pub fn check_url(what: &str, url: &str) -> Result<(), NotAServer> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(NotAServer {
            what: what.to_owned(),
            url: url.to_owned(),
        })
    }
}

/// clap's parser of a lease name: the server's rule, said before any
/// request is sent.
pub fn parse_lease_name(s: &str) -> Result<String, crate::names::InvalidName> {
    crate::names::LeaseName::new(s).map(|name| name.as_str().to_owned())
}

/// An empty `--holder` is the authenticated caller; without a bearer secret
/// there is none, and the server would refuse the acquire: a usage error,
/// said as one (printed).
pub fn check_holder(holder: &str, args: &ServerArgs) -> Result<(), u8> {
    let authenticated = matches!(bearer_secret(args.token_file.as_ref()), Ok(Some(_)));
    if holder.is_empty() && !authenticated {
        eprintln!(
            "fencegate: --holder is required (with authentication on, the caller holds the \
             term when it is left out)"
        );
        return Err(EXIT_USAGE);
    }
    Ok(())
}

/// A client for the server `args` name, with its CA file and bearer secret;
/// a bad setting is a usage error (printed).
pub fn client(args: &ServerArgs) -> Result<LeaseClient, u8> {
    let usage = |e: String| {
        eprintln!("fencegate: {e}");
        EXIT_USAGE
    };
    for server in args.server.split(',') {
        check_url("--server", server.trim()).map_err(|e| usage(e.to_string()))?;
    }
    let client = match &args.cacert {
        None => LeaseClient::new(&args.server),
        Some(path) => LeaseClient::with_ca_file(&args.server, path)
            .map_err(|e| usage(format!("--cacert {e}")))?,
    };
    match bearer_secret(args.token_file.as_ref()).map_err(|e| usage(e.to_string()))? {
        Some(secret) => client
            .with_bearer(&secret)
            .map_err(|e| usage(e.to_string())),
        None => Ok(client),
    }
}

pub const EXIT_USAGE: u8 = 2;
pub const EXIT_HELD: u8 = 3;
pub const EXIT_REFUSED: u8 = 4;
pub const EXIT_UNREACHABLE: u8 = 5;
pub const EXIT_LEASE_LOST: u8 = 6;
pub const EXIT_PROBLEM: u8 = 7;
pub const EXIT_NOT_ALLOWED: u8 = 8;

/// The exit code for a failed lease call.
pub fn exit_code(err: &ClientError) -> u8 {
    match err {
        ClientError::Problem { reason, status, .. } => match reason.as_str() {
            "lease-held" => EXIT_HELD,
            "stale-fencing-token"
            | "unknown-fencing-token"
            | "lease-expired"
            | "lease-released"
            | "lease-id-mismatch" => EXIT_REFUSED,
            "lease-store-unavailable" => EXIT_UNREACHABLE,
            "unauthorized" | "forbidden" => EXIT_NOT_ALLOWED,
            _ if *status == 400 => EXIT_USAGE,
            _ => EXIT_PROBLEM,
        },
        ClientError::Unreachable(_) => EXIT_UNREACHABLE,
        ClientError::Protocol(_) => EXIT_PROBLEM,
        ClientError::Lost(_) => EXIT_LEASE_LOST,
    }
}

/// The server to talk to: `--server`, else `FENCEGATE_SERVER`, else the
/// local default listener.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:8080";
