//! `fencegate run`: run a command while holding a lease, and stop it before
//! the lease can end.
//!
//! The command runs in its own process group with `FENCING_LEASE`,
//! `FENCING_TOKEN`, `FENCING_LEASE_ID`, `FENCEGATE_SERVER` (every member)
//! and `FENCEGATE_URL` (the member that granted the term) in its
//! environment. The term is renewed every third of the TTL by a
//! [`LeaseGuard`]; when the guard reports the lease lost (a refused renewal,
//! or the local deadline, which is `--margin` before the proxy's, passing
//! without a successful renewal), the whole group gets SIGTERM, then SIGKILL
//! after `--grace`, `run` releases the term if the proxy still has it (best
//! effort), and exits with code 6. When the command exits by itself, the
//! lease is released and `run` exits with the command's status.
//! SIGINT and SIGTERM sent to `run` are forwarded to the group.

use std::time::Duration;

use clap::Args;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};

use super::{exit_code, ServerArgs, EXIT_LEASE_LOST, EXIT_USAGE};
use crate::cli::loadtest::parse_duration_ms;
use crate::client::{GuardOptions, LeaseClient, LeaseGuard};

/// `fencegate run` options.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub connect: ServerArgs,
    /// The lease to hold: 1-128 letters, digits, '.', '_' and '-'.
    #[arg(long, value_parser = super::parse_lease_name)]
    pub lease: String,
    /// Who holds it: required, unless authentication is on (then the
    /// caller, if left out).
    #[arg(long, default_value = "", hide_default_value = true)]
    pub holder: String,
    /// How long the term lasts unless renewed, e.g. 10s.
    #[arg(long, value_parser = parse_duration_ms)]
    pub ttl: u64,
    /// Wait this long for a held lease, e.g. 30s.
    #[arg(long, default_value = "0ms", value_parser = parse_duration_ms)]
    pub wait: u64,
    /// Stop the command this long before the proxy's deadline (clock-rate
    /// error, delivery time). Default: a tenth of the TTL.
    #[arg(long, value_parser = parse_duration_ms)]
    pub margin: Option<u64>,
    /// Time between SIGTERM and SIGKILL when the lease is lost. Default:
    /// half the margin, so the group is gone before the proxy's deadline.
    #[arg(long, value_parser = parse_duration_ms)]
    pub grace: Option<u64>,
    /// The command and its arguments (after `--`).
    #[arg(trailing_var_arg = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// The longest `run` tries to release a lost term once its command is gone.
const RELEASE_AFTER_LOSS: Duration = Duration::from_secs(1);

/// The command to run, in a process group of its own, with the term in its
/// environment.
fn command(args: &RunArgs, client: &LeaseClient, guard: &LeaseGuard) -> Command {
    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("FENCING_LEASE", &args.lease)
        .env("FENCING_TOKEN", guard.token().to_string())
        .env("FENCING_LEASE_ID", guard.lease_id())
        // Every member, for the fencegate commands it may run; the one
        // that granted the term alone, for a curl.
        .env("FENCEGATE_SERVER", client.servers())
        .env("FENCEGATE_URL", client.server())
        .process_group(0);
    // The command writes through fencegate as the same caller: it gets the
    // secret's file (never the secret on a command line).
    if let Some(file) = &args.connect.token_file {
        command.env("FENCEGATE_TOKEN_FILE", file);
    }
    command
}

/// Stops the command's whole process group: SIGTERM, up to `grace_ms` for
/// it to exit, then SIGKILL for whatever is left, grandchildren included.
async fn stop_group(child: &mut Child, pgid: i32, grace_ms: u64) {
    signal_group(pgid, libc::SIGTERM);
    let _ = tokio::time::timeout(Duration::from_millis(grace_ms), child.wait()).await;
    signal_group(pgid, libc::SIGKILL);
    let _ = child.wait().await;
}

/// Signals the whole process group `pgid`.
fn signal_group(pgid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals a process group; it has no
    // memory-safety preconditions. Errors (ESRCH: the group is gone) are
    // expected and ignored. (One of the crate's three unsafe blocks.)
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(-pgid, sig);
    }
}

fn status_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}

/// Runs `fencegate run …`; returns the exit code.
pub async fn run(args: RunArgs) -> u8 {
    let margin_ms = args.margin.unwrap_or(args.ttl / 10);
    let grace_ms = args.grace.unwrap_or(margin_ms / 2);
    if margin_ms >= args.ttl {
        eprintln!("fencegate: --margin must be shorter than --ttl");
        return EXIT_USAGE;
    }
    if grace_ms > margin_ms {
        eprintln!("fencegate: warning: --grace is longer than --margin; the command may outlive the lease");
    }
    let client = match super::client(&args.connect) {
        Ok(client) => client,
        Err(code) => return code,
    };
    if let Err(code) = super::check_holder(&args.holder, &args.connect) {
        return code;
    }
    let options = GuardOptions {
        margin_ms: Some(margin_ms),
    };
    let guard = match client
        .hold(&args.lease, &args.holder, args.ttl, args.wait, options)
        .await
    {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("fencegate: cannot acquire {}: {e}", args.lease);
            return exit_code(&e);
        }
    };
    let (Ok(mut sigint), Ok(mut sigterm)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        eprintln!("fencegate: cannot install signal handlers");
        let _ = guard.release().await;
        return 1;
    };
    let mut child = match command(&args, &client, &guard).spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("fencegate: cannot run {:?}: {e}", args.command[0]);
            let _ = guard.release().await;
            return if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
        }
    };
    let Some(pgid) = child.id().and_then(|id| i32::try_from(id).ok()) else {
        let _ = guard.release().await;
        return 1;
    };
    loop {
        tokio::select! {
            status = child.wait() => {
                let code = match status {
                    Ok(status) => status_code(status),
                    Err(_) => 1,
                };
                if let Err(e) = guard.release().await {
                    eprintln!("fencegate: the command exited but the release failed: {e}");
                }
                return code;
            }
            () = guard.lost() => {
                let why = guard.lost_reason().map_or_else(|| "the renewer stopped".to_owned(), |l| l.to_string());
                eprintln!("fencegate: lease {} lost ({why}): stopping the command", args.lease);
                stop_group(&mut child, pgid, grace_ms).await;
                // The group is gone: if the term still lives at the proxy (a
                // missed local deadline), the next holder need not wait for
                // it. Best effort and brief, within the part of the margin
                // the grace did not use: the proxy may be unreachable.
                let bound = Duration::from_millis(margin_ms.saturating_sub(grace_ms) / 2)
                    .min(RELEASE_AFTER_LOSS);
                let _ = tokio::time::timeout(bound, guard.release()).await;
                return EXIT_LEASE_LOST;
            }
            _ = sigint.recv() => signal_group(pgid, libc::SIGINT),
            _ = sigterm.recv() => signal_group(pgid, libc::SIGTERM),
        }
    }
}
