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
//!
//! `fencegate run` otherwise exits with its command's status (128 + signal
//! number if the command was killed by a signal).

pub mod lease;
pub mod loadtest;
pub mod run;

use std::path::PathBuf;

use crate::client::{ClientError, LeaseClient};

/// A client for `server`, trusting `ca_file` too if given; a bad CA file
/// is a usage error.
pub fn client(server: &str, ca_file: Option<&PathBuf>) -> Result<LeaseClient, u8> {
    match ca_file {
        None => Ok(LeaseClient::new(server)),
        Some(path) => LeaseClient::with_ca_file(server, path).map_err(|e| {
            eprintln!("fencegate: --cacert {e}");
            EXIT_USAGE
        }),
    }
}

pub const EXIT_USAGE: u8 = 2;
pub const EXIT_HELD: u8 = 3;
pub const EXIT_REFUSED: u8 = 4;
pub const EXIT_UNREACHABLE: u8 = 5;
pub const EXIT_LEASE_LOST: u8 = 6;
pub const EXIT_PROBLEM: u8 = 7;

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
            _ if *status == 400 => EXIT_USAGE,
            _ => EXIT_PROBLEM,
        },
        ClientError::Unreachable(_) => EXIT_UNREACHABLE,
        ClientError::Protocol(_) => EXIT_PROBLEM,
    }
}

/// The server to talk to: `--server`, else `FENCEGATE_SERVER`, else the
/// local default listener.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:8080";
