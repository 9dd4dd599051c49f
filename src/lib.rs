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
//! - [`server`]: accept loop (plain or TLS, see [`tls`]), connection limits,
//!   graceful shutdown;
//!   [`framing`] guards each connection's bytes against ambiguous framing.
//! - [`app`]: composes everything into one service: request ids and limits,
//!   then the lease API or the fenced data path.
//! - [`auth`]: bearer-token callers (off by default).
//! - [`api`]: the lease API under `/_fence/` (acquire, renew, release, inspect).
//! - [`fence`]: the tower layer that admits or rejects a write; [`route`] maps
//!   paths to the leases that guard them.
//! - [`backend`]: the embedded key-value store and the HTTP upstream client.
//! - [`lease`]: the pure lease state machine and the concurrent store around
//!   it; [`journal`] makes grants durable (an fsync'd, checksummed log with
//!   group commit); [`clock`] is the only place that reads time.
//! - [`client`]: a lease API client whose guard renews in the background and
//!   fails closed; [`cli`]: the client commands built on it (`lease`, `run`,
//!   `loadtest`).
//! - [`metrics`]: Prometheus counters and the scrape-time collector.
//! - [`error`]: the one mapping from errors to problem+json; [`body`]: the
//!   body type shared by all services; [`config`]: typed settings.
//!
//! Dependencies point one way: clock, journal ← lease ← fence, api ← app ←
//! server ← main.

pub mod api;
pub mod app;
pub mod auth;
pub mod backend;
pub mod body;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod error;
pub mod fence;
pub mod framing;
pub mod journal;
pub mod lease;
pub mod metrics;
pub mod route;
pub mod server;
pub mod tls;
