//! A deterministic simulator that drives fencegate's real core
//! (`fencegate-core`: the lease state machine, the admission decision with
//! the handover barrier and its wait limit, each write's life until it
//! settles, the restart rule, the journal's format, the order of its writes,
//! what a start makes of the files it finds and the lease state a member
//! loads from etcd) through a world that goes wrong at every step, and
//! checks the guarantees after each one. The rules it plays are the ones
//! the shell runs, called, not copied; and so are the lease store's
//! procedures: each lease of the proxy here is the core's
//! `fencegate_core::lease::slot::Slot`, the type the lease store keeps,
//! whose grant, renewal, release, admission and forgetting return the
//! records and decisions the world then carries out with its own disk,
//! network and clock, as the store does with its own.
//!
//! The world ([`world`]), all in one thread on one simulated clock, seeded:
//! - writers that acquire, write, renew and release, each on a clock of its
//!   own (some fast, some slow), that pause for up to two TTLs and go on as
//!   if they still held their lease, that stop for good, that keep writing
//!   under a term they released or lost (zombies), and that aim writes at
//!   the very millisecond their term ends;
//! - the proxy, its clock restarting at every start, its wall clock off by
//!   up to half the tolerance, and a journal writer that appends, syncs and
//!   writes headers in the order `fencegate_core::journal::append` gives,
//!   syncs the batches `fencegate_core::journal::writer` says must be,
//!   starts by the steps `fencegate_core::journal::recovery::open_plan`
//!   lists, and gives the log a new identity at each start by the writer
//!   module's steps (the process may die between any two), on a disk ([`disk`]) that
//!   keeps only what was synced: a power cut keeps any subset of the
//!   writes since (and may tear one), a kill keeps them all, a sync may
//!   fail, and the disk may lose or flip its last bytes;
//! - a backend that answers late, times out, and applies a write before or
//!   after it answers, up to the settle time after the connection is gone:
//!   the documented bound. Writes applied later than that ("rogue" writes)
//!   are made on purpose, counted, and left out of the lease-wide order
//!   check;
//! - routes with storage-side preconditions (SPEC §10) for some leases:
//!   their writes go to a few keys of a storage ([`storage`]) that names
//!   states with entity tags of one of two kinds (new on every write, or
//!   naming the content, so a key can return to an earlier state) and
//!   executes each request as S3 does, evaluating only the preconditions
//!   that operation evaluates, however late it applies it; the clients send
//!   the request shapes that once let late writes through (a sub-resource
//!   of another method, a DELETE of a key seen absent, their own
//!   preconditions that protect nothing, reads of another version) beside
//!   plain PUTs, DELETEs and reads; the proxy plans each precondition with
//!   the core (`fencegate_core::precondition`), from what the answers to
//!   its writes and to its clients' reads taught a table that outlives its
//!   terms of primacy, and answers 428 (the client then reads the key)
//!   where it knows nothing or no precondition would protect the write;
//! - an etcd behind an `etcd-v3` route (SPEC §11, [`etcd_store`]) for one
//!   lease: each of its writes goes there too, as the transaction the core
//!   builds (`fencegate_core::body_keys::etcd::fenced`) on the lease's
//!   fence key, run as etcd runs it when the storage applies the write,
//!   however late (a lease's first write only makes the fence key, and the
//!   shell's sending it again is played); and a DynamoDB table behind a
//!   `dynamodb` route ([`dynamo_store`]) for the same lease: each write as
//!   a client's `PutItem`, every fourth without the token and its
//!   condition, let through only if the core's check
//!   (`fencegate_core::body_keys::dynamodb::check`) passes it, its
//!   condition evaluated when the storage applies it;
//! - crashes and power cuts at any step, and restarts;
//! - the lease store's sweep, forgetting by the core's rule
//!   (`fencegate_core::lease::retention`) leases quiet for the retention
//!   time, or for none as when it makes room (then one lease, as in the
//!   shell), each journaled, its tokens kept by the mark new names start
//!   above;
//! - in cluster mode (even seeds), three members sharing the lease state
//!   through a simulated etcd (sessions that expire on etcd's clock, one
//!   election key, transactions that commit only for the session holding
//!   it), each member on a clock a little fast or slow, paused (SIGSTOP)
//!   or cut off from etcd for up to two TTLs while clients still reach it,
//!   and killed or stopped (SIGTERM); a member that wins loads the lease
//!   state and serves under the core's restart rule, and admits only while
//!   the core's self-fencing deadline (`fencegate_core::cluster`) has not
//!   passed on its own clock; one that could not confirm its primacy by
//!   then steps down at its next beat and gives its session back, as the
//!   shell's elector does. A stopped primary stops admitting, waits a
//!   while for its writes (`cluster::handover_drained`) and, if they all
//!   finished and settled, records the handover as clean before it gives
//!   its session back; the next primary then keeps no takeover window if
//!   `cluster::takeover_clean` says so. The settle time is longer than a
//!   member's poll here, so a write of unknown outcome may still land
//!   after another member took over.
//!
//! What it leaves out: etcd keeps each lease's state with the etcd
//! journal's rules (`fencegate_core::journal::stored`), but not its JSON,
//! snapshots or write queue (`src/cluster/journal.rs`), and the election's
//! record of a clean handover is read and rewritten in one step here, not
//! after the load as the shell does; a start does not die between the
//! steps of its plan (only during its change of identity); the file
//! journal's compaction, its changes of identity after growth and at a
//! clean stop (the same steps as at a start), its probe of the disk every
//! second while unhealthy, and older copies put back are not played; nor are shards: a clean
//! handover happens here when a primary is stopped, not when the
//! assignment moves its shard (the same rules either way). Admission and
//! forwarding are one step here: a proxy paused between its last check and
//! its write's first byte (the bound docs/cluster.md gives) is not
//! modelled, nor a clock slower than the self-fencing margin per TTL (the
//! clock check's business), nor the settle time shortened by a proxy clock
//! that runs fast (it is measured on the proxy's clock).
//!
//! Every decision the shell takes by a rule, the world takes by the same
//! core function: among the last moved, which records the answer waits for
//! and which batches are synced (`record::awaited`, `writer::batch_syncs`),
//! the file journal's health (`writer::Health::after`), the deadlines and
//! marks that only move forward (`cluster::primacy_confirmed`,
//! `inflight::settling_until`, `record::forgotten_above`,
//! `retention::last_use`), which requests count as a lease's use
//! (`retention::refreshes_last_use`) and how many leases a pass forgets
//! (`retention::Sweep::idle` and `making_room`). Of these, a planted bug
//! can show only the first two (`release-lazy`, `awaited-not-synced`) and
//! the forgotten mark (`forgotten-above-lowered`): the others decide availability (health, a
//! primacy deadline moved back) or the retention's courtesy (last use, how
//! many are forgotten: a forgotten lease's tokens continue above its
//! mark), and a settle time can only move back where two threads race to
//! count their writes ended (each is the end plus `settle_ms`, on a
//! monotonic clock), which the world does not play. What the world writes
//! itself is the shell's plumbing in simulated time: its messages and their
//! order (an awaited record answered once its batch is written, a renewal's
//! hint kept once the journal's queue took its record: a standalone
//! proxy's queue holds `Config::journal_queue` records and drops a lazy one
//! that finds it full), each marked as the shell's where it is done. Where the order differs: a member checks its primacy before each
//! keepalive here, after it in the shell (whose late confirmation may
//! revive a lapsed primacy: not played); the sweep forgets nothing on a
//! member that is not primary (the shell's then fails to journal it); room
//! is made on three sweeps in ten, not when a new name finds the store
//! full, and a pass looks at every lease in order, not at the next
//! thousand names from where the last stopped (256 when making room). The
//! etcd journal answers a release that changes nothing in etcd's state at
//! once; here it waits for its commit like any other.
//!
//! What it checks (see [`Violation`]):
//! - the backend never applies a write of a term after one of a later term
//!   of the same lease (within the bound);
//! - on the routes with preconditions, whenever it is applied (rogue writes
//!   too): the storage applies no write of a term to a key after a later
//!   term's write to it, unless the key returned to the state the write's
//!   precondition named (the documented bound, counted); what the proxy
//!   learns of a key is a state the key held while the exchange ran; and a
//!   precondition names a state the key held since the member's term of
//!   primacy began (a new primary starts knowing none);
//! - the etcd behind the etcd-v3 route never applies a write of a term
//!   after one of a later term of the lease, nor the DynamoDB table one to
//!   its item, however late (rogue writes too);
//! - tokens granted to clients strictly increase per lease (so none is
//!   issued twice), across every restart and loss;
//! - no term that ended (released with an answer, superseded by a granted
//!   later term, or past its deadline, where a restart may hold a term for
//!   up to one TTL unless it ended more than half a TTL plus the tolerance
//!   before) is honoured again: no write admitted, no renewal;
//! - a lease is held (409) only while its term may be: liveness;
//! - a holder keeps its term for as long as its last answer told it,
//!   through restarts and takeovers: the term is held after a start, nobody
//!   else is granted the lease, none of its writes, renewals or releases is
//!   refused; only lost records, a release that may have reached the
//!   journal, or a renewal's hint lost with a failed sync or a crash (a
//!   documented, safe loss) may end it early;
//! - every start after a crash or power cut without disk damage finds every
//!   acknowledged record; every granted token survives it; an answered
//!   release stays a release; a recovered term is held for at most a TTL;
//!   after lost records every term has ended (the same at every takeover in
//!   cluster mode);
//! - self-fencing: a primary admits nothing (write, grant, renewal,
//!   release) once etcd could have let its election lease go.
//!
//! [`run`] plays one seed; the same seed plays the same run, step for step.

#![forbid(unsafe_code)]

pub mod disk;
pub mod dynamo_store;
pub mod etcd_store;
pub mod storage;
pub mod world;

pub use world::{run, Config, Report, Stats, Violation};
