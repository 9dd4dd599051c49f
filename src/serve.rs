//! Start-up of `fencegate serve` (and of `fencegate backend`): the lease
//! store recovered from its journal, the backend, the app, TLS, the
//! listeners, and a graceful stop. The stop is an input: `main.rs` parses
//! the arguments and passes the process's signals in.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use tokio::net::TcpListener;

use crate::app::{self, App, Parts};
use crate::auth::Authenticator;
use crate::backend::{Backend, EmbeddedStore, Upstream, UpstreamError};
use crate::clock::{Clock, ClockKind};
use crate::cluster::{self, Classify, ClusterOptions, MakeApp, Member, Sharding, Takeover};
use crate::config::{Config, ConfigError, Overrides, RuntimeConfig, Scheduler, UpstreamTarget};
use crate::etcd::{EtcdClient, EtcdOptions};
use crate::fence::is_write;
use crate::journal::{FileJournal, FileJournalOptions, JournalError, MemoryJournal};
use crate::lease::{LeaseStore, Primacy};
use crate::metrics::{ClusterStats, Metrics};
use crate::precondition::KeyStateTable;
use crate::server::{self, ServerOptions};
use crate::tls::{Certificates, TlsError};

/// `fencegate serve` options.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// TOML config file (see config/fencegate.toml).
    #[arg(long, env = "FENCEGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listener address (port 0 picks a free port) [default: the config's
    /// `listen`, else 127.0.0.1:8080].
    #[arg(long)]
    pub listen: Option<String>,
    /// `embedded`, or the http:// or https:// base URL of the storage to
    /// protect [default: the config's `upstream`, else embedded].
    #[arg(long)]
    pub upstream: Option<String>,
    /// Directory of the lease store [default: the config's `data_dir`, else
    /// ./data].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// `system` (monotonic) or `manual` (moved by POST /_fence/clock)
    /// [default: the config's `clock`, else system].
    #[arg(long)]
    pub clock: Option<ClockKind>,
    /// Start even though the data directory's journal is missing or empty:
    /// every lease is then free, and its tokens continue above the floor kept
    /// in store.meta (none is reissued).
    #[arg(long)]
    pub accept_journal_loss: bool,
    /// The data directory was just restored from a backup (for one start):
    /// every recovered term ends, and every lease continues more than N
    /// tokens above the highest the backup knows of (pick N above the
    /// tokens granted since the backup was taken).
    #[arg(long, value_name = "N")]
    pub restored_from_backup: Option<u64>,
    /// etcd client URLs, comma-separated: turns on cluster mode (the lease
    /// state lives in etcd; one member at a time is the primary).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// This member's unique name (cluster mode).
    #[arg(long)]
    pub name: Option<String>,
    /// The URL clients reach this member at (cluster mode; default: the
    /// listener's address).
    #[arg(long)]
    pub advertise: Option<String>,
}

impl ServeArgs {
    /// The config (defaults, file, the `FENCEGATE_*` variables of `env`,
    /// these flags) and the start's options.
    pub fn load(
        &self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Config, StartOptions), ConfigError> {
        let flags = Overrides {
            listen: self.listen.clone(),
            upstream: self.upstream.clone(),
            data_dir: self.data_dir.clone(),
            clock: self.clock,
            etcd: self.etcd.clone(),
            name: self.name.clone(),
            advertise: self.advertise.clone(),
        };
        let config = Config::load(self.config.as_deref(), env, &flags)?;
        let options = StartOptions {
            accept_journal_loss: self.accept_journal_loss,
            restored_from_backup: self.restored_from_backup,
        };
        Ok((config, options))
    }
}

/// `fencegate backend` options.
#[derive(clap::Args, Debug)]
pub struct BackendArgs {
    /// Listener address, e.g. 127.0.0.1:9000.
    #[arg(long)]
    pub listen: String,
    /// Keep an apply log of writes at GET /_fence/backend/history.
    #[arg(long)]
    pub record: bool,
}

/// Choices made for one start, beside the config.
#[derive(Clone, Copy, Debug, Default)]
pub struct StartOptions {
    /// Start even though the journal is missing or empty (see
    /// [`FileJournalOptions::accept_journal_loss`]).
    pub accept_journal_loss: bool,
    /// The data directory was restored from a backup (see
    /// [`FileJournalOptions::restored_from_backup`]).
    pub restored_from_backup: Option<u64>,
}

/// Why fencegate could not start (or stopped serving).
#[derive(Debug)]
pub enum StartError {
    /// A setting is wrong.
    Config(ConfigError),
    /// The upstream cannot be used as configured.
    Upstream(UpstreamError),
    /// etcd's endpoints or CA file cannot be used.
    Etcd(crate::etcd::SetupError),
    /// This member cannot take part in the cluster.
    Cluster(cluster::ClusterError),
    /// The lease store could not be opened or recovered.
    Journal(JournalError),
    /// The TLS certificate or key is unusable.
    Tls(TlsError),
    /// A listener could not be bound: (setting, address, cause).
    Listen(&'static str, String, std::io::Error),
    /// Serving failed.
    Io(std::io::Error),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(e) => write!(f, "{e}"),
            StartError::Upstream(e) => write!(f, "{e}"),
            StartError::Etcd(e) => write!(f, "{e}"),
            StartError::Cluster(e) => write!(f, "{e}"),
            StartError::Tls(e) => write!(f, "{e}"),
            StartError::Journal(e) => write!(f, "{e}"),
            StartError::Listen(setting, addr, e) => {
                write!(f, "cannot listen on {addr} ({setting}): {e}")
            }
            StartError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for StartError {}

/// Starts `fencegate serve` with `config` and serves until `shutdown`
/// completes: [`start`], then the bound addresses announced on stdout, then
/// [`Bound::serve`].
pub async fn run(
    config: Config,
    options: StartOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    let bound = start(config, options).await?;
    bound.announce().map_err(StartError::Io)?;
    bound.serve(shutdown).await
}

/// A fencegate whose parts are built and whose listeners are bound, not yet
/// accepting: tests learn its addresses (port 0) before they connect.
pub struct Bound {
    app: Served,
    listener: TcpListener,
    admin: Option<(TcpListener, app::AdminApp)>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    options: ServerOptions,
    draining: Arc<AtomicBool>,
    /// Threads that accept from the main listener, each on a runtime of its
    /// own (`runtime.scheduler = "per-thread"`); 1: the runtime's own.
    threads: usize,
}

/// What the main listener serves.
enum Served {
    /// One fencegate, its lease store recovered from its journal.
    Standalone(app::FencegateApp),
    /// A cluster member: the primary's app while it is primary.
    Cluster(Member<app::FencegateApp>),
}

/// Recovers the lease store from its journal (standalone) or joins the
/// cluster, builds the backend and the app, loads TLS and binds the
/// listeners.
pub async fn start(config: Config, options: StartOptions) -> Result<Bound, StartError> {
    if config.cluster.enabled() && options.restored_from_backup.is_some() {
        return Err(StartError::Config(ConfigError::Setting(
            "--restored-from-backup is for a standalone store's data directory: a cluster's \
             lease state lives in etcd, not in the data directory"
                .into(),
        )));
    }
    let leases = if config.cluster.enabled() {
        None
    } else {
        Some(recover(&config, options)?)
    };
    let draining = Arc::new(AtomicBool::new(false));
    let tls = match config.tls.files().map_err(StartError::Config)? {
        Some((cert, key)) => {
            let certs = Arc::new(Certificates::load(&cert, &key).map_err(StartError::Tls)?);
            reload_on_sighup(certs.clone());
            Some(certs.acceptor().map_err(StartError::Tls)?)
        }
        None => None,
    };
    let listen = config.listen_addr().map_err(StartError::Config)?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| StartError::Listen("listen", listen.to_string(), e))?;
    let (app, admin) = match leases {
        None => {
            let member = join(&config, draining.clone(), &listener, tls.is_some()).await?;
            (Served::Cluster(member), None)
        }
        Some(leases) => {
            leases.start_sweeper();
            let parts = Parts {
                leases,
                backend: build_backend(&config)?,
                draining: draining.clone(),
                primacy: None,
                metrics: None,
                key_states: None,
            };
            let mut app = app::build(&config, parts).map_err(StartError::Config)?;
            let admin = match config.admin_addr().map_err(StartError::Config)? {
                Some(addr) => {
                    let listener = TcpListener::bind(addr)
                        .await
                        .map_err(|e| StartError::Listen("admin.listen", addr.to_string(), e))?;
                    Some((listener, app.split_admin()))
                }
                None => None,
            };
            (Served::Standalone(app), admin)
        }
    };
    tracing::info!(upstream = %config.upstream, clock = ?config.clock, tls = tls.is_some(), cluster = config.cluster.enabled(), "fencegate serving");
    warn_of_test_seams(&config);
    Ok(Bound {
        app,
        listener,
        admin,
        tls,
        options: ServerOptions {
            max_connections: config.limits.max_connections,
            header_read_timeout_ms: config.limits.header_read_timeout_ms,
            max_header_bytes: config.limits.max_header_bytes,
            shutdown_grace_ms: config.limits.shutdown_grace_ms,
            send_timeout_ms: config.limits.send_timeout_ms,
            send_buffer_bytes: config.limits.send_buffer_bytes,
            timer_tick_ms: config.timer_tick_ms(),
        },
        draining,
        threads: match config.runtime.scheduler {
            Scheduler::PerThread => config.runtime.threads(),
            Scheduler::WorkStealing => 1,
        },
    })
}

/// The storage `config.upstream` names.
fn build_backend(config: &Config) -> Result<Backend, StartError> {
    let body_timeout = Duration::from_millis(config.limits.body_read_timeout_ms);
    Ok(
        match config.upstream_target().map_err(StartError::Config)? {
            UpstreamTarget::Embedded if config.embedded.record => Backend::Embedded(
                EmbeddedStore::recording(config.embedded.history_max_entries)
                    .with_body_read_timeout(body_timeout),
            ),
            UpstreamTarget::Embedded => {
                Backend::Embedded(EmbeddedStore::new().with_body_read_timeout(body_timeout))
            }
            UpstreamTarget::Http(uri) => Backend::Upstream(
                Upstream::new(&uri, &config.upstream_options()).map_err(StartError::Upstream)?,
            ),
        },
    )
}

/// Joins the cluster `config.cluster` names: the member's service, whose
/// apps are built anew from etcd's lease state at each term of primacy of
/// each shard it leads. A member whose number of shards etcd refuses does
/// not start.
async fn join(
    config: &Config,
    draining: Arc<AtomicBool>,
    listener: &TcpListener,
    tls: bool,
) -> Result<Member<app::FencegateApp>, StartError> {
    let c = &config.cluster;
    let (etcd, options) = cluster_options(config, listener, tls)?;
    tracing::info!(name = %options.name, advertise = %options.advertise, etcd = ?c.etcd, shards = c.shards, "joining the cluster");
    let clock = Clock::new(config.clock);
    let stats = Arc::new(ClusterStats::default());
    // With several shards, the member's apps share one backend and one set
    // of metrics; with one, each term of primacy has its own (as before).
    let shared = if c.shards > 1 {
        let backend = build_backend(config)?;
        Some((backend, Metrics::for_shards(stats.clone())))
    } else {
        None
    };
    let config = Arc::new(config.clone());
    let make_app = make_app(&config, &clock, &draining, shared.clone());
    let sharding = match shared {
        Some((backend, metrics)) => Some(sharding(&config, &clock, draining, backend, metrics)?),
        None => None,
    };
    let member = cluster::start(etcd, options, clock, make_app, sharding, stats)
        .map_err(StartError::Cluster)?;
    // A member etcd refuses (another number of shards) does not start. An
    // etcd out of reach leaves the check to the background: the member
    // campaigns for nothing until it is done.
    if let Ok(Err(why)) = tokio::time::timeout(Duration::from_secs(3), member.checked()).await {
        member.stop();
        return Err(StartError::Cluster(why));
    }
    Ok(member)
}

/// The member's etcd client and its cluster options, from `config`.
fn cluster_options(
    config: &Config,
    listener: &TcpListener,
    tls: bool,
) -> Result<(EtcdClient, ClusterOptions), StartError> {
    let c = &config.cluster;
    let advertise = if c.advertise.is_empty() {
        let scheme = if tls { "https" } else { "http" };
        format!(
            "{scheme}://{}",
            listener.local_addr().map_err(StartError::Io)?
        )
    } else {
        c.advertise.clone()
    };
    let etcd_options = EtcdOptions {
        ca_file: (!c.ca_file.is_empty()).then(|| PathBuf::from(&c.ca_file)),
        user: (!c.user.is_empty()).then(|| (c.user.clone(), c.password.clone())),
        // A call must end well within the TTL, so a primary notices in time.
        timeout_ms: (c.ttl_ms / 4).clamp(500, 5_000),
    };
    let etcd = EtcdClient::new(&c.etcd, &etcd_options).map_err(StartError::Etcd)?;
    let unsettled_ms = config.restart_rule().unsettled_ms;
    let options = ClusterOptions {
        name: c.name.clone(),
        advertise,
        prefix: c.prefix.clone(),
        ttl_ms: c.ttl_ms,
        margin_ms: c.margin_ms,
        unsettled_ms,
        self_fencing: c.self_fencing,
        clock_tolerance_ms: c.clock_tolerance_ms,
        shards: c.shards,
        forward: c.forward,
        // The member that leads the shard may hold a write at its barrier
        // for as long as the write itself may take upstream, and an
        // acquire for as long as it may wait.
        forward_timeout_ms: unsettled_ms
            .saturating_mul(2)
            .max(config.leases.max_wait_ms)
            .saturating_add(1_000),
        forward_read_buffer_bytes: config
            .proxy
            .read_buffer_bytes
            .max(crate::backend::MIN_READ_BUFFER),
    };
    Ok((etcd, options))
}

/// Builds the app of a term of primacy of a shard, from the lease state
/// its takeover loaded: with several shards (`shared`), on the member's
/// one backend and metrics.
fn make_app(
    config: &Arc<Config>,
    clock: &Clock,
    draining: &Arc<AtomicBool>,
    shared: Option<(Backend, Metrics)>,
) -> MakeApp<app::FencegateApp> {
    let shards = config.cluster.shards;
    // Each shard's key states (SPEC §10) outlive its terms of primacy on
    // this member; each term starts knowing none.
    let key_states: Arc<[Arc<KeyStateTable>]> = (0..shards)
        .map(|_| {
            let per_shard = config.fence.precondition_keys.div_ceil(shards as usize);
            Arc::new(KeyStateTable::new(per_shard))
        })
        .collect();
    let (config, clock, draining) = (config.clone(), clock.clone(), draining.clone());
    Arc::new(move |takeover: Takeover| {
        let states = key_states[takeover.shard as usize].clone();
        states.take_over();
        let leases = LeaseStore::restore(
            clock.clone(),
            config.lease_limits(),
            takeover.journal,
            takeover.leases,
            takeover.rule,
        )?;
        // It ends with this term of primacy's store.
        leases.start_sweeper();
        // With one shard, a backend per term: its upstream metrics belong
        // to this term's app, and nothing of an earlier term stays pinned.
        let (backend, metrics) = match &shared {
            Some((backend, metrics)) => (backend.clone(), Some(metrics.clone())),
            None => (build_backend(&config)?, None),
        };
        let parts = Parts {
            leases: leases.clone(),
            backend,
            draining: draining.clone(),
            primacy: Some(takeover.primacy.clone()),
            metrics: metrics.clone(),
            key_states: Some(states),
        };
        let app = app::build(&config, parts)?;
        if let Some(metrics) = metrics {
            metrics.add_shard(&leases, &takeover.primacy);
        }
        Ok((app, leases))
    })
}

/// With several shards: how a member sends each request to the shard of
/// its lease, and the app that serves unfenced reads and fencegate's own
/// endpoints (its store stays empty, as lease requests go to their shard,
/// and its primacy never ends, as the storage is anyone's to read).
fn sharding(
    config: &Config,
    clock: &Clock,
    draining: Arc<AtomicBool>,
    backend: Backend,
    metrics: Metrics,
) -> Result<Sharding<app::FencegateApp>, StartError> {
    let parts = Parts {
        leases: LeaseStore::new(
            clock.clone(),
            config.lease_limits(),
            Arc::new(MemoryJournal::default()),
        ),
        backend,
        draining,
        primacy: Some(Arc::new(Primacy::new(clock.clone(), u64::MAX, true))),
        metrics: Some(metrics),
        key_states: None,
    };
    let reader = app::build(config, parts).map_err(StartError::Config)?;
    let routes = config.fence.compile_routes().map_err(StartError::Config)?;
    let hosts = config.hosts().map_err(StartError::Config)?;
    let classify: Classify = Arc::new(move |req: &Request<crate::body::Body>| {
        let write = is_write(req.method());
        // The path the storage acts on, as the fence reads it (a Host it
        // cannot read is refused by the reader's fence).
        let vpath = crate::hosts::virtual_path(req, hosts.as_ref()).ok()?;
        let path = vpath.as_deref().unwrap_or(req.uri().path());
        let matched = routes.resolve(path, write).ok()??;
        // A read on a route with preconditions goes to the member that
        // knows the key's state: the one that writes it.
        if !write && !matched.fence_reads && matched.preconditions.is_off() {
            return None;
        }
        matched.lease.ok().map(|lease| lease.as_str().to_owned())
    });
    Ok(Sharding {
        classify,
        reader,
        body_read_timeout: Duration::from_millis(config.limits.body_read_timeout_ms),
        limits: app::RequestLimits::from_config(config),
        auth: Authenticator::from_config(&config.auth)
            .map_err(|e| StartError::Config(e.into()))?
            .map(Arc::new),
    })
}

/// Settings that exist for tests and demos say so at every start.
fn warn_of_test_seams(config: &Config) {
    if config.clock == ClockKind::Manual {
        tracing::warn!(
            "the manual clock is on: leases expire only when POST /_fence/clock moves it; \
             it is for tests and demos, never for production"
        );
    }
    if !config.fence.drain_barrier {
        tracing::warn!(
            "fence.drain_barrier is off: a write of an old term can reach the backend after \
             one of a newer term; it is off only to show what the barrier prevents"
        );
    }
    if config.fence.settle_ms == 0 {
        tracing::warn!(
            "fence.settle_ms is 0: a write whose outcome is unknown stops holding back newer \
             terms at once, though the storage may still apply it"
        );
    }
    if config.cluster.enabled() && !config.cluster.self_fencing {
        tracing::warn!(
            "cluster.self_fencing is off: a primary that cannot confirm its primacy goes on \
             admitting writes; it is off only to show what self-fencing prevents"
        );
    }
}

/// The lease store, recovered from the journal in `config.data_dir`.
fn recover(config: &Config, options: StartOptions) -> Result<LeaseStore, StartError> {
    let stopwatch = Clock::system();
    let journal_options = FileJournalOptions {
        accept_journal_loss: options.accept_journal_loss,
        restored_from_backup: options.restored_from_backup,
        ..FileJournalOptions::default()
    };
    let (journal, recovered) =
        FileJournal::open(&config.data_dir, journal_options).map_err(StartError::Journal)?;
    let recovered_leases = recovered.leases.len();
    let rule = config.restart_rule().recovered(&recovered);
    let leases = LeaseStore::restore(
        Clock::new(config.clock),
        config.lease_limits(),
        Arc::new(journal),
        recovered.leases,
        rule,
    )
    .map_err(StartError::Journal)?;
    tracing::info!(
        data_dir = %config.data_dir.display(),
        leases = recovered_leases,
        torn_bytes = recovered.torn_bytes,
        token_floor = recovered.token_floor,
        recovery_ms = stopwatch.now_ms(),
        "lease store recovered"
    );
    Ok(leases)
}

impl Bound {
    /// The main listener's address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The admin listener's address, if `admin.listen` is set.
    pub fn admin_addr(&self) -> Option<std::io::Result<SocketAddr>> {
        self.admin
            .as_ref()
            .map(|(listener, _)| listener.local_addr())
    }

    /// Announces the bound addresses on stdout, so scripts using port 0 can
    /// find them: one line per listener, main first, in a single write.
    pub fn announce(&self) -> std::io::Result<()> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut lines = vec![("fencegate", scheme, &self.listener)];
        if let Some((admin, _)) = &self.admin {
            lines.push(("fencegate admin", "http", admin));
        }
        announce(&lines)
    }

    /// Serves until `shutdown` completes, then drains: readyz turns 503,
    /// both listeners stop accepting, and connections get the grace period.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let Bound {
            app,
            listener,
            admin,
            tls,
            options,
            draining,
            threads,
        } = self;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let member = match &app {
            Served::Cluster(member) => Some(member.clone()),
            Served::Standalone(_) => None,
        };
        let leaving = member.clone();
        // Set if the member finds it cannot take part in the cluster.
        let fatal = Arc::new(std::sync::Mutex::new(None::<cluster::ClusterError>));
        let failed = fatal.clone();
        tokio::spawn(async move {
            match &leaving {
                Some(member) => tokio::select! {
                    () = shutdown => {}
                    why = member.failed() => {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                    }
                },
                None => shutdown.await,
            }
            draining.store(true, Ordering::Release);
            // A primary hands over at once instead of after its TTL.
            if let Some(member) = leaving {
                member.stop();
            }
            let _ = stop.send(true);
        });
        let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let main: Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> = match app {
            Served::Standalone(app) => Box::pin(server::run_on_threads(
                listener,
                tls,
                app,
                options,
                threads,
                stopped.clone(),
            )),
            Served::Cluster(member) => Box::pin(server::run_on_threads(
                listener,
                tls,
                member,
                options,
                threads,
                stopped.clone(),
            )),
        };
        let served = match admin {
            None => main.await,
            Some((listener, admin_app)) => {
                let admin = server::run(listener, admin_app, options, until_stopped(stopped));
                tokio::try_join!(main, admin).map(|_| ())
            }
        };
        if let Some(member) = member {
            // Bounded: an unreachable etcd takes the lease back at its TTL.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), member.left()).await;
        }
        if let Some(why) = fatal.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(StartError::Cluster(why));
        }
        served.map_err(StartError::Io)
    }
}

/// Runs the embedded key-value store alone (`fencegate backend`), unfenced,
/// until `shutdown` completes.
pub async fn backend(
    listen: &str,
    record: bool,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let defaults = Config::default();
    let store = if record {
        EmbeddedStore::recording(defaults.embedded.history_max_entries)
    } else {
        EmbeddedStore::new()
    };
    let app = App::new(None, store, app::RequestLimits::from_config(&defaults));
    let addr: std::net::SocketAddr = listen.parse().map_err(|_| {
        StartError::Config(ConfigError::Setting(format!(
            "{listen:?} is not an address like 127.0.0.1:9000"
        )))
    })?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| StartError::Listen("--listen", listen.to_owned(), e))?;
    announce(&[("fencegate backend", "http", &listener)]).map_err(StartError::Io)?;
    server::run(listener, app, ServerOptions::default(), shutdown)
        .await
        .map_err(StartError::Io)
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
pub async fn shutdown_signal() {
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

/// Writes one "… listening on scheme://addr" line per listener, in a
/// single write.
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

/// The runtime `serve` runs on (`runtime.worker_threads` 0 means one per
/// CPU the process may run on): tokio's current-thread scheduler for one
/// thread (measured faster on one core than a one-worker multi-thread
/// runtime, whose accept loop and workers hand off across threads) and for
/// `scheduler = "per-thread"`, whose other threads [`Bound::serve`]
/// starts; else the multi-thread scheduler.
pub fn runtime(config: &RuntimeConfig) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = config.threads();
    if threads == 1 || config.scheduler == Scheduler::PerThread {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
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
