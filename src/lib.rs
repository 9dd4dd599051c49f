//! fencegate: an HTTP reverse proxy that enforces lease fencing at the
//! storage boundary.
//!
//! # The fencing invariant
//!
//! A write reaches the backend only if its `Fencing-Token` is the current term
//! of the lease that guards its path, its `Fencing-Lease-Id` is that term's,
//! and the term is live (`now_ms < deadline_ms`) on the proxy's own monotonic
//! clock at the moment of the decision. Tokens of a lease strictly increase and
//! are never reissued. Everything else in the crate serves this check.
//!
//! # Module map, along the data path
//!
//! - [`serve`]: start-up of `fencegate serve`: recovers the lease store,
//!   builds the backend and the app, binds the listeners, stops gracefully
//!   (`main.rs` only parses arguments and passes the signals in; tests start
//!   it in process with [`serve::start`]).
//! - [`server`]: accept loop (plain or TLS, see [`tls`]), connection limits,
//!   graceful shutdown; [`framing`] guards each connection's bytes against
//!   ambiguous framing, reading them as hyper does with [`h1`], the
//!   HTTP/1.1 codec (heads' lengths and codings, chunked bodies) it shares
//!   with the backend's upstream client.
//! - [`app`]: composes everything into one service: request ids and limits,
//!   then the lease API or the fenced data path.
//! - [`auth`]: bearer-token callers (off by default).
//! - [`names`]: lease and holder names, checked once where they enter (from
//!   the I/O-free core, the `fencegate-core` crate, like [`hex`], the lease
//!   state machine in [`lease::machine`] and the journal's format in
//!   [`journal::record`]).
//! - [`api`]: the lease API under `/_fence/` (acquire, renew, release, inspect).
//! - [`fence`]: the tower layer that admits or rejects a write, and hands an
//!   admitted one to the backend in the two steps of a
//!   [`backend::Exchange`], checking it again between them; [`route`] maps
//!   paths to the leases that guard them ([`hosts`]: the bucket a
//!   virtual-hosted request's `Host` names); [`precondition`] keeps the key
//!   states of routes with storage-side preconditions (SPEC §10) and adds
//!   the precondition the core plans for each write; [`body_routes`]
//!   finds the lease of a write to a store that names its keys in the
//!   body (etcd's v3 JSON gateway, SPEC §11), by the core's readings,
//!   sends it as the core's transaction on the lease's fence key and
//!   reshapes etcd's answer.
//! - [`backend`]: the embedded key-value store and the HTTP(S) upstream client.
//! - [`lease`]: the core's lease state machine and its lease slot (one
//!   lease and every procedure on it: grant, renew, release, admit a write,
//!   forget), and the concurrent store that holds the slots and carries out
//!   what they return (the handover barrier's waits and the acquire rate
//!   limit in files of their own); [`journal`] makes grants durable (an fsync'd, checksummed log with
//!   group commit and a token floor) behind the `Journal` trait, the seam a
//!   second store fills; [`clock`] is the proxy's clock, the only
//!   source of the time leases, settle windows and the handover barrier are
//!   measured on (I/O deadlines are tokio timers).
//! - [`client`]: a lease API client whose guard renews in the background and
//!   fails closed (the `fencegate-client` crate, which a program can depend
//!   on without the proxy; re-exported here); [`cli`]: the client commands
//!   built on it (`lease`, `run`, `loadtest`).
//! - [`metrics`]: Prometheus counters and the scrape-time collector.
//! - [`cluster`]: cluster mode: the election through etcd, the member
//!   service (the primary's app, or standby answers), and the lease state
//!   in etcd behind the `Journal` seam; [`etcd`]: an etcd v3 client over
//!   etcd's JSON gateway (keys, transactions, leases; TLS, authentication,
//!   several endpoints); [`rt`]: where hyper-util's clients (etcd, the
//!   members' forwarding) run their connections' tasks, and the timer each
//!   accepted connection keeps for its header read timeout.
//! - [`error`]: the one mapping from errors to problem+json (the `Reason`
//!   table: status, slug and title, and an error's chain for a log line);
//!   [`body`]: the body type shared by all services; [`wire`]: header
//!   names and the path prefix several layers share; [`hex`]: lowercase
//!   hex for ids and digests; [`config`]: typed settings, read by start-up
//!   only.
//!
//! # Module graph
//!
//! Dependencies point one way. The core and client crates cannot name this
//! one (the client depends on the core alone, for the header names); the core
//! does no I/O and reads no clock (its `clippy.toml` denies the std APIs;
//! `tests/layering.rs` holds its dependency tree to pure-computation crates).
//! Inside this crate each module uses exactly the modules listed after it,
//! from the top down, and the list has no cycle: `tests/layering.rs` reads
//! every `use` and every path of `src/` (tests included) and holds the code
//! to it.
//!
//! - `serve` → `app`, `auth`, `backend`, `body`, `clock`, `cluster`, `config`, `etcd`, `fence`, `hosts`, `journal`, `lease`, `metrics`, `precondition`, `server`, `tls`
//! - `cluster` → `api`, `app`, `auth`, `backend`, `body`, `clock`, `error`, `etcd`, `hex`, `journal`, `lease`, `metrics`, `route`, `rt`, `tls`, `wire`
//! - `config` → `auth`, `backend`, `body_routes`, `clock`, `hosts`, `lease`, `names`, `route`, `server`
//! - `server` → `backend`, `body`, `framing`, `rt`
//! - `app` → `api`, `auth`, `backend`, `body`, `body_routes`, `config`, `error`, `fence`, `lease`, `metrics`, `precondition`, `wire`
//! - `api` → `auth`, `backend`, `body`, `clock`, `error`, `fence`, `lease`, `metrics`, `names`, `route`, `wire`
//! - `cli` → `backend`, `client`, `clock`, `hex`, `names`, `wire`
//! - `fence` → `auth`, `backend`, `body`, `body_routes`, `error`, `hosts`, `lease`, `metrics`, `names`, `precondition`, `route`, `wire`
//! - `backend` → `auth`, `body`, `clock`, `error`, `h1`, `metrics`, `names`, `rt`, `tls`, `wire`
//! - `etcd` → `error`, `rt`, `tls`
//! - `error` → `body`, `lease`, `precondition`, `wire`
//! - `metrics` → `clock`, `lease`
//! - `lease` → `clock`, `journal`, `names`
//! - `body_routes` → `body`, `error`, `names`
//! - `precondition` → `body`
//! - `auth` → `hex`, `names`
//! - `route` → `names`
//! - `framing` → `h1`
//! - `rt` → `clock`
//! - `body`, `clock`, `h1`, `hosts`, `journal`, `tls`, `wire` → nothing
//!
//! (`names` and `hex` are the core's; `client` is the client crate.)
//!

pub mod api;
pub mod app;
pub mod auth;
pub mod backend;
pub mod body;
pub mod body_routes;
pub mod cli;
pub use fencegate_client as client;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod error;
pub mod etcd;
pub mod fence;
pub mod framing;
pub mod h1;
pub mod hosts;
pub use fencegate_core::hex;
pub mod journal;
pub mod lease;
pub mod metrics;
pub use fencegate_core::names;
pub mod precondition;
pub mod route;
pub mod rt;
pub mod serve;
pub mod server;
pub mod tls;
pub mod wire;
