//! Typed configuration: built-in defaults, then the TOML file, then
//! `FENCEGATE_*` environment variables, then command-line flags.
//!
//! `config/fencegate.toml` in the repository documents every key with its
//! default. Environment variables name a key by its path in upper case, with
//! `__` between a section and its key: `FENCEGATE_LISTEN`,
//! `FENCEGATE_LIMITS__MAX_BODY_BYTES`. Unknown keys in the file are errors, so
//! a typo never silently leaves a default in force; unknown `FENCEGATE_*`
//! variables are logged and ignored, since scripts keep their own.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::auth::AuthError;
pub use crate::auth::{AuthConfig, AuthToken};
use crate::backend::UpstreamOptions;
use crate::body_routes::{DynamoRoutes, EtcdRoutes};
use crate::clock::ClockKind;
use crate::lease::{restart, AdmitOptions, LeaseLimits, RestartRule};
use crate::names::LeaseName;
use crate::route::{PathRules, Preconditions, Route, RouteError, RouteKind, Routes};
use crate::server::ServerOptions;
use fencegate_core::body_keys::dynamodb::Table;
use fencegate_core::body_keys::{KeyPattern, KeyRoutes};

/// Why a configuration cannot be used. Its message names the settings
/// involved; `fencegate serve` prints it and stops.
#[derive(Debug)]
pub enum ConfigError {
    /// A setting's value, a combination of settings, or the file that
    /// holds them, that cannot work.
    Setting(String),
    /// An `[[auth.tokens]]` entry that cannot be used.
    Auth(AuthError),
    /// A route that cannot be compiled.
    Route(RouteError),
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Setting(why) => f.write_str(why),
            ConfigError::Auth(e) => write!(f, "{e}"),
            ConfigError::Route(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ConfigError {}

impl From<&str> for ConfigError {
    fn from(why: &str) -> Self {
        ConfigError::Setting(why.to_owned())
    }
}

impl From<AuthError> for ConfigError {
    fn from(e: AuthError) -> Self {
        ConfigError::Auth(e)
    }
}

impl From<RouteError> for ConfigError {
    fn from(e: RouteError) -> Self {
        ConfigError::Route(e)
    }
}

/// A [`ConfigError::Setting`] with a formatted message.
macro_rules! setting {
    ($($arg:tt)*) => {
        ConfigError::Setting(format!($($arg)*))
    };
}

/// Environment variables with the `FENCEGATE_` prefix that are not config keys.
const NON_CONFIG_ENV: [&str; 7] = [
    "FENCEGATE_CACERT",
    "FENCEGATE_CONFIG",
    "FENCEGATE_LOG",
    "FENCEGATE_LOG_FORMAT",
    "FENCEGATE_SERVER",
    "FENCEGATE_TOKEN",
    "FENCEGATE_TOKEN_FILE",
];

/// The whole configuration of `fencegate serve`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the one listener.
    pub listen: String,
    /// `embedded`, or the base URL of the HTTP storage to protect.
    pub upstream: String,
    /// Where the lease store keeps its journal.
    pub data_dir: PathBuf,
    /// `system` (monotonic) or `manual` (moves only via `POST /_fence/clock`).
    pub clock: ClockKind,
    /// Lets the settings that void a guarantee be used (the handover
    /// barrier off, self-fencing off, no settle time): they exist to show
    /// what those guarantees prevent, in tests and demonstrations.
    pub allow_unsafe_settings: bool,
    pub fence: FenceConfig,
    /// Bounds on every acquire and renew.
    pub leases: LeaseLimits,
    pub limits: LimitsConfig,
    /// The upstream client (`max_body_bytes` comes from `[limits]`).
    pub proxy: UpstreamOptions,
    pub embedded: EmbeddedConfig,
    pub auth: AuthConfig,
    pub tls: TlsConfig,
    pub admin: AdminConfig,
    pub runtime: RuntimeConfig,
    pub cluster: ClusterConfig,
}

/// The most shards a cluster may have: every member keeps an etcd session
/// and a lease store per shard it leads.
pub const MAX_SHARDS: u32 = 256;

/// Cluster mode (off while `etcd` is empty): several members, one primary,
/// the lease state in etcd.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://` or `https://`); empty: standalone.
    pub etcd: Vec<String>,
    /// This member's unique name.
    pub name: String,
    /// The URL clients reach this member at; empty: from the bound listener.
    pub advertise: String,
    /// The etcd key prefix of this cluster's state.
    pub prefix: String,
    /// TTL of the primary's etcd lease: a dead primary is replaced within
    /// about this long.
    pub ttl_ms: u64,
    /// How much earlier than its etcd lease could expire a primary stops
    /// admitting.
    pub margin_ms: u64,
    /// PEM CA certificates trusted for `https://` etcd endpoints.
    pub ca_file: String,
    /// etcd user, when etcd's authentication is on.
    pub user: String,
    /// That user's password (better in `FENCEGATE_CLUSTER__PASSWORD`).
    pub password: String,
    /// Self-fencing; off only to show what it prevents (tests).
    pub self_fencing: bool,
    /// How far behind etcd's the member's clock may fall (beyond etcd's
    /// whole seconds) before it steps down and stops campaigning.
    pub clock_tolerance_ms: u64,
    /// How many shards the leases are spread over, each with its own
    /// primary; fixed for a cluster prefix (kept in etcd). 1: one primary.
    pub shards: u32,
    /// With several shards: a request for a lease another member leads is
    /// forwarded there (one hop); false: answered `not-primary` naming it.
    pub forward: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            etcd: Vec::new(),
            name: String::new(),
            advertise: String::new(),
            prefix: "/fencegate/".into(),
            ttl_ms: 10_000,
            margin_ms: 1_000,
            ca_file: String::new(),
            user: String::new(),
            password: String::new(),
            self_fencing: true,
            clock_tolerance_ms: 500,
            shards: 1,
            forward: true,
        }
    }
}

impl ClusterConfig {
    /// Whether cluster mode is on.
    pub fn enabled(&self) -> bool {
        !self.etcd.is_empty()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled() {
            return Ok(());
        }
        if self.name.is_empty()
            || self.name.len() > 64
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(setting!(
                "cluster.name: {:?} must be 1-64 letters, digits, '-', '_' or '.'",
                self.name
            ));
        }
        if let Some(bad) = self
            .etcd
            .iter()
            .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
        {
            return Err(setting!(
                "cluster.etcd: {bad:?} is not an http:// or https:// URL"
            ));
        }
        if !self.prefix.starts_with('/') || !self.prefix.ends_with('/') {
            return Err(setting!(
                "cluster.prefix: {:?} must start and end with '/'",
                self.prefix
            ));
        }
        if self.ttl_ms < 2_000 || self.margin_ms == 0 || self.margin_ms > self.ttl_ms / 2 {
            return Err(setting!(
                "cluster: need ttl_ms >= 2000 and 0 < margin_ms <= ttl_ms / 2 (got {} and {})",
                self.ttl_ms,
                self.margin_ms
            ));
        }
        if self.user.is_empty() != self.password.is_empty() {
            return Err("cluster: set both user and password, or neither".into());
        }
        if !(1..=MAX_SHARDS).contains(&self.shards) {
            return Err(setting!(
                "cluster.shards: {} must be 1 to {MAX_SHARDS}",
                self.shards
            ));
        }
        Ok(())
    }
}

/// The async runtime of `fencegate serve`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Threads serving connections: 0 for one per CPU the process may run on;
    /// one thread (set, or the only CPU) is tokio's current-thread scheduler.
    pub worker_threads: usize,
    /// How several threads share the connections.
    pub scheduler: Scheduler,
}

impl RuntimeConfig {
    /// The threads serving connections (`worker_threads`, 0 resolved).
    pub fn threads(&self) -> usize {
        match self.worker_threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        }
    }
}

/// How the threads of `fencegate serve` share the connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scheduler {
    /// tokio's multi-thread runtime: any thread polls any connection, idle
    /// ones steal work.
    WorkStealing,
    /// A current-thread runtime on each thread, each accepting from the
    /// same listening socket (as nginx's workers do) and serving its
    /// connections, and their upstream connections, start to finish; the
    /// lease store and the rest are shared.
    #[default]
    PerThread,
}

/// TLS on the main listener (off while both paths are empty).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert_file: String,
    /// PEM private key of the leaf certificate.
    pub key_file: String,
}

impl TlsConfig {
    /// The certificate and key paths when TLS is on.
    pub fn files(&self) -> Result<Option<(PathBuf, PathBuf)>, ConfigError> {
        match (self.cert_file.is_empty(), self.key_file.is_empty()) {
            (true, true) => Ok(None),
            (false, false) => Ok(Some((
                PathBuf::from(&self.cert_file),
                PathBuf::from(&self.key_file),
            ))),
            _ => Err("tls: set both cert_file and key_file, or neither".into()),
        }
    }
}

/// A separate listener for health, metrics and the clock.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Its address; empty for none (everything on the main listener).
    pub listen: String,
}

/// The embedded key-value backend.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddedConfig {
    /// Keep an apply log of writes, served at `/_fence/backend/history`.
    pub record: bool,
    /// Most writes the apply log keeps.
    pub history_max_entries: usize,
}

impl Default for EmbeddedConfig {
    fn default() -> Self {
        Self {
            record: false,
            history_max_entries: 1_000_000,
        }
    }
}

/// How writes are checked.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FenceConfig {
    /// Whether fenced requests must carry `Fencing-Lease-Id`.
    pub require_lease_id: bool,
    /// Whether writes to paths no route guards are forwarded unchecked.
    pub allow_unrouted_writes: bool,
    /// A write needs more than this much of its term left to be admitted.
    pub admission_margin_ms: u64,
    /// How long a write whose outcome is unknown still counts as in flight.
    pub settle_ms: u64,
    /// The handover barrier; off only to demonstrate what it prevents.
    pub drain_barrier: bool,
    /// Path patterns and the lease guarding each; the first match wins.
    pub routes: Vec<RouteConfig>,
    /// The storage folds case (a file system that does): route literals
    /// match without regard to case, and a lease named in a path must be
    /// lower case.
    pub case_insensitive_paths: bool,
    /// The most keys whose state is remembered for routes with
    /// preconditions (per term of primacy: per shard led, in a cluster).
    pub precondition_keys: usize,
    /// Where etcd-v3 routes keep each lease's fence key in the storage:
    /// this prefix followed by the lease's name.
    pub etcd_fence_prefix: String,
}

/// One route of the config file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// What `pattern` is matched against: the request's path (`path`, the
    /// default), or the keys an etcd v3 write touches (`etcd-v3`).
    #[serde(default, skip_serializing_if = "RouteKind::is_path")]
    pub kind: RouteKind,
    /// e.g. `/kv/{lease}`: guards `/kv/orders` and `/kv/orders/…`.
    pub pattern: String,
    /// A fixed lease, for patterns without `{lease}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    /// Whether reads on this route need a live term too.
    #[serde(default)]
    pub fence_reads: bool,
    /// This route's upstream deadline (default: `proxy.timeout_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Replaces the pattern's leading literal segments upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_prefix: Option<String>,
    /// `"s3"`, `"azure"` or `"etag"` (any other storage): every write the
    /// storage may execute as a change to a key reaches it with a
    /// precondition that operation evaluates (SPEC §10); `"off"` by
    /// default.
    #[serde(default, skip_serializing_if = "Preconditions::is_off")]
    pub preconditions: Preconditions,
    /// A `dynamodb` route's table's partition key attribute (a string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_key: Option<String>,
    /// The attribute a `dynamodb` route's items keep their writer's token
    /// in (default `fencing_token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_attribute: Option<String>,
}

/// Request and connection limits.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    pub max_body_bytes: u64,
    pub max_header_bytes: usize,
    pub max_connections: usize,
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub shutdown_grace_ms: u64,
    pub send_timeout_ms: u64,
    pub send_buffer_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            upstream: "embedded".into(),
            data_dir: PathBuf::from("./data"),
            clock: ClockKind::System,
            allow_unsafe_settings: false,
            fence: FenceConfig::default(),
            leases: LeaseLimits::default(),
            limits: LimitsConfig::default(),
            proxy: UpstreamOptions::default(),
            embedded: EmbeddedConfig::default(),
            auth: AuthConfig::default(),
            tls: TlsConfig::default(),
            admin: AdminConfig::default(),
            runtime: RuntimeConfig::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

impl Default for FenceConfig {
    fn default() -> Self {
        Self {
            require_lease_id: true,
            allow_unrouted_writes: false,
            admission_margin_ms: 0,
            settle_ms: 1_000,
            drain_barrier: true,
            routes: vec![RouteConfig {
                kind: RouteKind::Path,
                pattern: "/kv/{lease}".into(),
                lease: None,
                fence_reads: false,
                timeout_ms: None,
                upstream_prefix: None,
                preconditions: Preconditions::Off,
                partition_key: None,
                token_attribute: None,
            }],
            case_insensitive_paths: false,
            precondition_keys: 100_000,
            etcd_fence_prefix: "fencegate/fence/".into(),
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let server = ServerOptions::default();
        Self {
            max_body_bytes: 1024 * 1024,
            max_header_bytes: server.max_header_bytes,
            max_connections: server.max_connections,
            header_read_timeout_ms: server.header_read_timeout_ms,
            body_read_timeout_ms: 10_000,
            shutdown_grace_ms: server.shutdown_grace_ms,
            send_timeout_ms: server.send_timeout_ms,
            send_buffer_bytes: server.send_buffer_bytes,
        }
    }
}

/// What the upstream setting names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpstreamTarget {
    Embedded,
    Http(http::Uri),
}

/// Command-line overrides, applied last.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub listen: Option<String>,
    pub upstream: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub clock: Option<ClockKind>,
    /// `cluster.etcd`, `cluster.name`, `cluster.advertise`.
    pub etcd: Option<Vec<String>>,
    pub name: Option<String>,
    pub advertise: Option<String>,
}

impl Config {
    /// Defaults, then `file` (if any), then the `FENCEGATE_*` variables in
    /// `env`, then `flags`; validated.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &Overrides,
    ) -> Result<Self, ConfigError> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| setting!("cannot read config {}: {e}", path.display()))?;
                text.parse::<toml::Table>()
                    .map_err(|e| setting!("config {}: {e}", path.display()))?
            }
            None => toml::Table::new(),
        };
        apply_env(&mut table, env)?;
        // The error names the key: `limits.max_body_bytes: invalid type…`.
        let mut config: Config = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| setting!("config: {}: {}", e.path(), e.inner().message()))?;
        if let Some(listen) = &flags.listen {
            config.listen.clone_from(listen);
        }
        if let Some(upstream) = &flags.upstream {
            config.upstream.clone_from(upstream);
        }
        if let Some(dir) = &flags.data_dir {
            config.data_dir.clone_from(dir);
        }
        if let Some(clock) = flags.clock {
            config.clock = clock;
        }
        if let Some(etcd) = &flags.etcd {
            config.cluster.etcd.clone_from(etcd);
        }
        if let Some(name) = &flags.name {
            config.cluster.name.clone_from(name);
        }
        if let Some(advertise) = &flags.advertise {
            config.cluster.advertise.clone_from(advertise);
        }
        if let Some(rate) = config.leases.acquire_rate_per_holder.take() {
            tracing::warn!(
                rate,
                "leases.acquire_rate_per_holder is read as leases.acquire_rate_per_client: the \
                 acquire rate is now counted per authenticated caller, or per client address \
                 with authentication off, not per holder name; rename the setting"
            );
            config.leases.acquire_rate_per_client = rate;
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every value, so a bad setting stops the start with a message.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let addr = self.listen_addr()?;
        crate::auth::Authenticator::from_config(&self.auth)?;
        let admin = self.admin_addr()?;
        self.validate_listeners(addr, admin)?;
        self.cluster.validate()?;
        if self.cluster.enabled() {
            self.validate_cluster(addr, admin)?;
        }
        self.validate_unsafe_settings()?;
        self.tls.files()?;
        self.upstream_target()?;
        self.hosts()?;
        self.fence.compile_routes()?;
        self.validate_body_routes()?;
        self.validate_limits()
    }

    /// Where it listens: never beyond loopback without authentication (or
    /// the explicit opt-out) or with the manual clock, and the admin
    /// listener apart from the main one.
    fn validate_listeners(
        &self,
        addr: SocketAddr,
        admin: Option<SocketAddr>,
    ) -> Result<(), ConfigError> {
        for addr in std::iter::once(addr).chain(admin) {
            if !self.auth.enabled
                && !addr.ip().is_loopback()
                && !self.auth.allow_unauthenticated_non_loopback
            {
                return Err(setting!(
                    "refusing to listen on {addr} without authentication: turn on [auth], or \
                     set auth.allow_unauthenticated_non_loopback if the network is trusted"
                ));
            }
        }
        if self.clock == ClockKind::Manual {
            if let Some(open) = std::iter::once(addr)
                .chain(admin)
                .find(|a| !a.ip().is_loopback())
            {
                return Err(setting!(
                    "refusing to listen on {open} with the manual clock: its time moves only \
                     when told, so it is for tests and demos on loopback addresses"
                ));
            }
        }
        if admin.is_some_and(|a| a == addr && addr.port() != 0) {
            return Err(setting!(
                "admin.listen: {addr} is the main listener's address too"
            ));
        }
        Ok(())
    }

    /// What cluster mode needs beside its own section.
    fn validate_cluster(
        &self,
        addr: SocketAddr,
        admin: Option<SocketAddr>,
    ) -> Result<(), ConfigError> {
        if self.clock == ClockKind::Manual {
            return Err(
                "cluster mode needs the system clock: a primary's right to admit is \
                 measured on it"
                    .into(),
            );
        }
        if admin.is_some() {
            return Err("admin.listen is not supported in cluster mode yet; leave it empty".into());
        }
        if self.upstream_target()? == UpstreamTarget::Embedded {
            return Err(
                "cluster mode needs an upstream every member reaches (--upstream URL): \
                 each member's embedded store is its own, so a failover would switch data"
                    .into(),
            );
        }
        if self.cluster.advertise.is_empty() && addr.ip().is_unspecified() {
            return Err(setting!(
                "cluster.advertise: listening on {addr}, so say which URL clients reach \
                 this member at (--advertise)"
            ));
        }
        Ok(())
    }

    /// Settings that void a guarantee, refused unless asked for by name.
    fn validate_unsafe_settings(&self) -> Result<(), ConfigError> {
        let unsafe_settings: Vec<&str> = [
            (!self.fence.drain_barrier, "fence.drain_barrier = false"),
            (self.fence.settle_ms == 0, "fence.settle_ms = 0"),
            (
                self.cluster.enabled() && !self.cluster.self_fencing,
                "cluster.self_fencing = false",
            ),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if !unsafe_settings.is_empty() && !self.allow_unsafe_settings {
            return Err(setting!(
                "{} voids a guarantee (a stale write can reach the storage); it exists to show \
                 what the guarantee prevents: set allow_unsafe_settings = true to use it anyway",
                unsafe_settings.join(" and ")
            ));
        }
        Ok(())
    }

    /// Routes that find their keys in the body (SPEC §11) guard a store
    /// reached over HTTP, and read the body before they know the lease.
    fn validate_body_routes(&self) -> Result<(), ConfigError> {
        let dynamodb = self.fence.compile_dynamodb_routes()?.is_some();
        self.validate_body_route_kind(
            dynamodb,
            "dynamodb",
            "dynamodb routes guard the items of DynamoDB's API: set upstream to its URL",
        )?;
        let etcd = self.fence.compile_key_routes()?.is_some();
        self.validate_body_route_kind(
            etcd,
            "etcd-v3",
            "etcd-v3 routes guard the keys of an etcd's v3 JSON gateway: set upstream \
             to its URL (http://127.0.0.1:2379)",
        )
    }

    /// Routes of `kind`, if `used`, need an upstream (`needs_upstream`
    /// says so) and one shard.
    fn validate_body_route_kind(
        &self,
        used: bool,
        kind: &str,
        needs_upstream: &str,
    ) -> Result<(), ConfigError> {
        if !used {
            return Ok(());
        }
        if self.upstream_target()? == UpstreamTarget::Embedded {
            return Err(needs_upstream.into());
        }
        if self.cluster.shards > 1 {
            return Err(setting!(
                "{kind} routes name their lease in the body, which a member with several \
                 shards does not read before it forwards: use cluster.shards = 1"
            ));
        }
        Ok(())
    }

    /// The leases' bounds, the retention time, and limits that must not be 0.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let l = &self.leases;
        if l.min_ttl_ms == 0 || l.min_ttl_ms > l.max_ttl_ms {
            return Err(setting!(
                "leases: need 0 < min_ttl_ms <= max_ttl_ms (got {} and {})",
                l.min_ttl_ms,
                l.max_ttl_ms
            ));
        }
        // A lease is forgotten only when nothing can still be waiting on it
        // or writing under it: an acquire waits at most max_wait_ms, a write
        // is settled the longest upstream deadline plus settle_ms after it
        // left. (A waiting acquire or write also pins the lease itself.)
        let busy_ms = l
            .max_wait_ms
            .max(self.upstream_timeouts_ms().max().unwrap_or(0))
            .saturating_add(self.fence.settle_ms);
        if l.retention_ms != 0 && l.retention_ms <= busy_ms {
            return Err(setting!(
                "leases.retention_ms must be 0 (keep every lease) or more than {busy_ms} \
                 (the longest acquire wait or upstream deadline, plus fence.settle_ms)"
            ));
        }
        let lim = &self.limits;
        for (name, value) in [
            ("limits.max_body_bytes", lim.max_body_bytes),
            ("limits.max_header_bytes", lim.max_header_bytes as u64),
            ("limits.max_connections", lim.max_connections as u64),
            ("limits.header_read_timeout_ms", lim.header_read_timeout_ms),
            ("limits.body_read_timeout_ms", lim.body_read_timeout_ms),
            ("limits.send_timeout_ms", lim.send_timeout_ms),
            ("proxy.connect_timeout_ms", self.proxy.connect_timeout_ms),
            ("proxy.timeout_ms", self.proxy.timeout_ms),
            (
                "fence.precondition_keys",
                self.fence.precondition_keys as u64,
            ),
        ] {
            if value == 0 {
                return Err(setting!("{name} must be greater than 0"));
            }
        }
        if self.proxy.read_buffer_bytes < crate::backend::MIN_READ_BUFFER {
            return Err(setting!(
                "proxy.read_buffer_bytes must be at least {}",
                crate::backend::MIN_READ_BUFFER
            ));
        }
        Ok(())
    }

    /// How the storage reads the client's `Host` (`proxy.preserve_host`
    /// on), for the fence to route virtual-hosted requests by their bucket;
    /// `None` when the storage never gets it.
    pub fn hosts(&self) -> Result<Option<crate::hosts::Hosts>, ConfigError> {
        let p = &self.proxy;
        if !p.preserve_host {
            if !p.virtual_host_domains.is_empty() || !p.path_style_hosts.is_empty() {
                return Err(setting!(
                    "proxy.virtual_host_domains and proxy.path_style_hosts say how the storage \
                     reads the client's Host, which it gets only with proxy.preserve_host = true"
                ));
            }
            return Ok(None);
        }
        crate::hosts::Hosts::new(&p.virtual_host_domains, &p.path_style_hosts)
            .map(Some)
            .map_err(|bad| setting!("{}", bad.0))
    }

    /// The listener address.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            setting!(
                "listen: {:?} is not an address like 127.0.0.1:8080",
                self.listen
            )
        })
    }

    /// The admin listener's address, if there is one.
    pub fn admin_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.admin.listen.is_empty() {
            return Ok(None);
        }
        self.admin.listen.parse().map(Some).map_err(|_| {
            setting!(
                "admin.listen: {:?} is not an address like 127.0.0.1:9090",
                self.admin.listen
            )
        })
    }

    /// The backend the upstream setting names.
    pub fn upstream_target(&self) -> Result<UpstreamTarget, ConfigError> {
        if self.upstream == "embedded" {
            return Ok(UpstreamTarget::Embedded);
        }
        let uri: http::Uri = self
            .upstream
            .parse()
            .map_err(|_| setting!("upstream: {:?} is not a URL", self.upstream))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(setting!(
                "upstream: {:?} must be `embedded` or an http:// or https://host:port URL",
                self.upstream
            ));
        }
        Ok(UpstreamTarget::Http(uri))
    }

    /// The lease store's bounds.
    pub fn lease_limits(&self) -> LeaseLimits {
        self.leases
    }

    /// How the fence admits writes.
    pub fn admit_options(&self) -> AdmitOptions {
        AdmitOptions {
            margin_ms: self.fence.admission_margin_ms,
            barrier: self.fence.drain_barrier,
            max_wait_ms: self.proxy.timeout_ms,
            settle_ms: self.fence.settle_ms,
        }
    }

    /// Every upstream deadline in force: `proxy.timeout_ms` and the routes'
    /// own.
    fn upstream_timeouts_ms(&self) -> impl Iterator<Item = u64> + '_ {
        let routes = self.fence.routes.iter().filter_map(|r| r.timeout_ms);
        std::iter::once(self.proxy.timeout_ms).chain(routes)
    }

    /// How often the server's timer tick fires (see
    /// `ServerOptions::timer_tick_ms`): half the shortest deadline a request
    /// sets (head, body, upstream of any route), from 50 ms to 1 s.
    pub fn timer_tick_ms(&self) -> u64 {
        let shortest = self
            .upstream_timeouts_ms()
            .chain([
                self.limits.header_read_timeout_ms,
                self.limits.body_read_timeout_ms,
            ])
            .min()
            .unwrap_or(1000);
        (shortest / 2).clamp(50, 1000)
    }

    /// What a restart must respect: writes forwarded before it may reach
    /// the backend until the longest upstream deadline (of any route) plus
    /// the settle time has passed.
    pub fn restart_rule(&self) -> RestartRule {
        let longest_timeout_ms = self.upstream_timeouts_ms().max().unwrap_or_default();
        RestartRule {
            unsettled_ms: restart::unsettled_ms(longest_timeout_ms, self.fence.settle_ms),
            ..RestartRule::default()
        }
    }

    /// The upstream client's options.
    pub fn upstream_options(&self) -> UpstreamOptions {
        UpstreamOptions {
            max_body_bytes: self.limits.max_body_bytes,
            ..self.proxy.clone()
        }
    }
}

impl FenceConfig {
    /// The key routes of an etcd v3 gateway (`kind = "etcd-v3"`), if there
    /// are any: each pattern matched against the keys a write touches.
    pub fn compile_key_routes(&self) -> Result<Option<EtcdRoutes>, ConfigError> {
        let etcd: Vec<&RouteConfig> = self
            .routes
            .iter()
            .filter(|r| r.kind == RouteKind::EtcdV3)
            .collect();
        let patterns = etcd
            .iter()
            .map(|r| {
                if r.timeout_ms == Some(0) {
                    return Err(setting!(
                        "route {:?}: timeout_ms must be greater than 0",
                        r.pattern
                    ));
                }
                let fixed = match r.lease.as_deref().map(LeaseName::new) {
                    Some(Ok(l)) => Some(l),
                    Some(Err(e)) => {
                        return Err(setting!("route {:?}: lease: {e}", r.pattern));
                    }
                    None => None,
                };
                if r.fence_reads
                    || r.upstream_prefix.is_some()
                    || !r.preconditions.is_off()
                    || r.partition_key.is_some()
                    || r.token_attribute.is_some()
                {
                    return Err(setting!(
                        "route {:?}: an etcd-v3 route takes pattern, lease and timeout_ms only",
                        r.pattern
                    ));
                }
                KeyPattern::new(&r.pattern, fixed)
                    .map_err(|bad| setting!("route {:?}: {}", r.pattern, bad.0))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !patterns.is_empty() && self.etcd_fence_prefix.is_empty() {
            return Err(setting!(
                "fence.etcd_fence_prefix: the fence keys need a prefix of their own"
            ));
        }
        Ok((!patterns.is_empty()).then(|| EtcdRoutes {
            keys: KeyRoutes::new(patterns).with_reserved(self.etcd_fence_prefix.as_bytes()),
            timeouts_ms: etcd.iter().map(|r| r.timeout_ms).collect(),
            fence_prefix: self.etcd_fence_prefix.clone(),
        }))
    }

    /// The routes of DynamoDB's API (`kind = "dynamodb"`), if there are
    /// any: each pattern matched against `/{table}/{partition key value}`
    /// of every item a write touches; the pattern's first segment names
    /// the table.
    pub fn compile_dynamodb_routes(&self) -> Result<Option<DynamoRoutes>, ConfigError> {
        let routes: Vec<&RouteConfig> = self
            .routes
            .iter()
            .filter(|r| r.kind == RouteKind::DynamoDb)
            .collect();
        let mut tables: Vec<Table> = Vec::new();
        let mut patterns = Vec::new();
        for r in &routes {
            if r.fence_reads || r.upstream_prefix.is_some() || !r.preconditions.is_off() {
                return Err(setting!(
                    "route {:?}: a dynamodb route takes pattern, lease, timeout_ms, partition_key and token_attribute only",
                    r.pattern
                ));
            }
            if r.timeout_ms == Some(0) {
                return Err(setting!(
                    "route {:?}: timeout_ms must be greater than 0",
                    r.pattern
                ));
            }
            let table = r
                .pattern
                .strip_prefix('/')
                .and_then(|p| p.split('/').next())
                .filter(|t| {
                    !t.is_empty()
                        && t.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
                })
                .ok_or_else(|| {
                    setting!(
                        "route {:?}: a dynamodb pattern starts with /, then the table's name (/jobs/{{lease}})",
                        r.pattern
                    )
                })?;
            let partition_key = r.partition_key.clone().ok_or_else(|| {
                setting!(
                    "route {:?}: a dynamodb route names its table's partition_key",
                    r.pattern
                )
            })?;
            let token_attribute = r
                .token_attribute
                .clone()
                .unwrap_or_else(|| "fencing_token".into());
            if token_attribute.is_empty() || token_attribute == partition_key {
                return Err(setting!(
                    "route {:?}: token_attribute must be an attribute of its own, not the partition key",
                    r.pattern
                ));
            }
            let this = Table {
                name: table.to_owned(),
                partition_key,
                token_attribute,
            };
            match tables.iter().find(|t| t.name == this.name) {
                Some(known) if *known != this => {
                    return Err(setting!(
                        "route {:?}: the routes of table {:?} name different partition_key or token_attribute",
                        r.pattern,
                        this.name
                    ));
                }
                Some(_) => {}
                None => tables.push(this),
            }
            let fixed = match r.lease.as_deref().map(LeaseName::new) {
                Some(Ok(l)) => Some(l),
                Some(Err(e)) => return Err(setting!("route {:?}: lease: {e}", r.pattern)),
                None => None,
            };
            patterns.push(
                KeyPattern::new(&r.pattern, fixed)
                    .map_err(|bad| setting!("route {:?}: {}", r.pattern, bad.0))?,
            );
        }
        Ok((!patterns.is_empty()).then(|| DynamoRoutes {
            keys: KeyRoutes::new(patterns),
            tables,
            timeouts_ms: routes.iter().map(|r| r.timeout_ms).collect(),
        }))
    }

    /// The path routes (`kind = "path"`, the default).
    pub fn compile_routes(&self) -> Result<Routes, ConfigError> {
        self.routes
            .iter()
            .filter(|r| r.kind.is_path())
            .map(|r| {
                if r.timeout_ms == Some(0) {
                    return Err(setting!(
                        "route {:?}: timeout_ms must be greater than 0",
                        r.pattern
                    ));
                }
                Route::new(&r.pattern, r.lease.as_deref(), r.fence_reads)
                    .and_then(|route| route.with_upstream_prefix(r.upstream_prefix.as_deref()))
                    .map(|route| {
                        route
                            .with_timeout_ms(r.timeout_ms)
                            .with_preconditions(r.preconditions)
                    })
                    .map_err(ConfigError::Route)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|routes| {
                let rules = PathRules {
                    case_insensitive: self.case_insensitive_paths,
                };
                Routes::with_rules(routes, rules)
            })
    }
}

/// Sets `FENCEGATE_SECTION__KEY=value` variables into `table`, typed like the
/// key's default so `FENCEGATE_LISTEN=8080`-style values stay strings.
fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    let defaults = toml::Table::try_from(Config::default())
        .map_err(|e| ConfigError::Setting(e.to_string()))?;
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("FENCEGATE_") && !NON_CONFIG_ENV.contains(&k.as_str()))
        .collect();
    vars.sort();
    for (var, raw) in vars {
        let path: Vec<String> = var["FENCEGATE_".len()..]
            .split("__")
            .map(str::to_ascii_lowercase)
            .collect();
        // The older name of a key, typed like the new one.
        let typed_as: Vec<String> = if path == ["leases", "acquire_rate_per_holder"] {
            vec!["leases".into(), "acquire_rate_per_client".into()]
        } else {
            path.clone()
        };
        let Some(default_value) = lookup(&defaults, &typed_as) else {
            // Scripts keep their own FENCEGATE_* variables; a typo is still
            // visible in the log.
            tracing::warn!(variable = %var, "ignoring environment variable: no such setting");
            continue;
        };
        let (last, sections) = path.split_last().expect("lookup found a key");
        let mut target = &mut *table;
        for section in sections {
            target = target
                .entry(section.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .ok_or_else(|| setting!("{var}: {section} is not a section in the config file"))?;
        }
        let value = match default_value {
            toml::Value::Integer(_) => toml::Value::Integer(
                raw.parse()
                    .map_err(|_| setting!("{var}: {raw:?} is not an integer"))?,
            ),
            toml::Value::Boolean(_) => toml::Value::Boolean(
                raw.parse()
                    .map_err(|_| setting!("{var}: {raw:?} is not true or false"))?,
            ),
            toml::Value::String(_) => toml::Value::String(raw),
            // A comma list: FENCEGATE_CLUSTER__ETCD=http://a:2379,http://b:2379
            toml::Value::Array(items) if items.iter().all(toml::Value::is_str) => {
                toml::Value::Array(
                    raw.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(|s| toml::Value::String(s.to_owned()))
                        .collect(),
                )
            }
            _ => {
                return Err(setting!(
                    "{var}: this setting can only be set in the config file"
                ))
            }
        };
        target.insert(last.clone(), value);
    }
    Ok(())
}

/// The default value at `path`, if `path` names a setting.
fn lookup<'a>(defaults: &'a toml::Table, path: &[String]) -> Option<&'a toml::Value> {
    let (last, sections) = path.split_last()?;
    let mut table = defaults;
    for section in sections {
        table = table.get(section)?.as_table()?;
    }
    table.get(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_are_valid() {
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.listen, "127.0.0.1:8080");
        assert_eq!(c.upstream_target().unwrap(), UpstreamTarget::Embedded);
        assert!(c.fence.require_lease_id);
    }

    #[test]
    fn the_timer_tick_is_half_the_shortest_request_deadline() {
        let mut c = Config::default();
        // Defaults: head 10 s, body 10 s, upstream 30 s.
        assert_eq!(c.timer_tick_ms(), 1000);
        c.limits.header_read_timeout_ms = 600;
        assert_eq!(c.timer_tick_ms(), 300);
        c.fence.routes[0].timeout_ms = Some(200);
        assert_eq!(c.timer_tick_ms(), 100);
        c.proxy.timeout_ms = 1;
        assert_eq!(c.timer_tick_ms(), 50);
    }

    #[test]
    fn the_cluster_section_from_env_and_flags() {
        const UPSTREAM: (&str, &str) = ("FENCEGATE_UPSTREAM", "http://127.0.0.1:9000");
        const ETCD: (&str, &str) = ("FENCEGATE_CLUSTER__ETCD", "http://x:2379");
        const NAME: (&str, &str) = ("FENCEGATE_CLUSTER__NAME", "a");
        let c = Config::load(
            None,
            env(&[
                (
                    "FENCEGATE_CLUSTER__ETCD",
                    "http://127.0.0.1:2379, http://127.0.0.1:22379",
                ),
                NAME,
                UPSTREAM,
            ]),
            &Overrides::default(),
        )
        .unwrap();
        assert!(c.cluster.enabled());
        assert_eq!(
            c.cluster.etcd,
            ["http://127.0.0.1:2379", "http://127.0.0.1:22379"]
        );
        let flags = Overrides {
            etcd: Some(vec!["https://10.0.0.1:2379".into()]),
            name: Some("b".into()),
            ..Overrides::default()
        };
        let c = Config::load(None, env(&[UPSTREAM]), &flags).unwrap();
        assert_eq!(c.cluster.name, "b");
        let open = [
            ETCD,
            NAME,
            UPSTREAM,
            ("FENCEGATE_LISTEN", "0.0.0.0:8080"),
            ("FENCEGATE_AUTH__ALLOW_UNAUTHENTICATED_NON_LOOPBACK", "true"),
        ];
        for bad in [
            vec![ETCD, UPSTREAM],
            vec![("FENCEGATE_CLUSTER__ETCD", "x:2379"), NAME, UPSTREAM],
            vec![ETCD, ("FENCEGATE_CLUSTER__NAME", "a b"), UPSTREAM],
            vec![ETCD, NAME, UPSTREAM, ("FENCEGATE_CLOCK", "manual")],
            vec![
                ETCD,
                NAME,
                UPSTREAM,
                ("FENCEGATE_CLUSTER__MARGIN_MS", "9000"),
            ],
            vec![
                ETCD,
                NAME,
                UPSTREAM,
                ("FENCEGATE_CLUSTER__MARGIN_MS", "9223372036854775807"),
            ],
            // Every member's embedded store is its own.
            vec![ETCD, NAME],
            // 0.0.0.0 is no URL a client can use.
            open.to_vec(),
        ] {
            assert!(
                Config::load(None, env(&bad), &Overrides::default()).is_err(),
                "{bad:?}"
            );
        }
        let mut advertised = open.to_vec();
        advertised.push(("FENCEGATE_CLUSTER__ADVERTISE", "http://10.0.0.2:8080"));
        assert!(Config::load(None, env(&advertised), &Overrides::default()).is_ok());
    }

    #[test]
    fn env_then_flags_override() {
        let c = Config::load(
            None,
            env(&[
                ("FENCEGATE_LISTEN", "127.0.0.1:9000"),
                ("FENCEGATE_LIMITS__MAX_BODY_BYTES", "42"),
                ("FENCEGATE_FENCE__REQUIRE_LEASE_ID", "false"),
                ("FENCEGATE_CLOCK", "manual"),
                ("FENCEGATE_SERVER", "ignored"),
                ("OTHER", "ignored"),
            ]),
            &Overrides {
                listen: Some("127.0.0.1:9001".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(c.listen, "127.0.0.1:9001");
        assert_eq!(c.limits.max_body_bytes, 42);
        assert!(!c.fence.require_lease_id);
        assert_eq!(c.clock, ClockKind::Manual);
    }

    #[test]
    fn bad_settings_are_refused() {
        let load = |pairs: &[(&str, &str)]| Config::load(None, env(pairs), &Overrides::default());
        // Unknown variables are ignored (with a warning): scripts keep their own.
        assert!(load(&[("FENCEGATE_NOPE", "1"), ("FENCEGATE_LIMITS__NOPE", "1")]).is_ok());
        assert!(load(&[("FENCEGATE_LIMITS__MAX_BODY_BYTES", "lots")]).is_err());
        assert!(load(&[("FENCEGATE_LISTEN", "nowhere")]).is_err());
        assert!(load(&[("FENCEGATE_UPSTREAM", "ftp://x")]).is_err());
        assert!(load(&[("FENCEGATE_CLOCK", "sundial")]).is_err());
        assert!(load(&[("FENCEGATE_LEASES__MIN_TTL_MS", "0")]).is_err());
        assert!(load(&[("FENCEGATE_FENCE__ROUTES", "x")]).is_err());
    }

    /// Seen failing before: a release build took the settings that void
    /// the guarantees like any other.
    #[test]
    fn settings_that_void_a_guarantee_need_saying_so() {
        let load = |pairs: &[(&str, &str)]| Config::load(None, env(pairs), &Overrides::default());
        for switch in [
            ("FENCEGATE_FENCE__DRAIN_BARRIER", "false"),
            ("FENCEGATE_FENCE__SETTLE_MS", "0"),
        ] {
            let err = load(&[switch]).unwrap_err();
            assert!(err.to_string().contains("allow_unsafe_settings"), "{err}");
            assert!(load(&[switch, ("FENCEGATE_ALLOW_UNSAFE_SETTINGS", "true")]).is_ok());
        }
    }

    #[test]
    fn the_manual_clock_listens_on_loopback_only() {
        let load = |pairs: &[(&str, &str)]| Config::load(None, env(pairs), &Overrides::default());
        let open = [
            ("FENCEGATE_CLOCK", "manual"),
            ("FENCEGATE_LISTEN", "0.0.0.0:8080"),
            ("FENCEGATE_AUTH__ALLOW_UNAUTHENTICATED_NON_LOOPBACK", "true"),
        ];
        let err = load(&open).unwrap_err();
        assert!(err.to_string().contains("manual clock"), "{err}");
        assert!(
            load(&open[1..]).is_ok(),
            "the system clock may listen anywhere"
        );
        let admin = [
            ("FENCEGATE_CLOCK", "manual"),
            ("FENCEGATE_ADMIN__LISTEN", "0.0.0.0:9090"),
            ("FENCEGATE_AUTH__ALLOW_UNAUTHENTICATED_NON_LOOPBACK", "true"),
        ];
        assert!(load(&admin).is_err(), "the admin listener moves the clock");
        assert!(load(&[("FENCEGATE_CLOCK", "manual")]).is_ok());
    }

    /// Seen failing before: the message said only "invalid type: string
    /// \"lots\", expected u64", not which key.
    #[test]
    fn a_type_error_in_the_file_names_its_key() {
        let dir = std::env::temp_dir().join(format!("fencegate-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("bad.toml");
        std::fs::write(&file, "[limits]\nmax_body_bytes = \"lots\"\n").unwrap();
        let err = Config::load(Some(&file), env(&[]), &Overrides::default()).unwrap_err();
        assert!(err.to_string().contains("limits.max_body_bytes"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The acquire rate's older key still works, in the file and in the
    /// environment, as the new one.
    #[test]
    fn the_older_acquire_rate_key_is_read_as_the_new_one() {
        let dir =
            std::env::temp_dir().join(format!("fencegate-config-rate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("old.toml");
        std::fs::write(&file, "[leases]\nacquire_rate_per_holder = 7\n").unwrap();
        let c = Config::load(Some(&file), env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.leases.acquire_rate_per_client, 7);
        let c = Config::load(
            None,
            env(&[("FENCEGATE_LEASES__ACQUIRE_RATE_PER_HOLDER", "9")]),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.leases.acquire_rate_per_client, 9);
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.leases.acquire_rate_per_client, 1000);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
