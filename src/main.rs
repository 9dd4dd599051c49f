//! Process wiring only: arguments and environment → config → telemetry →
//! `serve::run(config, options, shutdown_signal())` (or a client command).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use fencegate::cli::lease::LeaseArgs;
use fencegate::cli::loadtest::LoadtestArgs;
use fencegate::cli::run::RunArgs;
use fencegate::config::Config;
use fencegate::serve::{self, shutdown_signal, BackendArgs, ServeArgs, StartOptions};

#[derive(Parser)]
#[command(
    name = "fencegate",
    version,
    about = "An HTTP reverse proxy that rejects stale writers with lease fencing tokens"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the fencing proxy in front of a backend.
    Serve(ServeArgs),
    /// Run the embedded key-value store alone, unfenced.
    Backend(BackendArgs),
    /// Acquire, renew, release or show leases.
    Lease(LeaseArgs),
    /// Run a command while holding a lease; stop it if the lease is lost.
    Run(RunArgs),
    /// Load-test stale-writer rejection and check that nothing stale landed.
    Loadtest(LoadtestArgs),
}

/// Logs go to stderr: human-readable by default, JSON lines with
/// `FENCEGATE_LOG_FORMAT=json`. `FENCEGATE_LOG` (or `RUST_LOG`) sets levels;
/// lease decisions are logged under the `audit` target.
fn init_tracing() {
    let filter = std::env::var("FENCEGATE_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr);
    if std::env::var("FENCEGATE_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().with_current_span(false).init();
    } else {
        builder.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// What `main` runs once the arguments are read: `serve` has its config
/// loaded first, because the config picks the runtime.
enum Job {
    Serve(Config, StartOptions),
    Other(Command),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let job = match cli.command {
        Command::Serve(args) => match args.load(std::env::vars()) {
            Ok((config, options)) => Job::Serve(config, options),
            Err(e) => {
                eprintln!("fencegate: {e}");
                return ExitCode::from(2);
            }
        },
        other => Job::Other(other),
    };
    let threads = match &job {
        Job::Serve(config, _) => config.runtime.worker_threads,
        Job::Other(_) => 0,
    };
    let runtime = match serve::runtime(threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencegate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<u8, String> = runtime.block_on(async {
        match job {
            Job::Serve(config, options) => serve::run(config, options, shutdown_signal())
                .await
                .map(|()| 0)
                .map_err(|e| e.to_string()),
            Job::Other(Command::Serve(_)) => Err("serve's config was not loaded".into()),
            Job::Other(Command::Backend(args)) => {
                serve::backend(&args.listen, args.record, shutdown_signal())
                    .await
                    .map(|()| 0)
                    .map_err(|e| e.to_string())
            }
            Job::Other(Command::Lease(args)) => Ok(fencegate::cli::lease::run(args).await),
            Job::Other(Command::Run(args)) => Ok(fencegate::cli::run::run(args).await),
            Job::Other(Command::Loadtest(args)) => {
                let (report, status) = fencegate::cli::loadtest::run(args).await?;
                print!("{}", fencegate::cli::loadtest::summary(&report));
                Ok(status)
            }
        }
    });
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(status) => ExitCode::from(status),
        Err(e) => {
            eprintln!("fencegate: {e}");
            ExitCode::from(2)
        }
    }
}
