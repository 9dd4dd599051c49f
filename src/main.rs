//! Process wiring only: arguments and environment → config → telemetry →
//! `server::run(…, shutdown)`.

use std::future::Future;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tokio::net::TcpListener;

use fencegate::app::{self, App, Parts};
use fencegate::backend::{Backend, EmbeddedStore, Upstream};
use fencegate::cli::lease::LeaseArgs;
use fencegate::cli::loadtest::LoadtestArgs;
use fencegate::cli::run::RunArgs;
use fencegate::clock::{Clock, ClockKind};
use fencegate::config::{Config, Overrides, UpstreamTarget};
use fencegate::journal::{FileJournal, FileJournalOptions};
use fencegate::lease::{LeaseStore, RestartRule};
use fencegate::server::{self, ServerOptions};
use fencegate::tls::Certificates;

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
    Serve {
        /// TOML config file (see config/fencegate.toml).
        #[arg(long, env = "FENCEGATE_CONFIG")]
        config: Option<PathBuf>,
        /// Listener address, e.g. 127.0.0.1:8080 (port 0 picks a free port).
        #[arg(long)]
        listen: Option<String>,
        /// `embedded` or the http:// base URL of the storage to protect.
        #[arg(long)]
        upstream: Option<String>,
        /// Directory of the lease store.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// `system` (monotonic) or `manual` (moved by POST /_fence/clock).
        #[arg(long)]
        clock: Option<ClockKind>,
        /// Start even though the data directory's journal is missing or
        /// empty: every lease is then free, and its tokens continue above
        /// the floor kept in store.meta (none is reissued).
        #[arg(long)]
        accept_journal_loss: bool,
    },
    /// Run the embedded key-value store alone, unfenced.
    Backend {
        /// Listener address, e.g. 127.0.0.1:9000.
        #[arg(long)]
        listen: String,
        /// Keep an apply log of writes at GET /_fence/backend/history.
        #[arg(long)]
        record: bool,
    },
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

/// Completes when `registered` reports its signal; never if watching for it
/// failed: a failed registration must not look like a signal and stop the
/// server at once.
async fn on_signal(registered: impl Future<Output = std::io::Result<()>>, name: &str) {
    if let Err(error) = registered.await {
        tracing::warn!(%error, signal = name, "cannot watch for the signal; stop fencegate another way");
        std::future::pending::<()>().await;
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = on_signal(tokio::signal::ctrl_c(), "SIGINT");
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Announces the bound addresses on stdout, so scripts using port 0 can find
/// them: one line per listener, main first, in a single write.
fn announce(lines: &[(&str, &str, &TcpListener)]) -> std::io::Result<()> {
    let mut text = String::new();
    for (what, scheme, listener) in lines {
        let addr = listener.local_addr()?;
        text.push_str(&format!("{what} listening on {scheme}://{addr}\n"));
    }
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Reloads the TLS certificate and key on every SIGHUP.
#[cfg(unix)]
fn reload_on_sighup(certs: Arc<Certificates>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot watch SIGHUP; TLS certificates reload only on restart");
        return;
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            match certs.reload() {
                Ok(()) => tracing::info!("TLS certificate reloaded"),
                Err(err) => {
                    tracing::error!(error = %err, "TLS reload failed; keeping the old certificate")
                }
            }
        }
    });
}

#[cfg(not(unix))]
fn reload_on_sighup(_: Arc<Certificates>) {}

async fn serve(config: Config, accept_journal_loss: bool) -> Result<(), String> {
    let clock = Clock::new(config.clock);
    let stopwatch = Clock::system();
    let options = FileJournalOptions {
        accept_journal_loss,
        ..FileJournalOptions::default()
    };
    let (journal, recovered) =
        FileJournal::open(&config.data_dir, options).map_err(|e| e.to_string())?;
    let recovered_leases = recovered.leases.len();
    let rule = RestartRule {
        token_floor: recovered.token_floor,
        lost_records: recovered.lost_records.is_some(),
        ..config.restart_rule()
    };
    let leases = LeaseStore::restore(
        clock,
        config.lease_limits(),
        Arc::new(journal),
        recovered.leases,
        rule,
    )?;
    tracing::info!(
        data_dir = %config.data_dir.display(),
        leases = recovered_leases,
        torn_bytes = recovered.torn_bytes,
        token_floor = recovered.token_floor,
        recovery_ms = stopwatch.now_ms(),
        "lease store recovered"
    );
    let backend = match config.upstream_target()? {
        UpstreamTarget::Embedded if config.embedded.record => Backend::Embedded(
            EmbeddedStore::recording(config.embedded.history_max_entries),
        ),
        UpstreamTarget::Embedded => Backend::Embedded(EmbeddedStore::new()),
        UpstreamTarget::Http(uri) => {
            Backend::Upstream(Upstream::new(&uri, &config.upstream_options())?)
        }
    };
    let draining = Arc::new(AtomicBool::new(false));
    let mut app = app::build(
        &config,
        Parts {
            leases,
            backend,
            draining: draining.clone(),
        },
    )?;
    let tls = match config.tls.files()? {
        Some((cert, key)) => {
            let certs = Arc::new(Certificates::load(&cert, &key)?);
            reload_on_sighup(certs.clone());
            Some(certs.acceptor()?)
        }
        None => None,
    };
    let listener = TcpListener::bind(config.listen_addr()?)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let admin = match config.admin_addr()? {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr} (admin.listen): {e}"))?;
            Some((listener, app.split_admin()))
        }
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut lines = vec![("fencegate", scheme, &listener)];
    if let Some((admin, _)) = &admin {
        lines.push(("fencegate admin", "http", admin));
    }
    announce(&lines).map_err(|e| e.to_string())?;
    tracing::info!(upstream = %config.upstream, clock = ?config.clock, tls = tls.is_some(), "fencegate serving");
    let options = ServerOptions {
        max_connections: config.limits.max_connections,
        header_read_timeout_ms: config.limits.header_read_timeout_ms,
        max_header_bytes: config.limits.max_header_bytes,
        shutdown_grace_ms: config.limits.shutdown_grace_ms,
    };
    // One signal stops both listeners; readyz turns 503 first.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        draining.store(true, Ordering::Release);
        let _ = stop.send(true);
    });
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let main = server::run_with_tls(listener, tls, app, options, until_stopped(stopped.clone()));
    match admin {
        None => main.await,
        Some((listener, admin_app)) => {
            let admin = server::run(listener, admin_app, options, until_stopped(stopped));
            tokio::try_join!(main, admin).map(|_| ())
        }
    }
    .map_err(|e| e.to_string())
}

async fn backend(listen: String, record: bool) -> Result<(), String> {
    let defaults = Config::default();
    let store = if record {
        EmbeddedStore::recording(defaults.embedded.history_max_entries)
    } else {
        EmbeddedStore::new()
    };
    let app = App::new(None, store, app::RequestLimits::from_config(&defaults));
    let addr: std::net::SocketAddr = listen
        .parse()
        .map_err(|_| format!("{listen:?} is not an address like 127.0.0.1:9000"))?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    announce(&[("fencegate backend", "http", &listener)]).map_err(|e| e.to_string())?;
    server::run(listener, app, ServerOptions::default(), shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

/// The runtime `serve` runs on: `worker_threads` 0 means one per CPU the
/// process may run on, and one thread means tokio's current-thread
/// scheduler (measured faster on one core than a one-worker multi-thread
/// runtime, whose accept loop and workers hand off across threads).
fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let worker_threads = match worker_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    if worker_threads == 1 {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if worker_threads > 1 {
        builder.worker_threads(worker_threads);
    }
    builder.enable_all().build()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let (command, serve_config) = match cli.command {
        Command::Serve {
            config,
            listen,
            upstream,
            data_dir,
            clock,
            accept_journal_loss,
        } => {
            let flags = Overrides {
                listen,
                upstream,
                data_dir,
                clock,
            };
            match Config::load(config.as_deref(), std::env::vars(), &flags) {
                Ok(config) => (None, Some((config, accept_journal_loss))),
                Err(e) => {
                    eprintln!("fencegate: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        other => (Some(other), None),
    };
    let threads = serve_config
        .as_ref()
        .map_or(0, |(c, _)| c.runtime.worker_threads);
    let runtime = match runtime(threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencegate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let Some(command) = command else {
            let (config, accept_journal_loss) = serve_config.expect("serve has a config");
            return serve(config, accept_journal_loss).await.map(|()| 0u8);
        };
        match command {
            Command::Serve { .. } => unreachable!("handled above"),
            Command::Backend { listen, record } => backend(listen, record).await,
            Command::Lease(args) => return Ok(fencegate::cli::lease::run(args).await),
            Command::Run(args) => return Ok(fencegate::cli::run::run(args).await),
            Command::Loadtest(args) => {
                let (report, status) = fencegate::cli::loadtest::run(args).await?;
                print!("{}", fencegate::cli::loadtest::summary(&report));
                return Ok(status);
            }
        }
        .map(|()| 0u8)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Seen failing before: a failed Ctrl-C registration completed the
    /// shutdown future, so the server stopped as soon as it started.
    #[tokio::test(start_paused = true)]
    async fn a_failed_signal_registration_never_looks_like_a_signal() {
        let failed = async { Err(std::io::Error::other("no signal handling here")) };
        let waited = tokio::time::timeout(
            std::time::Duration::from_secs(3600),
            on_signal(failed, "SIGINT"),
        )
        .await;
        assert!(waited.is_err(), "the failed registration ended the wait");
        on_signal(async { Ok(()) }, "SIGINT").await;
    }
}
