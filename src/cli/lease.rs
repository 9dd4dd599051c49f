//! `fencegate lease acquire|renew|release|show`.

use clap::{Args, Subcommand};

use super::{exit_code, ServerArgs};
use crate::cli::loadtest::parse_duration_ms;
use crate::client::Grant;

/// `fencegate lease` options.
#[derive(Args, Debug)]
pub struct LeaseArgs {
    #[command(flatten)]
    pub connect: ServerArgs,
    /// Print the server's JSON answer.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: LeaseCommand,
}

/// What to do with a lease.
#[derive(Subcommand, Debug)]
pub enum LeaseCommand {
    /// Acquire a lease (waiting up to --wait if it is held).
    Acquire {
        /// The lease's name: 1-128 letters, digits, '.', '_' and '-'.
        #[arg(value_parser = super::parse_lease_name)]
        lease: String,
        /// Who holds it: required, unless authentication is on (then the
        /// caller, if left out).
        #[arg(long, default_value = "", hide_default_value = true)]
        holder: String,
        /// How long the term lasts unless renewed, e.g. 10s.
        #[arg(long, value_parser = parse_duration_ms)]
        ttl: u64,
        /// Wait this long for a held lease, e.g. 5s.
        #[arg(long, default_value = "0ms", value_parser = parse_duration_ms)]
        wait: u64,
        /// Print shell assignments: vars=$(fencegate lease acquire … --export) &&
        /// eval "$vars" (the shell stops there if the acquire fails).
        #[arg(long)]
        export: bool,
    },
    /// Renew a held term.
    Renew {
        /// The lease's name: 1-128 letters, digits, '.', '_' and '-'.
        #[arg(value_parser = super::parse_lease_name)]
        lease: String,
        /// The term's fencing token.
        #[arg(long, env = "FENCING_TOKEN")]
        token: u64,
        /// The term's lease id.
        #[arg(long, env = "FENCING_LEASE_ID", hide_env_values = true)]
        lease_id: String,
        /// A new TTL, e.g. 30s.
        #[arg(long, value_parser = parse_duration_ms)]
        ttl: Option<u64>,
    },
    /// Release a held term.
    Release {
        /// The lease's name: 1-128 letters, digits, '.', '_' and '-'.
        #[arg(value_parser = super::parse_lease_name)]
        lease: String,
        /// The term's fencing token.
        #[arg(long, env = "FENCING_TOKEN")]
        token: u64,
        /// The term's lease id.
        #[arg(long, env = "FENCING_LEASE_ID", hide_env_values = true)]
        lease_id: String,
    },
    /// Show one lease, or all of them.
    Show {
        /// One lease's name; all of them (every page) if left out.
        #[arg(value_parser = super::parse_lease_name)]
        lease: Option<String>,
    },
}

/// Quotes `s` for a POSIX shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Prints a grant; with `export`, as shell assignments, `FENCEGATE_SERVER`
/// being every member the client knows (`servers`), so a client started
/// from them follows the primary too.
fn print_grant(g: &Grant, json: bool, export: bool, servers: &str) {
    if export {
        println!("export FENCING_LEASE={}", shell_quote(&g.lease));
        println!("export FENCING_TOKEN={}", g.token);
        println!("export FENCING_LEASE_ID={}", shell_quote(&g.lease_id));
        println!("export FENCEGATE_SERVER={}", shell_quote(servers));
        // The member that granted the term, one URL, for curl.
        let url = servers.split(',').next().unwrap_or_default();
        println!("export FENCEGATE_URL={}", shell_quote(url));
    } else if json {
        println!("{}", serde_json::to_string(g).unwrap_or_default());
    } else {
        println!(
            "{} held by {}: token {}, expires in {} ms (ttl {} ms)",
            g.lease, g.holder, g.token, g.expires_in_ms, g.ttl_ms
        );
        if !g.lease_id.is_empty() {
            println!("lease id: {}", g.lease_id);
        }
    }
}

/// Runs `fencegate lease …`; returns the exit code.
pub async fn run(args: LeaseArgs) -> u8 {
    let client = match super::client(&args.connect) {
        Ok(client) => client,
        Err(code) => return code,
    };
    let result = match &args.command {
        LeaseCommand::Acquire { holder, .. }
            if super::check_holder(holder, &args.connect).is_err() =>
        {
            return super::EXIT_USAGE;
        }
        LeaseCommand::Acquire {
            lease,
            holder,
            ttl,
            wait,
            export,
        } => client
            .acquire(lease, holder, *ttl, *wait)
            .await
            .map(|g| print_grant(&g, args.json, *export, &client.servers())),
        LeaseCommand::Renew {
            lease,
            token,
            lease_id,
            ttl,
        } => client
            .renew(lease, *token, lease_id, *ttl)
            .await
            .map(|g| print_grant(&g, args.json, false, &client.servers())),
        LeaseCommand::Release {
            lease,
            token,
            lease_id,
        } => client.release(lease, *token, lease_id).await.map(|()| {
            if !args.json {
                println!("{lease} released (token {token})");
            }
        }),
        LeaseCommand::Show { lease } => client.show(lease.as_deref()).await.map(|v| {
            if args.json {
                println!("{v}");
            } else {
                let rows = match v.get("leases").and_then(|l| l.as_array()) {
                    Some(all) => all.clone(),
                    None => vec![v],
                };
                for l in rows {
                    println!(
                        "{}: {} by {}, token {}, expires in {} ms, {} terms",
                        l["lease"].as_str().unwrap_or_default(),
                        l["state"].as_str().unwrap_or_default(),
                        l["holder"].as_str().unwrap_or_default(),
                        l["token"],
                        l["expires_in_ms"],
                        l["transitions"]
                    );
                }
            }
        }),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("fencegate: {e}");
            exit_code(&e)
        }
    }
}
