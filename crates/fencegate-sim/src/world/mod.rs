//! The simulated world: clients, the proxy around the real core, its
//! journal on a disk that loses what was not synced, a slow backend, and
//! the checker. One event at a time, in time order; ties in the order they
//! were scheduled; every random choice from one seeded generator.
//!
//! This file holds the world itself: its settings, its events and the
//! loop that plays them, its clock and its faults' dice. Its parts, each a
//! file: the clients (`clients.rs`), the proxy's lease procedures and its
//! forwarding (`proxy.rs`), its journal (`journal.rs`), crashes and starts
//! (`starts.rs`), cluster members (`members.rs`) and the simulated etcd
//! (`etcd.rs`), and the checker (`checker.rs`); the storage models are the
//! crate's
//! [`crate::storage`], [`crate::etcd_store`] and [`crate::dynamo_store`].

use std::collections::BTreeMap;

use fencegate_core::cluster;
use fencegate_core::journal::append::{self, Step};
use fencegate_core::journal::record::{self, Header, LeaseRecord, Record};
use fencegate_core::journal::recovery::{self, Meta, MetaFile};
use fencegate_core::journal::stored::StoredState;
use fencegate_core::journal::writer::{self, Health, IdentityStep};
use fencegate_core::lease::admission::{self, Decision, WriteCheck};
use fencegate_core::lease::id::LeaseId;
use fencegate_core::lease::inflight::{self, Inflight, WriteLife};
use fencegate_core::lease::machine::{AcquireRefused, Grant, Term};
use fencegate_core::lease::restart::{self, RestartRule};
use fencegate_core::lease::retention;
use fencegate_core::lease::slot;
use fencegate_core::precondition::{self, Dialect, KeyStates, Operation, Own, Plan, Sent};

mod checker;
mod clients;
mod etcd;
mod journal;
mod members;
mod proxy;
mod starts;

use checker::{LeaseTruth, TermTruth};

use crate::disk::File;
use crate::dynamo_store::DynamoStore;
use crate::etcd_store::EtcdStore;
use crate::storage::{self as s3, KeyWrite, Keys, Outcome, State, TagKind};

/// The wall clock's Unix time at the simulation's start.
const WALL_BASE_MS: u64 = 1_800_000_000_000;
/// Tokens reserved at a time in the meta file (the proxy's default).
const FLOOR_BLOCK: u64 = 4096;
/// How long a stopping primary waits for its writes: shorter than the
/// upstream timeout, as the shell's 2 s is beside its upstream deadlines,
/// so that some stops end with writes unfinished and record nothing.
const DRAIN_MS: u64 = 100;

/// One run's settings. [`Config::new`] gives the defaults the tests use.
#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    /// Events to play.
    pub steps: u64,
    pub leases: usize,
    pub clients: usize,
    pub min_ttl_ms: u64,
    pub max_ttl_ms: u64,
    /// How long the proxy waits for the backend's answer.
    pub upstream_timeout_ms: u64,
    /// How long after its connection is gone the backend may still apply a
    /// write (the proxy's `settle_ms`).
    pub settle_ms: u64,
    /// The wall-clock tolerance of the restart rule; the proxy's wall clock
    /// is off by up to half of it at each start.
    pub tolerance_ms: u64,
    /// Mean time between crashes of the proxy.
    pub crash_every_ms: u64,
    /// Of the crashes, how many in a thousand are power cuts.
    pub power_cuts_per_mille: u32,
    /// Of the crashes, how many in a thousand also damage the end of the log.
    pub damage_per_mille: u32,
    /// Of the syncs, how many in a thousand fail.
    pub sync_failures_per_mille: u32,
    /// Before each step of a start's change of identity, how many in a
    /// thousand times the process dies there.
    pub start_crashes_per_mille: u32,
    /// Of the writes, how many in a thousand the backend applies after the
    /// documented bound (left out of the order check).
    pub rogue_per_mille: u32,
    /// Members: 1 is standalone (the file journal on the simulated disk);
    /// more is cluster mode (the lease state in a simulated etcd, one
    /// primary elected at a time, self-fencing on each member's clock).
    pub members: usize,
    /// Cluster mode: the TTL of a member's etcd lease, in whole seconds.
    pub member_ttl_s: u64,
    /// Cluster mode: the self-fencing margin (`cluster.margin_ms`).
    pub margin_ms: u64,
    /// Cluster mode: a member's clock runs up to this many parts per
    /// million slow or fast: within what the clock check lets serve, the
    /// margin per TTL.
    pub member_skew_ppm: i64,
    /// Leases quiet for this long are forgotten (`leases.retention_ms`:
    /// more than the upstream timeout plus the settle time, as the config
    /// requires); some sweeps forget with none, as the store does to make
    /// room for a new name when it is full.
    pub retention_ms: u64,
    /// Cluster mode: of a member's process ends, how many in a thousand
    /// are stops (SIGTERM) rather than crashes: a primary stops admitting,
    /// waits for its writes (`cluster::handover_drained`), records the
    /// handover as clean if they all finished and gives its session back,
    /// so that the next primary may skip its takeover window
    /// (`cluster::takeover_clean`).
    pub stops_per_mille: u32,
    /// Cluster mode: mean time between pauses (SIGSTOP) of a member, each
    /// up to two TTLs of its etcd lease.
    pub pause_every_ms: u64,
    /// Leases `0..precondition_leases` are guarded by a route with
    /// preconditions (SPEC §10): each of their writes goes to one of
    /// `keys_per_lease` keys, carries a precondition planned by the core
    /// (`fencegate_core::precondition`), is evaluated by the storage when
    /// it is applied, and is checked however late it is applied (their
    /// rogue writes included).
    pub precondition_leases: usize,
    /// The lease whose writes also go to a simulated etcd behind an
    /// `etcd-v3` route (SPEC §11, [`crate::etcd_store`]): each as the
    /// transaction the core builds on the lease's fence key, run when the
    /// storage applies the write, rogue writes included.
    pub etcd_lease: Option<usize>,
    /// The lease whose writes also go to a simulated DynamoDB table behind
    /// a `dynamodb` route ([`crate::dynamo_store`]): each as a client's
    /// `PutItem` (every fourth without the token and its condition), let
    /// through if the core's check passes it, applied when the storage
    /// applies the write, rogue writes included.
    pub dynamo_lease: Option<usize>,
    pub keys_per_lease: usize,
    /// How the storage names its keys' states (see [`crate::storage`]).
    pub tag_kind: TagKind,
    /// The most keys a member remembers the state of (fewer than there are
    /// keys, so some are forgotten).
    pub key_states: usize,
    /// Standalone: the file journal's queue holds this many records; a
    /// lazy record (a renewal's hint, a forgetting) that finds it full is
    /// dropped, as the store's bounded queue drops it. (In cluster mode the
    /// etcd journal's cache keeps what its queue cannot take.)
    pub journal_queue: usize,
    /// Print every event to stderr (the `simulate` example's `--trace`).
    pub trace: bool,
}

impl Config {
    /// The settings of seed `seed`: odd seeds run standalone, even seeds a
    /// cluster of three members, so one seed names one run either way.
    pub fn new(seed: u64, steps: u64) -> Self {
        if seed.is_multiple_of(2) {
            Self::cluster(seed, steps)
        } else {
            Self::standalone(seed, steps)
        }
    }

    /// Three members sharing their lease state through etcd. The settle
    /// time is longer than a member's poll, as the defaults are (1 s and
    /// 500 ms): a write of unknown outcome may still land after another
    /// member took over.
    pub fn cluster(seed: u64, steps: u64) -> Self {
        Self {
            members: 3,
            settle_ms: 400,
            ..Self::standalone(seed, steps)
        }
    }

    /// One proxy with its file journal.
    pub fn standalone(seed: u64, steps: u64) -> Self {
        Self {
            seed,
            steps,
            leases: 3,
            clients: 8,
            min_ttl_ms: 100,
            max_ttl_ms: 600,
            upstream_timeout_ms: 150,
            settle_ms: 40,
            tolerance_ms: 50,
            crash_every_ms: 1_500,
            power_cuts_per_mille: 500,
            damage_per_mille: 150,
            sync_failures_per_mille: 10,
            start_crashes_per_mille: 30,
            rogue_per_mille: 5,
            members: 1,
            member_ttl_s: 2,
            margin_ms: 100,
            stops_per_mille: 800,
            retention_ms: 600,
            member_skew_ppm: 5_000,
            pause_every_ms: 3_000,
            precondition_leases: 2,
            etcd_lease: Some(2),
            dynamo_lease: Some(2),
            keys_per_lease: 2,
            // Each kind with both modes: seeds 1, 2 version tags, 3, 4
            // content tags, and so on.
            tag_kind: if seed.div_ceil(2).is_multiple_of(2) {
                TagKind::Content
            } else {
                TagKind::Version
            },
            key_states: 3,
            journal_queue: 1,
            trace: false,
        }
    }
}

/// A guarantee that did not hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The step (event) after which it was found.
    pub step: u64,
    /// Simulated time.
    pub at_ms: u64,
    pub what: String,
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub grants: u64,
    pub renewals: u64,
    pub releases: u64,
    pub writes_admitted: u64,
    pub writes_applied: u64,
    pub writes_refused: u64,
    pub barrier_waits: u64,
    pub rogue_writes: u64,
    pub crashes: u64,
    /// Crashes during a start's change of identity.
    pub start_crashes: u64,
    pub power_cuts: u64,
    pub torn_writes: u64,
    pub damaged_logs: u64,
    pub failed_syncs: u64,
    pub starts_after_loss: u64,
    pub held_refusals: u64,
    /// Cluster mode: members that won the election and took over.
    pub takeovers: u64,
    /// Cluster mode: members paused (SIGSTOP).
    pub pauses: u64,
    /// Cluster mode: members cut off from etcd for a while.
    pub partitions: u64,
    /// Cluster mode: primaries that stepped down (their etcd lease gone, a
    /// write of lease state refused).
    pub step_downs: u64,
    /// Cluster mode: primaries stopped (SIGTERM) that recorded a clean
    /// handover, and takeovers that found one (and kept no window).
    pub clean_handovers: u64,
    pub clean_takeovers: u64,
    /// Cluster mode: members stopped (SIGTERM; not counted in `crashes`).
    pub stops: u64,
    /// Leases forgotten (retention, or room made).
    pub forgotten: u64,
    /// Standalone: renewals' and forgettings' records dropped by a full
    /// journal queue.
    pub lazy_records_dropped: u64,
    /// Routes with preconditions: writes answered 428 (no state known).
    pub preconditions_required: u64,
    /// Reads of a key through the proxy.
    pub key_reads: u64,
    /// Writes whose precondition the storage refused.
    pub preconditions_refused: u64,
    /// Of those, writes of an old term applied after a later term's
    /// (rogue or late): the storage refused them.
    pub late_stale_refused: u64,
    /// Writes of an old term the storage applied after a later term's
    /// because the key returned to the state they named (the documented
    /// bound: deleted again, or, with content tags, the same bytes again).
    pub returned_states: u64,
    /// Writes the simulated etcd applied, and refused because a later
    /// term of their lease had written (rogue or late).
    pub etcd_applied: u64,
    pub etcd_refused: u64,
    /// Writes the simulated DynamoDB table applied, refused (a later term
    /// had written the item), and that fencegate did not let through (no
    /// token or condition).
    pub dynamo_applied: u64,
    pub dynamo_refused: u64,
    pub dynamo_unsent: u64,
}

/// A run's outcome.
#[derive(Clone, Debug)]
pub struct Report {
    pub seed: u64,
    pub steps: u64,
    pub sim_ms: u64,
    pub stats: Stats,
    pub violation: Option<Violation>,
}

/// Plays one seed.
pub fn run(config: &Config) -> Report {
    let mut world = World::new(config.clone());
    world.play();
    Report {
        seed: config.seed,
        steps: world.step,
        sim_ms: world.now,
        stats: world.stats,
        violation: world.violation,
    }
}

// ---------------------------------------------------------------------------
// Requests and answers.

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        ttl_ms: u64,
    },
    Renew,
    Release,
    Write {
        /// When it first waited at the barrier, on the proxy's clock.
        first_try_ms: Option<u64>,
        /// On a route with preconditions: which key, a DELETE or a PUT of
        /// which content.
        key: usize,
        delete: bool,
        content: u64,
        /// Which request: an index into `storage::PUTS` or
        /// `storage::DELETES`.
        shape: usize,
    },
    /// On a route with preconditions: a read of a key (`shape`: an index
    /// into `storage::READS`).
    Read {
        key: usize,
        shape: usize,
    },
}

#[derive(Clone, Debug)]
struct Req {
    id: u64,
    client: usize,
    /// The member it is sent to.
    member: usize,
    lease: usize,
    token: u64,
    lease_id: [u8; 32],
    op: Op,
}

#[derive(Clone, Debug)]
enum Answer {
    Granted {
        lease: usize,
        token: u64,
        lease_id: [u8; 32],
        expires_in_ms: u64,
    },
    Renewed {
        expires_in_ms: u64,
    },
    Released,
    Written,
    Refused,
    Held,
    /// 428 precondition-required: the client reads the key.
    PreconditionRequired {
        lease: usize,
        key: usize,
    },
    /// A read's answer.
    Read,
    /// 503 or 504, or the connection was refused or lost.
    Failed,
}

#[derive(Debug)]
enum Ev {
    Wake(usize),
    Arrive(Req),
    Deliver {
        client: usize,
        req: u64,
        answer: Answer,
    },
    /// A write waiting at the barrier looks again (on the proxy that has it).
    Retry {
        inc: u64,
        req: Req,
    },
    Flush(u64),
    /// The lease store's retention sweep (on the proxy of incarnation .0).
    Sweep(u64),
    Synced {
        inc: u64,
        rest: Vec<Step>,
        batch: Vec<Queued>,
        len_before: u64,
    },
    Apply(usize),
    Answered(usize),
    /// The storage serves read `.0`, then its answer reaches the proxy.
    ReadServed(usize),
    ReadAnswered(usize),
    BodyDone(usize),
    Timeout(usize),
    Crash(usize),
    Restart(usize),
    /// Cluster mode: a member's process starts.
    MemberStart(usize),
    /// Cluster mode: a member's keepalive is due.
    Beat {
        member: usize,
        session: u64,
    },
    /// Cluster mode: a member looks for a primary, and campaigns if none.
    Poll {
        member: usize,
        session: u64,
    },
    /// Cluster mode: a member is paused.
    Pause(usize),
    /// Cluster mode: a stopping primary looks whether its writes are done
    /// (it gives up at `bound_ms`, its clock).
    Drain {
        member: usize,
        generation: u64,
        session: u64,
        bound_ms: u64,
    },
    /// Cluster mode: a member asks etcd for a session again (the last ask
    /// was lost).
    Regrant {
        member: usize,
        generation: u64,
    },
    /// Cluster mode: a member's request reaches etcd.
    AtEtcd {
        member: usize,
        generation: u64,
        sent_ms: u64,
        op: EtcdOp,
    },
    /// Cluster mode: etcd's answer reaches the member.
    FromEtcd {
        member: usize,
        generation: u64,
        sent_ms: u64,
        reply: EtcdReply,
    },
}

#[derive(Debug)]
enum EtcdOp {
    Grant,
    KeepAlive(u64),
    Campaign(u64),
    /// A stopping primary: if `clean`, the handover is recorded for the
    /// election `session` holds (if it still does); then the session is
    /// given back (the election with it).
    Resign {
        session: u64,
        clean: bool,
    },
    /// A transaction that appends lease records if `session` holds the
    /// election.
    Commit {
        session: u64,
        inc: u64,
        batch: Vec<Queued>,
    },
}

#[derive(Debug)]
enum EtcdReply {
    Granted {
        session: u64,
    },
    KeptAlive {
        session: u64,
    },
    Gone {
        session: u64,
    },
    Won {
        session: u64,
        /// The previous primary handed over cleanly (`cluster::takeover_clean`
        /// of the records as the campaign found them).
        clean: bool,
    },
    Lost,
    Committed {
        inc: u64,
        batch: Vec<Queued>,
        ok: bool,
    },
}

// ---------------------------------------------------------------------------
// The clients.

#[derive(Clone, Debug)]
enum Hold {
    Idle,
    Holding {
        lease: usize,
        token: u64,
        lease_id: [u8; 32],
        end_local_ms: u64,
        ttl_ms: u64,
    },
    /// Goes on writing under a term it no longer holds, until then.
    Zombie {
        lease: usize,
        token: u64,
        lease_id: [u8; 32],
        until_ms: u64,
    },
}

#[derive(Debug)]
struct Client {
    holder: String,
    /// The client's clock runs this many parts per million fast (or slow).
    skew_ppm: i64,
    offset_ms: u64,
    hold: Hold,
    outstanding: u32,
    zombie: bool,
    /// The member it sends to (cluster mode: another one after a failure).
    target: usize,
}

impl Client {
    fn local_ms(&self, now: u64) -> u64 {
        local_ms(self.offset_ms, self.skew_ppm, now)
    }

    /// When, on the simulated clock, this client's clock reads `local`.
    fn global_ms(&self, local: u64) -> u64 {
        let l = local.saturating_sub(self.offset_ms) as i128;
        (l * 1_000_000 / (1_000_000 + self.skew_ppm as i128)) as u64
    }
}

// ---------------------------------------------------------------------------
// The proxy: a thin shell around the core, as the lease store is.

/// One lease: the core's slot, which the lease store keeps too, and what
/// the store keeps beside it (its writes in flight, its waiters).
#[derive(Debug)]
struct Slot {
    lease: slot::Slot,
    inflight: Inflight,
    /// Writes waiting at the barrier: as the shell's waiters hold the
    /// lease's cell, the sweep does not forget it meanwhile.
    waiting: u32,
}

impl Slot {
    fn new(lease: slot::Slot) -> Self {
        Self {
            lease,
            inflight: Inflight::default(),
            waiting: 0,
        }
    }
}

#[derive(Debug)]
enum Ack {
    Grant {
        req: Req,
        grant: Grant,
        lease_id: [u8; 32],
        previous: Option<Term>,
    },
    Release {
        req: Req,
    },
    /// Made durable, as the lease store's dropped `persist_release` future
    /// asks, with nobody to answer.
    Durable,
    /// Nobody waits (a renewal's or a forget's record, or any the core's
    /// `record::awaited` says nobody waits for).
    None,
}

#[derive(Debug)]
struct Queued {
    record: Record,
    ack: Ack,
    /// The step it was queued at.
    step: u64,
}

#[derive(Debug)]
struct Proxy {
    inc: u64,
    /// The proxy's monotonic clock reads `clock_offset_ms` plus the
    /// simulated time, running `skew_ppm` fast (its member's clock).
    clock_offset_ms: u64,
    skew_ppm: i64,
    /// Cluster mode: the term of primacy it serves, its journal etcd.
    primacy: Option<Primacy>,
    /// Its wall clock's error.
    wall_error_ms: i64,
    slots: BTreeMap<usize, Slot>,
    unsettled_until_ms: u64,
    /// When its last write of unknown outcome settles (the store's
    /// `settling_left_ms`).
    settling_until_ms: u64,
    rule: RestartRule,
    header: Header,
    len: u64,
    meta: Meta,
    queue: Vec<Queued>,
    writing: bool,
    /// The file journal's health (the core's `writer::Health`).
    health: Health,
}

/// A primary's right to admit (cluster mode).
#[derive(Debug, Clone, Copy)]
struct Primacy {
    session: u64,
    until_ms: u64,
    revoked: bool,
}

/// A cluster member: a process that may serve as primary.
#[derive(Debug, Default)]
struct Member {
    skew_ppm: i64,
    clock_offset_ms: u64,
    paused_until: u64,
    /// Cut off from etcd (its messages and etcd's answers are lost) until
    /// then, while clients still reach it.
    cut_off_until: u64,
    alive: bool,
    /// Counts the member's process starts: answers for an earlier process
    /// are dropped.
    generation: u64,
    proxy: Option<Proxy>,
    session: Option<Session>,
    /// The process's key states of the routes with preconditions: kept
    /// across its terms of primacy, each of which begins with
    /// `KeyStates::take_over` (as the shell's per-shard table is).
    key_states: Option<KeyStates>,
    /// When its current term of primacy (standalone: its process) began.
    primacy_since_ms: u64,
    /// Stopped (SIGTERM), waiting for its writes before it exits.
    stopping: bool,
}

/// A member's etcd lease as it last confirmed it.
#[derive(Debug, Clone, Copy)]
struct Session {
    id: u64,
    /// When the last confirmed grant or keepalive was sent (its clock).
    sent_ms: u64,
}

/// The simulated etcd: linearizable, on the simulated clock.
#[derive(Debug, Default)]
struct Etcd {
    next_id: u64,
    /// Every session ever granted: its member, when it expires (or
    /// expired), whether etcd has let it go.
    sessions: BTreeMap<u64, (usize, u64, bool)>,
    /// The session holding the election key.
    leader: Option<u64>,
    /// The election last won (its session), as the winner records it, and
    /// the one whose primary recorded a clean handover; whether the
    /// current leader found its predecessor's handover clean.
    elected: Option<u64>,
    handed_over: Option<u64>,
    won_clean: bool,
    /// Every lease's state as the etcd journal keeps it, changed by each
    /// committed record with the core's rules (`journal::stored`), and as
    /// a member loads it.
    state: StoredState,
}

/// How long `ms` on a clock `skew_ppm` fast lasts on the simulated clock
/// (rounded up).
fn global_ms(ms: u64, skew_ppm: i64) -> u64 {
    let rate = 1_000_000 + skew_ppm as i128;
    ((ms as i128 * 1_000_000 + rate - 1) / rate) as u64
}

/// How long `ms` on a clock `skew_ppm` fast surely lasts on the simulated
/// clock (rounded down).
fn global_ms_floor(ms: u64, skew_ppm: i64) -> u64 {
    (ms as i128 * 1_000_000 / (1_000_000 + skew_ppm as i128)) as u64
}

/// Clock-rate slack for a span of `ttl_ms` between two clocks each up to
/// `skew_ppm` off.
fn skew_slack_ms(ttl_ms: u64, skew_ppm: u64) -> u64 {
    1 + ttl_ms * 2 * skew_ppm / 1_000_000
}

fn local_ms(offset_ms: u64, skew_ppm: i64, now: u64) -> u64 {
    offset_ms + (now as i128 * (1_000_000 + skew_ppm as i128) / 1_000_000) as u64
}

/// A write the proxy forwarded.
#[derive(Debug)]
struct Write {
    lease: usize,
    token: u64,
    inc: u64,
    client: usize,
    req: u64,
    apply_key: (u64, u64),
    applied: bool,
    answered: bool,
    /// When the proxy stopped waiting for it (answer, timeout, crash).
    gone_ms: Option<u64>,
    rogue: bool,
    /// The forwarding proxy's clock rate: the settle time is measured on
    /// that clock.
    skew_ppm: i64,
    /// On a route with preconditions: what the storage is to evaluate.
    cond: Option<Cond>,
    /// How long it holds newer terms back, as the shell's write guard.
    life: WriteLife,
}

/// A write on a route with preconditions.
#[derive(Debug)]
struct Cond {
    key: String,
    write: KeyWrite,
    exchange: precondition::Exchange,
    sent_ms: u64,
    /// The member whose table learns from its answer, and its process.
    member: usize,
    generation: u64,
    outcome: Option<Outcome>,
}

/// A read of a key on a route with preconditions.
#[derive(Debug)]
struct Read {
    key: String,
    inc: u64,
    member: usize,
    generation: u64,
    exchange: precondition::Exchange,
    sent_ms: u64,
    client: usize,
    req: u64,
    /// The request (an entry of `storage::READS`).
    shape: s3::Shape,
    /// What the key held when the storage served it.
    state: Option<State>,
}

// ---------------------------------------------------------------------------

struct World {
    cfg: Config,
    rng: fastrand::Rng,
    /// Picks the shape of the requests on routes with preconditions: a
    /// stream of its own, so the rest of a seed's run draws as it did
    /// before shapes were drawn.
    shapes: fastrand::Rng,
    now: u64,
    seq: u64,
    step: u64,
    events: BTreeMap<(u64, u64), Ev>,
    log: File,
    meta_file: Option<Vec<u8>>,
    proxy: Option<Proxy>,
    incarnation: u64,
    clients: Vec<Client>,
    writes: Vec<Write>,
    truth: Vec<LeaseTruth>,
    /// Requests a proxy took and has not answered: by id, the client and
    /// the incarnation that holds them.
    open: BTreeMap<u64, (usize, u64)>,
    next_req: u64,
    /// Since the last start: the disk was damaged, the power was cut.
    damaged: bool,
    /// A start found acknowledged records lost (and why), and died before
    /// it served: the log it rewrote keeps the loss's effects, which the
    /// next start's check must allow.
    loss_unchecked: Option<recovery::Loss>,
    stats: Stats,
    violation: Option<Violation>,
    /// The processes (one standalone): the proxy of the member whose event
    /// is being handled is moved into `proxy` meanwhile.
    members: Vec<Member>,
    /// The member of each incarnation (index: incarnation).
    inc_member: Vec<usize>,
    etcd: Etcd,
    /// The storage's keys on the routes with preconditions.
    keys: Keys,
    reads: Vec<Read>,
    /// The etcd behind the etcd-v3 route, and the highest token of a write
    /// it applied.
    etcd_store: EtcdStore,
    etcd_applied_max: u64,
    /// The DynamoDB table behind the dynamodb route, and the highest token
    /// of a write it applied.
    dynamo_store: DynamoStore,
    dynamo_applied_max: u64,
}

/// The key `k` of lease `lease`.
fn key_name(lease: usize, k: usize) -> String {
    format!("/l{lease}/k{k}")
}

impl World {
    fn new(cfg: Config) -> Self {
        let cfg_tag_kind = cfg.tag_kind;
        let mut rng = fastrand::Rng::with_seed(cfg.seed);
        let clients = (0..cfg.clients)
            .map(|i| Client {
                holder: format!("c{i}"),
                skew_ppm: match rng.u32(0..10) {
                    0 => 100_000,
                    1 => -100_000,
                    2..=4 => rng.i64(-2_000..=2_000),
                    _ => 0,
                },
                offset_ms: rng.u64(0..1_000_000),
                hold: Hold::Idle,
                outstanding: 0,
                zombie: rng.u32(0..3) == 0,
                target: 0,
            })
            .collect();
        let mut world = Self {
            truth: (0..cfg.leases).map(|_| LeaseTruth::default()).collect(),
            shapes: fastrand::Rng::with_seed(cfg.seed ^ 0x5348_4150_4553),
            cfg,
            rng,
            now: 0,
            seq: 0,
            step: 0,
            events: BTreeMap::new(),
            log: File::default(),
            meta_file: None,
            proxy: None,
            incarnation: 0,
            clients,
            writes: Vec::new(),
            open: BTreeMap::new(),
            next_req: 0,
            damaged: false,
            loss_unchecked: None,
            stats: Stats::default(),
            violation: None,
            members: Vec::new(),
            inc_member: vec![0],
            etcd: Etcd::default(),
            keys: Keys::new(cfg_tag_kind),
            reads: Vec::new(),
            etcd_store: EtcdStore::default(),
            etcd_applied_max: 0,
            dynamo_store: DynamoStore::default(),
            dynamo_applied_max: 0,
        };
        let skew = world.cfg.member_skew_ppm;
        for _ in 0..world.cfg.members.max(1) {
            let skew_ppm = if world.cfg.members > 1 && world.rng.bool() {
                world.rng.i64(-skew..=skew)
            } else {
                0
            };
            world.members.push(Member {
                skew_ppm,
                ..Member::default()
            });
        }
        for c in 0..world.clients.len() {
            let at = world.rng.u64(0..50);
            world.at(at, Ev::Wake(c));
            world.clients[c].target = world.rng.usize(0..world.members.len());
        }
        if world.cluster() {
            for m in 0..world.members.len() {
                world.after(0, Ev::MemberStart(m));
                world.schedule_pause(m);
            }
        } else {
            world.handle(Ev::Restart(0));
            world.schedule_crash();
        }
        world
    }

    fn cluster(&self) -> bool {
        self.cfg.members > 1
    }

    fn play(&mut self) {
        while self.step < self.cfg.steps && self.violation.is_none() {
            let Some(((at, _), ev)) = self.events.pop_first() else {
                break;
            };
            self.now = at;
            self.step += 1;
            if self.cfg.trace {
                eprintln!("{} {at}: {ev:?}", self.step);
            }
            self.handle(ev);
        }
    }

    fn at(&mut self, at: u64, ev: Ev) -> (u64, u64) {
        self.seq += 1;
        let key = (at.max(self.now), self.seq);
        self.events.insert(key, ev);
        key
    }

    fn after(&mut self, delay: u64, ev: Ev) -> (u64, u64) {
        self.at(self.now + delay, ev)
    }

    fn fail(&mut self, what: String) {
        if self.violation.is_none() {
            self.violation = Some(Violation {
                step: self.step,
                at_ms: self.now,
                what,
            });
        }
    }

    fn chance(&mut self, per_mille: u32) -> bool {
        self.rng.u32(0..1000) < per_mille
    }

    /// A network delay: often none at all, so edges are hit exactly.
    fn net(&mut self) -> u64 {
        if self.rng.u32(0..10) < 3 {
            0
        } else {
            self.rng.u64(1..=5)
        }
    }

    /// The member an event happens on, if any.
    fn target(&self, ev: &Ev) -> Option<usize> {
        match ev {
            Ev::Arrive(req) => Some(req.member),
            Ev::Retry { inc, .. } | Ev::Flush(inc) | Ev::Sweep(inc) | Ev::Synced { inc, .. } => {
                Some(self.inc_member[*inc as usize])
            }
            Ev::Answered(w) | Ev::BodyDone(w) | Ev::Timeout(w) => {
                Some(self.inc_member[self.writes[*w].inc as usize])
            }
            Ev::ReadAnswered(r) => Some(self.reads[*r].member),
            Ev::Crash(m) | Ev::Restart(m) => Some(*m),
            Ev::Beat { member, .. }
            | Ev::Poll { member, .. }
            | Ev::FromEtcd { member, .. }
            | Ev::Regrant { member, .. }
            | Ev::Drain { member, .. } => Some(*member),
            _ => None,
        }
    }

    /// Handles an event; one on a paused member waits until it wakes, and
    /// one on a member sees that member's proxy in `self.proxy`.
    fn handle(&mut self, ev: Ev) {
        let target = self.target(&ev);
        if let Some(m) = target {
            if self.members[m].paused_until > self.now {
                let at = self.members[m].paused_until;
                self.at(at, ev);
                return;
            }
            self.proxy = self.members[m].proxy.take();
        }
        self.handle_here(ev);
        if let Some(m) = target {
            self.members[m].proxy = self.proxy.take();
        }
    }

    fn handle_here(&mut self, ev: Ev) {
        match ev {
            Ev::Wake(c) => self.wake(c),
            Ev::Arrive(req) => self.arrive(req),
            Ev::Deliver {
                client,
                req,
                answer,
            } => self.deliver(client, req, answer),
            Ev::Retry { inc, req } => {
                if let Some(proxy) = self.proxy.as_mut().filter(|p| p.inc == inc) {
                    if let Some(slot) = proxy.slots.get_mut(&req.lease) {
                        slot.waiting = slot.waiting.saturating_sub(1);
                    }
                }
                if self.open.get(&req.id).is_some_and(|(_, i)| *i == inc) {
                    self.write(req)
                }
            }
            Ev::Flush(inc) => self.flush(inc),
            Ev::Sweep(inc) => self.sweep(inc),
            Ev::Synced {
                inc,
                rest,
                batch,
                len_before,
            } => self.synced(inc, rest, batch, len_before),
            Ev::Apply(w) => self.apply(w),
            Ev::Answered(w) => self.answered(w),
            Ev::ReadServed(r) => {
                let state = self.keys.state(&self.reads[r].key);
                self.reads[r].state = Some(state);
            }
            Ev::ReadAnswered(r) => self.read_answered(r),
            Ev::BodyDone(w) => self.body_done(w),
            Ev::Timeout(w) => self.timeout(w),
            Ev::Crash(m) if self.cluster() => {
                if self.chance(self.cfg.stops_per_mille) {
                    self.member_stop(m);
                } else {
                    self.member_crash(m);
                }
            }
            Ev::Drain {
                member,
                generation,
                session,
                bound_ms,
            } => self.drain(member, generation, session, bound_ms),
            Ev::Crash(_) => self.crash(),
            Ev::Restart(_) => self.start(),
            Ev::MemberStart(m) => self.member_start(m),
            Ev::Beat { member, session } => self.beat(member, session),
            Ev::Poll { member, session } => self.poll(member, session),
            Ev::Pause(m) => self.pause(m),
            Ev::Regrant { member, generation } => {
                let m = &self.members[member];
                if m.alive && m.generation == generation && m.session.is_none() {
                    self.send_etcd(member, EtcdOp::Grant);
                }
            }
            Ev::AtEtcd {
                member,
                generation,
                sent_ms,
                op,
            } => self.at_etcd(member, generation, sent_ms, op),
            Ev::FromEtcd {
                member,
                generation,
                sent_ms,
                reply,
            } => self.etcd_answered(member, generation, sent_ms, reply),
        }
    }
}

fn lease_name(lease: usize) -> String {
    format!("l{lease}")
}

fn lease_index(name: &str) -> Option<usize> {
    name.strip_prefix('l')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_exactly() {
        let a = run(&Config::new(7, 3_000));
        let b = run(&Config::new(7, 3_000));
        assert_eq!((a.steps, a.sim_ms, &a.stats), (b.steps, b.sim_ms, &b.stats));
        assert_eq!(a.violation, b.violation);
    }
}
