//! fencegate's core: the decisions that make fencing safe, with no I/O.
//!
//! Everything here takes time, bytes and events as arguments and returns
//! decisions: no file, socket, process, thread, environment or clock is
//! reached from this crate (`clippy.toml` beside its manifest denies them,
//! and CI runs clippy with `-D warnings`), and none of its dependencies is a
//! runtime or an I/O crate (`tests/layering.rs` in the fencegate package
//! reads the dependency tree). The proxy, its file journal, its etcd journal
//! and its HTTP layers are shells around it.
//!
//! - [`lease`]: the lease state machine ([`lease::machine`]: acquire, renew,
//!   release, the write check, all on the caller's `now_ms`), lease ids
//!   ([`lease::id`]), writes in flight by term and each write's life until
//!   it settles ([`lease::inflight`]), the admission decision with the
//!   handover barrier and its wait limit ([`lease::admission`]), the restart
//!   rule and window and the restore of the recovered leases
//!   ([`lease::restart`]), when a lease may be forgotten
//!   ([`lease::retention`]), and one lease as the lease store keeps it with
//!   every procedure on it ([`lease::slot`]: grant, renew, release, admit a
//!   write, forget, each returning the record or decision to carry out),
//!   which the store and the simulator both drive.
//! - [`journal`]: the journal's on-disk format ([`journal::record`]: header
//!   slots, checksummed frames, the records and how they fold into a lease's
//!   state), the order of a batch's writes and syncs ([`journal::append`]),
//!   which batches are synced, when the log is compacted and how it takes a
//!   new identity ([`journal::writer`]), what a start decides about the
//!   log and meta file it finds, as steps for the shell to carry out
//!   ([`journal::recovery`]: torn tails, lost records, older copies), and a
//!   lease's state as the etcd journal keeps and loads it
//!   ([`journal::stored`]).
//! - [`mutant`]: planted bugs, switchable only with the `mutants` feature,
//!   so the simulator and the power-cut tests can prove they catch them.
//! - [`cluster`]: cluster mode's rules on the member's clock: the
//!   self-fencing deadline and how a confirmation moves it, how often a
//!   member renews and looks, when it campaigns for a shard, when a
//!   handover may be recorded as clean and when a takeover may trust it,
//!   and the clock check's verdict.
//! - [`shard`]: which shard a lease belongs to, which member should lead
//!   each shard, and a batch split by shard and merged back, for sharding
//!   leases over cluster members.
//! - [`precondition`]: storage-side preconditions (SPEC §10): which
//!   precondition a fenced write carries, what the storage's answers teach
//!   about a key's state, what is forgotten when, in a table bounded in
//!   keys.
//! - [`body_keys`]: stores that name the key in the body (SPEC §11): the
//!   keys a write to etcd's v3 JSON gateway touches, read as etcd reads
//!   its body ([`body_keys::etcd`], over the strict JSON of
//!   [`body_keys::json`]), the one lease that guards them all, and the
//!   transaction on the lease's fence key that makes etcd compare the
//!   token, with the reading of etcd's answer to it.
//! - [`names`]: lease and holder names, checked once where they enter.
//! - [`hex`]: lowercase hex for ids and digests.
//! - [`wire`]: the header names and path prefix the proxy and its clients
//!   share.
//!
//! # Module graph
//!
//! Dependencies point one way: each module uses exactly the modules listed
//! after it, and the list has no cycle (`tests/layering.rs` in the
//! `fencegate` package reads every `use` and path here and holds the code
//! to it):
//!
//! - `cluster` → `lease`, `mutant`
//! - `lease` → `hex`, `journal`, `mutant`, `names`
//! - `journal`, `precondition` → `mutant`
//! - `body_keys` → `mutant`, `names`
//! - `shard` → `names`
//! - `hex`, `mutant`, `names`, `wire` → nothing
//!

#![forbid(unsafe_code)]

pub mod body_keys;
pub mod cluster;
pub mod hex;
pub mod journal;
pub mod lease;
pub mod mutant;
pub mod names;
pub mod precondition;
pub mod shard;
pub mod wire;
