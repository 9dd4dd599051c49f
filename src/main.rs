//! Process wiring only: the global allocator; arguments → telemetry → a runtime →
//! `serve::run(config, options, shutdown_signal())` (the config is loaded
//! first, as it picks the runtime) or a client command.

use std::future::Future;
use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use fencegate::cli::{self, lease::LeaseArgs, loadtest::LoadtestArgs, run::RunArgs};
use fencegate::config::{RuntimeConfig, Scheduler};
use fencegate::serve::{self, shutdown_signal, BackendArgs, ServeArgs};

/// mimalloc (its v2 line) rather than glibc's malloc: every proxied request
/// allocates and frees the same few dozen small blocks, which mimalloc's
/// per-thread free lists serve in fewer instructions (about 2,300 fewer
/// per fenced PUT, docs/performance.md), and its cost does not move with
/// the process's memory layout as glibc's consolidation of freed blocks
/// does.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Loadtest(Box<LoadtestArgs>),
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

/// A test build (the `test-util` feature) plants the bug named by
/// `FENCEGATE_TEST_MUTANT` (see `fencegate_core::mutant`), so tests of the
/// real binary can show they catch it.
#[cfg(feature = "test-util")]
fn plant_test_mutant() {
    use fencegate_core::mutant::{plant, Mutant};
    if let Ok(name) = std::env::var("FENCEGATE_TEST_MUTANT") {
        let mutant = Mutant::from_name(&name);
        assert!(
            mutant.is_some(),
            "FENCEGATE_TEST_MUTANT: no mutant {name:?}"
        );
        tracing::warn!(mutant = name, "a planted bug is on (a test build)");
        plant(mutant);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    #[cfg(feature = "test-util")]
    plant_test_mutant();
    match cli.command {
        Command::Serve(args) => match args.load(std::env::vars()) {
            // The config picks the runtime.
            Ok((config, options)) => block_on(serve::runtime(&config.runtime), async move {
                stopped(serve::run(config, options, shutdown_signal()).await)
            }),
            Err(e) => failed(&e),
        },
        Command::Backend(args) => block_on(serve::runtime(&CLIENT_RUNTIME), async move {
            stopped(serve::backend(&args.listen, args.record, shutdown_signal()).await)
        }),
        Command::Lease(args) => block_on(serve::runtime(&CLIENT_RUNTIME), async {
            Ok::<_, std::convert::Infallible>(cli::lease::run(args).await)
        }),
        Command::Run(args) => block_on(serve::runtime(&CLIENT_RUNTIME), async {
            Ok::<_, std::convert::Infallible>(cli::run::run(args).await)
        }),
        Command::Loadtest(args) => block_on(serve::runtime(&CLIENT_RUNTIME), async {
            let (report, status) = cli::loadtest::run(*args).await?;
            print!("{}", cli::loadtest::summary(&report));
            Ok::<_, cli::loadtest::LoadtestError>(status)
        }),
    }
}

/// The runtime of the client commands and `fencegate backend`: tokio's
/// multi-thread scheduler, a thread per CPU.
const CLIENT_RUNTIME: RuntimeConfig = RuntimeConfig {
    worker_threads: 0,
    scheduler: Scheduler::WorkStealing,
};

/// Runs `job` on `runtime`: its `Ok` is the exit status, its `Err` exit
/// status 2; a runtime that cannot start, 1.
fn block_on<E: std::fmt::Display>(
    runtime: std::io::Result<tokio::runtime::Runtime>,
    job: impl Future<Output = Result<u8, E>>,
) -> ExitCode {
    match runtime {
        Ok(runtime) => runtime
            .block_on(job)
            .map_or_else(|e| failed(&e), ExitCode::from),
        Err(e) => {
            eprintln!("fencegate: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

fn failed(e: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("fencegate: {e}");
    ExitCode::from(2)
}

/// A server's end as an exit status: 0 once it stopped when told.
fn stopped(served: Result<(), serve::StartError>) -> Result<u8, serve::StartError> {
    served.map(|()| 0)
}
