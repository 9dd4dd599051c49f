//! The simulated world: clients, the proxy around the real core, its
//! journal on a disk that loses what was not synced, a slow backend, and
//! the checker. One event at a time, in time order; ties in the order they
//! were scheduled; every random choice from one seeded generator.

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
// What the checker knows: the truth of every term, from the answers.

#[derive(Debug)]
struct TermTruth {
    ttl_ms: u64,
    /// The highest token granted (answered) when this one was issued: it
    /// must be above it. (Its own answer may come after a later term's: a
    /// primary paused between its commit and its answer.)
    granted_before: u64,
    /// No later than this (simulated time) may the term still be live.
    live_until_ms: u64,
    /// What the holder was promised: the latest deadline an answer gave it
    /// (simulated time). Until then the term is held, its writes and
    /// renewals are admitted and nobody else is granted the lease, unless
    /// it may have ended early (`may_end_early`).
    promised_until_ms: u64,
    /// The step at which the last renewal record (its wall-clock hint) was
    /// queued for the journal, and the step the last durable one was
    /// queued at: a start may end the term by an older hint while they
    /// differ (a record lost with a failed sync or a crash).
    hint_queued_step: u64,
    hint_durable_step: u64,
    /// The journal's queue dropped the record of its last due hint: the
    /// next renewal must record one (`restart::renewal_recorded`).
    hint_dropped: bool,
    /// A start may have ended the term before its promise: records were
    /// lost, its release may have reached the journal, or the hint of its
    /// last renewal may not have (a documented, safe loss).
    may_end_early: bool,
    acked: bool,
    release_acked: bool,
    release_issued: bool,
}

#[derive(Debug, Default)]
struct LeaseTruth {
    terms: BTreeMap<u64, TermTruth>,
    max_acked: u64,
    applied_max: u64,
}

impl LeaseTruth {
    /// Why term `token` has ended at `now`, if it has.
    fn ended(&self, token: u64, now: u64) -> Option<&'static str> {
        let Some(t) = self.terms.get(&token) else {
            return Some("was never granted");
        };
        if t.release_acked {
            Some("was released")
        } else if self.max_acked > token {
            Some("was superseded by a granted later term")
        } else if now >= t.live_until_ms {
            Some("is past its deadline")
        } else {
            None
        }
    }
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

    // -- clients ------------------------------------------------------------

    fn wake(&mut self, c: usize) {
        let now = self.now;
        let local = self.clients[c].local_ms(now);
        let next = self.rng.u64(1..=30);
        match self.clients[c].hold.clone() {
            Hold::Idle => {
                if self.clients[c].outstanding == 0 {
                    let lease = self.rng.usize(0..self.cfg.leases);
                    let ttl_ms = self.rng.u64(self.cfg.min_ttl_ms..=self.cfg.max_ttl_ms);
                    self.send(c, lease, 0, [0; 32], Op::Acquire { ttl_ms }, None);
                }
                self.after(next, Ev::Wake(c));
            }
            Hold::Zombie {
                lease,
                token,
                lease_id,
                until_ms,
            } => {
                if now >= until_ms {
                    self.clients[c].hold = Hold::Idle;
                } else if self.clients[c].outstanding < 3 {
                    let op = self.new_write();
                    self.send(c, lease, token, lease_id, op, None);
                }
                self.after(next, Ev::Wake(c));
            }
            Hold::Holding {
                lease,
                token,
                lease_id,
                end_local_ms,
                ttl_ms,
            } => {
                if local >= end_local_ms {
                    self.give_up(c, lease, token, lease_id, ttl_ms);
                    self.after(next, Ev::Wake(c));
                    return;
                }
                if self.clients[c].outstanding >= 3 {
                    self.after(next, Ev::Wake(c));
                    return;
                }
                match self.rng.u32(0..100) {
                    // The holder dies and comes back later as a new process
                    // that knows nothing: its lease must come free.
                    0 => {
                        self.clients[c].hold = Hold::Idle;
                        let down = self.rng.u64(ttl_ms..=5 * ttl_ms);
                        self.after(down, Ev::Wake(c));
                        return;
                    }
                    // A pause (GC, SIGSTOP), after which it goes on as if
                    // it still held the lease, whatever its clock says.
                    1..=3 => {
                        let pause = self.rng.u64(0..=2 * ttl_ms);
                        let op = self.new_write();
                        self.send(c, lease, token, lease_id, op, Some(self.now + pause));
                        self.after(pause + next, Ev::Wake(c));
                        return;
                    }
                    4..=8 => self.send(c, lease, token, lease_id, Op::Release, None),
                    9..=23 => self.send(c, lease, token, lease_id, Op::Renew, None),
                    // A write aimed at the last millisecond of the term, as
                    // the client's clock tells it.
                    24..=33 => {
                        let at = self.clients[c].global_ms(end_local_ms);
                        let op = self.new_write();
                        self.send(c, lease, token, lease_id, op, Some(at));
                    }
                    // A read of one of the lease's keys, racing its writes.
                    34..=37 if lease < self.cfg.precondition_leases => {
                        let key = self.rng.usize(0..self.cfg.keys_per_lease);
                        let shape = self.shape(s3::READS.len());
                        self.send(c, lease, 0, [0; 32], Op::Read { key, shape }, None);
                    }
                    _ => {
                        let op = self.new_write();
                        self.send(c, lease, token, lease_id, op, None);
                    }
                }
                self.after(next, Ev::Wake(c));
            }
        }
    }

    /// A write of a random key (a PUT of one of a few contents, or now and
    /// then a DELETE), for a lease on a route with preconditions; the
    /// other leases ignore which.
    fn new_write(&mut self) -> Op {
        let key = self.rng.usize(0..self.cfg.keys_per_lease);
        let delete = self.rng.u32(0..5) == 0;
        let content = self.rng.u64(0..3);
        let shapes = if delete {
            s3::DELETES.len()
        } else {
            s3::PUTS.len()
        };
        Op::Write {
            first_try_ms: None,
            key,
            delete,
            content,
            shape: self.shape(shapes),
        }
    }

    /// A request shape out of `n`: the plain one (the first) three times
    /// in four, any other the rest.
    fn shape(&mut self, n: usize) -> usize {
        if self.shapes.u32(0..4) == 0 {
            self.shapes.usize(1..n)
        } else {
            0
        }
    }

    /// The client thinks its term is over (or was told so).
    fn give_up(&mut self, c: usize, lease: usize, token: u64, lease_id: [u8; 32], ttl_ms: u64) {
        self.clients[c].hold = if self.clients[c].zombie {
            Hold::Zombie {
                lease,
                token,
                lease_id,
                until_ms: self.now + 2 * ttl_ms,
            }
        } else {
            Hold::Idle
        };
    }

    /// Sends a request; it arrives after a network delay (or exactly at
    /// `arrive_at`).
    fn send(
        &mut self,
        client: usize,
        lease: usize,
        token: u64,
        lease_id: [u8; 32],
        op: Op,
        arrive_at: Option<u64>,
    ) {
        self.next_req += 1;
        let req = Req {
            id: self.next_req,
            client,
            member: self.clients[client].target,
            lease,
            token,
            lease_id,
            op,
        };
        self.clients[client].outstanding += 1;
        let at = match arrive_at {
            Some(at) => at,
            None => self.now + self.net(),
        };
        self.at(at, Ev::Arrive(req));
    }

    fn reply(&mut self, req: &Req, answer: Answer) {
        if matches!(answer, Answer::Refused) {
            let what = match req.op {
                Op::Write { .. } => "write",
                Op::Renew => "renewal",
                Op::Release => "release",
                Op::Acquire { .. } => "acquire",
                Op::Read { .. } => "read",
            };
            self.check_refusal(req, what);
        }
        self.open.remove(&req.id);
        let delay = self.net();
        self.after(
            delay,
            Ev::Deliver {
                client: req.client,
                req: req.id,
                answer,
            },
        );
    }

    fn deliver(&mut self, c: usize, _req: u64, answer: Answer) {
        if matches!(answer, Answer::Failed) {
            // Another member may be the primary (or up).
            self.clients[c].target = self.rng.usize(0..self.members.len());
        }
        if let Answer::PreconditionRequired { lease, key } = answer {
            // The client reads the key once, as the 428 asks; its next
            // write of the key may then go.
            self.clients[c].outstanding = self.clients[c].outstanding.saturating_sub(1);
            self.send(c, lease, 0, [0; 32], Op::Read { key, shape: 0 }, None);
            return;
        }
        let client = &mut self.clients[c];
        client.outstanding = client.outstanding.saturating_sub(1);
        let local = client.local_ms(self.now);
        match (answer, client.hold.clone()) {
            (
                Answer::Granted {
                    lease,
                    token,
                    lease_id,
                    expires_in_ms,
                },
                _,
            ) => {
                let ttl_ms = self.truth[lease].terms.get(&token).map_or(0, |t| t.ttl_ms);
                self.clients[c].hold = Hold::Holding {
                    lease,
                    token,
                    lease_id,
                    end_local_ms: local + expires_in_ms,
                    ttl_ms,
                };
            }
            (Answer::Renewed { expires_in_ms }, Hold::Holding { .. }) => {
                if let Hold::Holding { end_local_ms, .. } = &mut self.clients[c].hold {
                    *end_local_ms = local + expires_in_ms;
                }
            }
            (
                Answer::Released | Answer::Refused,
                Hold::Holding {
                    lease,
                    token,
                    lease_id,
                    ttl_ms,
                    ..
                },
            ) => self.give_up(c, lease, token, lease_id, ttl_ms),
            _ => {}
        }
    }

    // -- the proxy ----------------------------------------------------------

    fn proxy_now(&self) -> u64 {
        self.proxy
            .as_ref()
            .map_or(0, |p| local_ms(p.clock_offset_ms, p.skew_ppm, self.now))
    }

    /// Whether the proxy may send anything now: standalone always; in
    /// cluster mode while its primacy is live on its own clock.
    fn primary_now(&self) -> bool {
        let now_ms = self.proxy_now();
        self.proxy.as_ref().and_then(|p| p.primacy).is_none_or(|p| {
            fencegate_core::cluster::primacy_admits(now_ms, p.until_ms, p.revoked, true)
        })
    }

    /// How long `ms` on the proxy's clock surely lasts on the simulated
    /// clock (rounded down).
    fn promised_ms(&self, ms: u64) -> u64 {
        global_ms_floor(ms, self.proxy.as_ref().map_or(0, |p| p.skew_ppm))
    }

    /// How far the clocks of two proxies may run apart (ppm).
    fn slack_skew_ppm(&self) -> u64 {
        if self.cluster() {
            self.cfg.member_skew_ppm.unsigned_abs()
        } else {
            0
        }
    }

    /// Whether the holder of term `token` of `lease` was promised it is
    /// live now (see [`TermTruth::promised_until_ms`]).
    fn promised(&self, lease: usize, token: u64) -> bool {
        let truth = &self.truth[lease];
        truth.terms.get(&token).is_some_and(|t| {
            token == truth.max_acked
                && t.acked
                && !t.release_issued
                && !t.may_end_early
                && self.now + skew_slack_ms(t.ttl_ms, self.slack_skew_ppm()) < t.promised_until_ms
        })
    }

    /// A promised term's request was refused: a violation.
    fn check_refusal(&mut self, req: &Req, what: &str) {
        if self.promised(req.lease, req.token) {
            let until = self.truth[req.lease].terms[&req.token].promised_until_ms;
            self.fail(format!(
                "lease l{} term {}, promised until {until} ms, had its {what} refused",
                req.lease, req.token
            ));
        }
    }

    /// How long `ms` on the proxy's clock lasts on the simulated clock.
    fn to_global_ms(&self, ms: u64) -> u64 {
        global_ms(ms, self.proxy.as_ref().map_or(0, |p| p.skew_ppm))
    }

    fn wall_ms(&self) -> u64 {
        let error = self.proxy.as_ref().map_or(0, |p| p.wall_error_ms);
        (WALL_BASE_MS + self.now).saturating_add_signed(error)
    }

    fn arrive(&mut self, req: Req) {
        let Some(inc) = self.proxy.as_ref().map(|p| p.inc) else {
            // Connection refused, or a standby's not-primary.
            self.reply(&req, Answer::Failed);
            return;
        };
        if !self.primary_now() {
            self.reply(&req, Answer::Failed);
            return;
        }
        self.open.insert(req.id, (req.client, inc));
        // Each procedure of the core's slot names the lease as the lease
        // store's does (a read is forwarded without the lease store).
        match req.op {
            Op::Acquire { ttl_ms } => self.acquire(req, ttl_ms),
            Op::Renew => self.renew(req),
            Op::Release => self.release(req),
            Op::Write { .. } => self.write(req),
            Op::Read { key, shape } => self.read(req, key, shape),
        }
    }

    fn acquire(&mut self, req: Req, ttl_ms: u64) {
        let p = self.proxy_now();
        let wall = self.wall_ms();
        let mut raw = [0u8; 16];
        self.rng.fill(&mut raw);
        let holder = self.clients[req.client].holder.clone();
        let proxy = self.proxy.as_mut().expect("arrive checked");
        let rule = proxy.rule;
        let slot = proxy
            .slots
            .entry(req.lease)
            .or_insert_with(|| Slot::new(slot::Slot::new(&rule)));
        let lease_id = LeaseId::from_bytes(raw);
        let name = lease_name(req.lease);
        let ask = slot::GrantAsk {
            lease: &name,
            holder: &holder,
            ttl_ms,
            now_ms: p,
            wall_ms: wall,
            unsettled_until_ms: proxy.unsettled_until_ms,
        };
        match slot
            .lease
            .grant(ask, lease_id.clone(), || Some(&mut slot.inflight))
        {
            Ok(slot::Granted {
                grant,
                previous,
                record,
            }) => {
                let record = Record::from(record);
                let token = grant.token;
                self.check_primacy("a grant");
                let before = self.truth[req.lease].max_acked;
                if self.promised(req.lease, before) {
                    let until = self.truth[req.lease].terms[&before].promised_until_ms;
                    self.fail(format!(
                        "lease l{} granted token {token} while term {before} was promised \
                         until {until} ms",
                        req.lease
                    ));
                }
                let live_until_ms = self.now + self.to_global_ms(ttl_ms);
                let granted_before = self.truth[req.lease].max_acked;
                self.truth[req.lease].terms.insert(
                    token,
                    TermTruth {
                        ttl_ms,
                        live_until_ms,
                        granted_before,
                        promised_until_ms: 0,
                        hint_queued_step: 0,
                        hint_durable_step: 0,
                        hint_dropped: false,
                        may_end_early: false,
                        acked: false,
                        release_acked: false,
                        release_issued: false,
                    },
                );
                let lease_id = lease_id.to_text();
                // As the lease store: the answer waits for the record if
                // the core's rule says so.
                if record.awaited() {
                    let ack = Ack::Grant {
                        req,
                        grant,
                        lease_id,
                        previous,
                    };
                    self.queue(record, ack);
                } else {
                    self.queue(record, Ack::None);
                    self.grant_done(req, (grant, lease_id), previous, true);
                }
            }
            Err(AcquireRefused::Held(held)) => {
                self.stats.held_refusals += 1;
                let truth = &self.truth[req.lease];
                if let Some(why) = truth.ended(held.token, self.now) {
                    // Released or superseded terms are never live in the
                    // machine; past its deadline is the liveness bound.
                    self.fail(format!(
                        "lease l{} refused as held by term {} ({} ms left), which {why}",
                        req.lease, held.token, held.expires_in_ms
                    ));
                }
                self.reply(&req, Answer::Held);
            }
            Err(AcquireRefused::TokensExhausted) => self.reply(&req, Answer::Failed),
        }
    }

    fn renew(&mut self, req: Req) {
        let p = self.proxy_now();
        let wall = self.wall_ms();
        let proxy = self.proxy.as_mut().expect("arrive checked");
        let Some(slot) = proxy.slots.get_mut(&req.lease) else {
            self.reply(&req, Answer::Refused);
            return;
        };
        let presented = slot::Presented {
            token: req.token,
            lease_id: Some(&req.lease_id),
            holder: None,
        };
        match slot.lease.renew(p, wall, presented, None) {
            Ok(slot::Renewed { grant, hint }) => {
                let expires_in_ms = grant.expires_in_ms(p);
                self.stats.renewals += 1;
                self.check_primacy("a renewal");
                let expires_in = self.to_global_ms(expires_in_ms);
                if let Some(why) = self.truth[req.lease].ended(req.token, self.now) {
                    self.fail(format!(
                        "lease l{} term {} renewed, but it {why}",
                        req.lease, req.token
                    ));
                }
                let promised_in = self.promised_ms(expires_in_ms);
                if let Some(t) = self.truth[req.lease].terms.get_mut(&req.token) {
                    t.live_until_ms = t.live_until_ms.max(self.now + expires_in);
                    t.promised_until_ms = t.promised_until_ms.max(self.now + promised_in);
                }
                let dropped = self.truth[req.lease]
                    .terms
                    .get(&req.token)
                    .is_some_and(|t| t.hint_dropped);
                match hint {
                    None if dropped => self.fail(format!(
                        "lease l{} term {} renewed after its last hint was dropped, with no \
                         record of a new one",
                        req.lease, req.token
                    )),
                    None => {}
                    Some(hint) => {
                        let record = Record::Renew {
                            lease: lease_name(req.lease),
                            token: hint.token,
                            ttl_ms: hint.ttl_ms,
                            wall_ms: hint.wall_ms,
                        };
                        // As the lease store: the hint is kept only once
                        // the journal took its record.
                        if self.queue_lazy(record) {
                            let proxy = self.proxy.as_mut().expect("arrive checked");
                            if let Some(slot) = proxy.slots.get_mut(&req.lease) {
                                slot.lease.hint_taken(&hint);
                            }
                        }
                    }
                }
                self.reply(&req, Answer::Renewed { expires_in_ms });
            }
            Err(_) => self.reply(&req, Answer::Refused),
        }
    }

    fn release(&mut self, req: Req) {
        let p = self.proxy_now();
        let proxy = self.proxy.as_mut().expect("arrive checked");
        let Some(slot) = proxy.slots.get_mut(&req.lease) else {
            self.reply(&req, Answer::Refused);
            return;
        };
        let presented = slot::Presented {
            token: req.token,
            lease_id: Some(&req.lease_id),
            holder: None,
        };
        let released = slot.lease.release(
            p,
            presented,
            || Some(&mut slot.inflight),
            proxy.unsettled_until_ms,
        );
        match released {
            Ok(quiet) => {
                if let Some(t) = self.truth[req.lease].terms.get_mut(&req.token) {
                    t.release_issued = true;
                }
                self.check_primacy("a release");
                let record = Record::Release {
                    lease: lease_name(req.lease),
                    token: req.token,
                    quiet,
                };
                if record.awaited() {
                    self.queue(record, Ack::Release { req });
                } else {
                    self.queue(record, Ack::None);
                    self.release_done(&req, true);
                }
            }
            Err(_) => self.reply(&req, Answer::Refused),
        }
    }

    fn write(&mut self, req: Req) {
        let first_try_ms = match req.op {
            Op::Write { first_try_ms, .. } => first_try_ms,
            _ => None,
        };
        // Checked again right before a write leaves (after a wait at the
        // barrier too), as the fence's before-send check does.
        if !self.primary_now() {
            self.reply(&req, Answer::Failed);
            return;
        }
        let p = self.proxy_now();
        let max_wait_ms = self.cfg.upstream_timeout_ms;
        let proxy = self.proxy.as_mut().expect("arrive checked");
        let inc = proxy.inc;
        let Some(slot) = proxy.slots.get_mut(&req.lease) else {
            self.stats.writes_refused += 1;
            self.reply(&req, Answer::Refused);
            return;
        };
        let check = WriteCheck {
            token: req.token,
            lease_id: Some(&req.lease_id),
            holder: None,
            margin_ms: 0,
            barrier: true,
        };
        let decision = slot
            .lease
            .admit(p, proxy.unsettled_until_ms, &check, || &mut slot.inflight);
        match decision {
            Decision::Admit(_) => {
                self.stats.writes_admitted += 1;
                self.check_primacy("a write");
                if let Some(why) = self.truth[req.lease].ended(req.token, self.now) {
                    self.fail(format!(
                        "lease l{} term {} had a write admitted, but it {why}",
                        req.lease, req.token
                    ));
                }
                // On a route with preconditions, the core's plan: a
                // precondition, or 428 with nothing sent.
                let cond = match self.plan_condition(&req, inc) {
                    Ok(cond) => cond,
                    Err(key) => {
                        // Nothing was sent: the write holds nothing back.
                        let settle_ms = self.cfg.settle_ms;
                        let proxy = self.proxy.as_mut().expect("arrive checked");
                        if let Some(slot) = proxy.slots.get_mut(&req.lease) {
                            WriteLife::new(req.token, settle_ms).finish(&mut slot.inflight);
                        }
                        self.stats.preconditions_required += 1;
                        let lease = req.lease;
                        self.reply(&req, Answer::PreconditionRequired { lease, key });
                        return;
                    }
                };
                self.forward(req, inc, cond);
            }
            Decision::Wait { until_ms, .. } => {
                let first = first_try_ms.unwrap_or(p);
                if first_try_ms.is_none() {
                    self.stats.barrier_waits += 1;
                }
                if admission::may_wait(first, p, max_wait_ms, until_ms).is_err() {
                    // The earlier term's writes did not finish in time, or
                    // will not: 503.
                    self.reply(&req, Answer::Failed);
                    return;
                }
                // Woken when the clock alone ends the wait, or looked at
                // again a moment later (a write finishing would wake it).
                let retry = until_ms
                    .map_or(u64::MAX, |u| u.saturating_sub(p))
                    .clamp(1, 3);
                let op = match req.op {
                    Op::Write {
                        key,
                        delete,
                        content,
                        shape,
                        ..
                    } => Op::Write {
                        first_try_ms: Some(first),
                        key,
                        delete,
                        content,
                        shape,
                    },
                    other => other,
                };
                let req = Req { op, ..req };
                let proxy = self.proxy.as_mut().expect("arrive checked");
                if let Some(slot) = proxy.slots.get_mut(&req.lease) {
                    slot.waiting += 1;
                }
                // It stays at the proxy (open): a crash meanwhile loses it.
                self.after(retry, Ev::Retry { inc, req });
            }
            Decision::Refuse(_) => {
                self.stats.writes_refused += 1;
                self.reply(&req, Answer::Refused);
            }
        }
    }

    /// Sends an admitted write to the backend: it answers after a latency
    /// (sometimes past the upstream timeout) and applies the write before
    /// or after it answers, within the settle time after the connection
    /// is gone, or, for a rogue write, later.
    fn forward(&mut self, req: Req, inc: u64, cond: Option<Cond>) {
        let timeout = self.cfg.upstream_timeout_ms;
        let settle = self.cfg.settle_ms;
        let mut latency = if self.rng.u32(0..10) < 8 {
            self.rng.u64(0..=10)
        } else {
            self.rng.u64(0..=2 * timeout)
        };
        let rogue = self.chance(self.cfg.rogue_per_mille);
        if rogue && cond.is_some() {
            // A write the storage applies late is one the proxy stopped
            // waiting for: it gets no answer.
            latency = timeout;
        }
        // An answer means the write was applied; a write the proxy stops
        // waiting for (a timeout, a crash) may be applied up to the settle
        // time later (see `connection_gone`).
        let apply_in = if rogue {
            timeout + settle + self.rng.u64(1..=200)
        } else if latency < timeout {
            self.rng.u64(0..=latency)
        } else {
            self.rng.u64(0..=timeout + settle)
        };
        let w = self.writes.len();
        if self.cfg.trace {
            eprintln!(
                "  write {w}: lease l{} term {} forwarded by incarnation {inc}, applied in \
                 {apply_in} ms (rogue: {rogue}), answered in {latency} ms",
                req.lease, req.token
            );
        }
        let apply_key = self.after(apply_in, Ev::Apply(w));
        self.writes.push(Write {
            lease: req.lease,
            token: req.token,
            inc,
            client: req.client,
            req: req.id,
            apply_key,
            applied: false,
            answered: false,
            gone_ms: None,
            rogue,
            skew_ppm: self.proxy.as_ref().map_or(0, |p| p.skew_ppm),
            cond,
            life: WriteLife::new(req.token, self.cfg.settle_ms),
        });
        if latency < timeout {
            self.after(latency, Ev::Answered(w));
        } else {
            self.after(timeout, Ev::Timeout(w));
        }
    }

    /// The proxy stopped waiting for write `w`: unless it is rogue, the
    /// backend applies it within the settle time from now.
    fn connection_gone(&mut self, w: usize) {
        let write = &mut self.writes[w];
        if write.gone_ms.is_some() {
            return;
        }
        // The settle time as the proxy measures it: a proxy whose clock runs
        // fast waits a little less in real time (the bound is its clock's).
        let settle = global_ms_floor(self.cfg.settle_ms, write.skew_ppm);
        write.gone_ms = Some(self.now);
        let bound = self.now + settle;
        if write.applied || write.rogue || write.apply_key.0 <= bound {
            return;
        }
        let key = write.apply_key;
        let at = self.now + self.rng.u64(0..=settle);
        if let Some(ev) = self.events.remove(&key) {
            let key = self.at(at, ev);
            self.writes[w].apply_key = key;
        }
    }

    fn apply(&mut self, w: usize) {
        if Some(self.writes[w].lease) == self.cfg.etcd_lease {
            self.apply_to_etcd(w);
        }
        if Some(self.writes[w].lease) == self.cfg.dynamo_lease {
            self.apply_to_dynamo(w);
        }
        let write = &mut self.writes[w];
        write.applied = true;
        if let Some(cond) = &mut write.cond {
            // The storage evaluates the precondition, however late; the
            // key's guarantee is checked for every write, rogue or not.
            match self.keys.apply(&cond.key, self.now, cond.write) {
                Ok(outcome) => cond.outcome = Some(outcome),
                Err(violation) => {
                    self.fail(violation.to_string());
                    return;
                }
            }
            self.stats.late_stale_refused = self.keys.refused_stale;
            self.stats.returned_states = self.keys.returns;
            if cond.outcome == Some(Outcome::Refused) {
                self.stats.preconditions_refused += 1;
                return;
            }
        }
        let write = &self.writes[w];
        if write.rogue {
            self.stats.rogue_writes += 1;
            return;
        }
        self.stats.writes_applied += 1;
        let (lease, token) = (write.lease, write.token);
        let truth = &mut self.truth[lease];
        if token < truth.applied_max {
            let applied_max = truth.applied_max;
            self.fail(format!(
                "the backend applied a write of lease l{lease} term {token} after one of term \
                 {applied_max}"
            ));
        }
        let truth = &mut self.truth[lease];
        truth.applied_max = truth.applied_max.max(token);
    }

    /// Write `w` reaches the etcd behind the etcd-v3 route: the core's
    /// transaction around a put of its key, run as etcd runs it, however
    /// late. A lease's first write only makes its fence key, and the shell
    /// sends it again at once (a rogue write got no answer: not sent
    /// again). etcd must never apply a write of a term after one of a
    /// later term of the lease.
    fn apply_to_etcd(&mut self, w: usize) {
        use fencegate_core::body_keys::etcd::{fenced, Call};
        let write = &self.writes[w];
        let (lease, token, rogue) = (write.lease, write.token, write.rogue);
        let key = key_name(lease, 0);
        let b64 = |s: &str| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(s)
        };
        let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, b64(&key), b64("v"));
        let fence_key = format!("fencegate/fence/{}", lease_name(lease));
        let txn = fenced(Call::Put, body.as_bytes(), fence_key.as_bytes(), token)
            .expect("a put the core reads");
        let mut ran = self.etcd_store.run(&txn);
        if !rogue && ran.puts == [fence_key.as_bytes().to_vec()] {
            ran = self.etcd_store.run(&txn);
        }
        if !ran.puts.contains(&key.into_bytes()) {
            self.stats.etcd_refused += 1;
            return;
        }
        self.stats.etcd_applied += 1;
        if token < self.etcd_applied_max {
            let max = self.etcd_applied_max;
            self.fail(format!(
                "etcd applied a write of lease l{lease} term {token} after one of term {max} \
                 (rogue: {rogue})"
            ));
        }
        self.etcd_applied_max = self.etcd_applied_max.max(token);
    }

    /// Write `w` reaches the DynamoDB table behind the dynamodb route, as
    /// a client's `PutItem` of the lease's item (every fourth without the
    /// token and its condition, which fencegate must not let through),
    /// however late. The table must never apply a write of a term to the
    /// item after one of a later term.
    fn apply_to_dynamo(&mut self, w: usize) {
        let write = &self.writes[w];
        let (lease, token, rogue) = (write.lease, write.token, write.rogue);
        let conditioned = !w.is_multiple_of(4);
        let pk = format!("l{lease}/k0");
        match self.dynamo_store.put(&pk, token, conditioned) {
            None => self.stats.dynamo_unsent += 1,
            Some(false) => self.stats.dynamo_refused += 1,
            Some(true) => {
                self.stats.dynamo_applied += 1;
                if token < self.dynamo_applied_max {
                    let max = self.dynamo_applied_max;
                    self.fail(format!(
                        "DynamoDB applied a write of item {pk} term {token} after one of term \
                         {max} (rogue: {rogue}, conditioned: {conditioned})"
                    ));
                }
                self.dynamo_applied_max = self.dynamo_applied_max.max(token);
            }
        }
    }

    fn live_write(&self, w: usize) -> bool {
        let write = &self.writes[w];
        self.proxy.as_ref().is_some_and(|p| p.inc == write.inc) && write.gone_ms.is_none()
    }

    fn answered(&mut self, w: usize) {
        // The shell learns from every answer its process gets, the old
        // primacy's too (the core then ignores it).
        self.learn_write(w, false);
        if !self.live_write(w) {
            return;
        }
        let p = self.proxy_now();
        let write = &mut self.writes[w];
        if let Some(slot) = self
            .proxy
            .as_mut()
            .and_then(|px| px.slots.get_mut(&write.lease))
        {
            write.life.answered(&mut slot.inflight, p);
        }
        self.writes[w].answered = true;
        self.connection_gone(w);
        let body = self.rng.u64(0..=3);
        self.after(body, Ev::BodyDone(w));
    }

    fn body_done(&mut self, w: usize) {
        let write = &self.writes[w];
        if self.proxy.as_ref().is_none_or(|p| p.inc != write.inc) {
            return;
        }
        let (lease, client, req) = (write.lease, write.client, write.req);
        let write = &mut self.writes[w];
        if let Some(slot) = self.proxy.as_mut().and_then(|px| px.slots.get_mut(&lease)) {
            write.life.finish(&mut slot.inflight);
        }
        self.reply_to(client, req, Answer::Written);
    }

    fn timeout(&mut self, w: usize) {
        if !self.live_write(w) {
            return;
        }
        self.learn_write(w, true);
        let p = self.proxy_now();
        let write = &mut self.writes[w];
        let (client, req) = (write.client, write.req);
        if let Some(px) = self.proxy.as_mut() {
            // A lease forgotten meanwhile: the shell's guard keeps its own
            // (no longer shared) count.
            let mut gone = Inflight::default();
            let inflight = px
                .slots
                .get_mut(&write.lease)
                .map_or(&mut gone, |slot| &mut slot.inflight);
            let ended = write.life.abandon(inflight, p);
            // As the lease store counts an ended write: its settling time
            // holds back a handover too.
            if let Some(at) = ended.and_then(|e| e.settles_at_ms) {
                px.settling_until_ms = inflight::settling_until(px.settling_until_ms, at);
            }
        }
        self.connection_gone(w);
        self.reply_to(client, req, Answer::Failed);
    }

    /// The member serving now, and its process's key states.
    fn serving_member(&self, inc: u64) -> usize {
        self.inc_member[inc as usize]
    }

    /// The core's plan for a write on a route with preconditions (`Ok(None)`
    /// on other routes); `Err(key)`: 428, nothing sent. Checks that a
    /// precondition names a state the key held since this member's term of
    /// primacy began (a new primary starts knowing none).
    fn plan_condition(&mut self, req: &Req, inc: u64) -> Result<Option<Cond>, usize> {
        let Op::Write {
            key,
            delete,
            content,
            shape,
            ..
        } = req.op
        else {
            return Ok(None);
        };
        if req.lease >= self.cfg.precondition_leases {
            return Ok(None);
        }
        let shape = if delete {
            s3::DELETES[shape]
        } else {
            s3::PUTS[shape]
        };
        let name = key_name(req.lease, key);
        let m = self.serving_member(inc);
        let member = &mut self.members[m];
        let states = member
            .key_states
            .as_mut()
            .expect("a serving process has key states");
        // The shell's reading of the request, the core's plan.
        let sent = |h: Option<&'static str>| h.map_or(Sent::Absent, |v| Sent::One(v.as_bytes()));
        let own = Own {
            if_match: sent(shape.if_match),
            if_none_match: sent(shape.if_none_match),
        };
        let op = Operation::of(Dialect::S3, shape.method, shape.query, false);
        let (plan, exchange) = states.plan_write(&name, op, &own, true);
        let own_header = |h: Option<&'static str>| h.map(|v| s3::Header::parse(v.as_bytes()));
        let (added, if_match, if_none_match) = match plan {
            Plan::Required(_) => return Err(key),
            Plan::IfMatch(tag) => {
                let state = State::from_etag(&tag).expect("a tag the storage gave");
                (Some(state), Some(s3::Header::parse(&tag)), None)
            }
            Plan::IfNoneMatchAny => (Some(State::Absent), None, Some(s3::Header::Any)),
            Plan::AsSent => (
                None,
                own_header(shape.if_match),
                own_header(shape.if_none_match),
            ),
        };
        let (since, generation) = (member.primacy_since_ms, member.generation);
        if let Some(state) = added {
            if !self.keys.held_between(&name, state, since, self.now) {
                self.fail(format!(
                    "member {m} sent a write of {name} naming {state:?}, a state the key has not \
                     held since the member's term of primacy began at {since} ms"
                ));
            }
        }
        Ok(Some(Cond {
            key: name,
            write: KeyWrite {
                token: req.token,
                shape,
                if_match,
                if_none_match,
                content,
            },
            exchange,
            sent_ms: self.now,
            member: m,
            generation,
            outcome: None,
        }))
    }

    /// The key states of member `m`'s process `generation`, if it still
    /// runs.
    fn key_states(&mut self, m: usize, generation: u64) -> Option<&mut KeyStates> {
        let member = &mut self.members[m];
        if member.generation != generation {
            return None;
        }
        member.key_states.as_mut()
    }

    /// The member's process learns from the answer to write `w` (`unknown`:
    /// it stopped waiting for it).
    fn learn_write(&mut self, w: usize, unknown: bool) {
        let Some(cond) = &self.writes[w].cond else {
            return;
        };
        let (m, generation, sent_ms) = (cond.member, cond.generation, cond.sent_ms);
        let key = cond.key.clone();
        let exchange = cond.exchange.clone();
        let deleted =
            s3::s3_operation(cond.write.shape.method, cond.write.shape.query) == s3::S3Op::Delete;
        let (status, etag) = match (unknown, cond.outcome) {
            (false, Some(Outcome::Applied(state))) => {
                (if deleted { 204 } else { 200 }, state.etag())
            }
            (false, Some(Outcome::Refused)) => (412, None),
            (false, Some(Outcome::Untouched)) => (200, None),
            _ => (0, None),
        };
        let answer = match status {
            0 => precondition::Answer::Unknown,
            status => precondition::Answer::Storage {
                status,
                etag: etag.as_deref().map(str::as_bytes),
                code: None,
            },
        };
        let Some(states) = self.key_states(m, generation) else {
            return;
        };
        let before = states.known(&key).cloned();
        states.learn(&key, &exchange, answer);
        self.check_learned(m, generation, &key, before, sent_ms);
    }

    /// What a member's process learned about `key` from an exchange sent at
    /// `sent_ms` must be a state the key held while it ran.
    fn check_learned(
        &mut self,
        m: usize,
        generation: u64,
        key: &str,
        before: Option<precondition::KeyState>,
        sent_ms: u64,
    ) {
        let Some(states) = self.key_states(m, generation) else {
            return;
        };
        let after = states.known(key).cloned();
        if after == before {
            return;
        }
        let Some(learned) = after else {
            return;
        };
        let state = match &learned {
            precondition::KeyState::Absent => State::Absent,
            precondition::KeyState::Tagged(tag) => {
                State::from_etag(tag).expect("a tag the storage gave")
            }
        };
        if !self.keys.held_between(key, state, sent_ms, self.now) {
            self.fail(format!(
                "member {m} learned that {key} is {state:?}, which it never was between \
                 {sent_ms} ms, when the exchange began, and its answer"
            ));
        }
    }

    /// A read of a key on a route with preconditions: the storage serves it
    /// a moment later, and its answer teaches the member's process.
    fn read(&mut self, req: Req, key: usize, shape: usize) {
        let inc = self.proxy.as_ref().expect("arrive checked").inc;
        let m = self.serving_member(inc);
        let member = &self.members[m];
        let generation = member.generation;
        let shape = s3::READS[shape];
        let exchange = member
            .key_states
            .as_ref()
            .expect("a serving process has key states")
            .read(shape.method, shape.query);
        self.stats.key_reads += 1;
        let r = self.reads.len();
        self.reads.push(Read {
            key: key_name(req.lease, key),
            inc,
            member: m,
            generation,
            exchange,
            sent_ms: self.now,
            client: req.client,
            req: req.id,
            shape,
            state: None,
        });
        let served = self.rng.u64(0..=3);
        let answered = served + self.rng.u64(0..=3);
        self.after(served, Ev::ReadServed(r));
        self.after(answered, Ev::ReadAnswered(r));
    }

    fn read_answered(&mut self, r: usize) {
        let read = &self.reads[r];
        let (m, generation, sent_ms) = (read.member, read.generation, read.sent_ms);
        let (key, exchange) = (read.key.clone(), read.exchange.clone());
        let (client, req, inc) = (read.client, read.req, read.inc);
        let state = read.state.expect("served before answered");
        // As S3 answers it (the shell reads a GET's error code from its
        // body, a HEAD's 404 has none).
        let (status, tagged, code) = s3::read_answer(read.shape, state);
        let etag = tagged.and_then(State::etag);
        let answer = precondition::Answer::Storage {
            status,
            etag: etag.as_deref().map(str::as_bytes),
            code: code.map(str::as_bytes),
        };
        if let Some(states) = self.key_states(m, generation) {
            let before = states.known(&key).cloned();
            states.learn(&key, &exchange, answer);
            self.check_learned(m, generation, &key, before, sent_ms);
        }
        let live = self.proxy.as_ref().is_some_and(|p| p.inc == inc);
        if live && self.open.contains_key(&req) {
            self.reply_to(client, req, Answer::Read);
        }
    }

    fn reply_to(&mut self, client: usize, req: u64, answer: Answer) {
        self.open.remove(&req);
        let delay = self.net();
        self.after(
            delay,
            Ev::Deliver {
                client,
                req,
                answer,
            },
        );
    }

    // -- the journal ----------------------------------------------------------

    /// The lease store's sweep: forgets, by the core's rule, the leases
    /// quiet for the retention time (or, making room, for none), raising
    /// the mark new terms of a name not in the store start above, and
    /// journals each (as the shell's `forget`).
    fn sweep(&mut self, inc: u64) {
        if self.proxy.as_ref().is_none_or(|p| p.inc != inc) {
            return;
        }
        let every = self.rng.u64(20..=200);
        self.after(every, Ev::Sweep(inc));
        if !self.primary_now() {
            return;
        }
        let now_ms = self.proxy_now();
        let making_room = self.rng.u32(0..10) < 3;
        let proxy = self.proxy.as_mut().expect("checked above");
        let sweep = if making_room {
            retention::Sweep::making_room(now_ms, proxy.unsettled_until_ms)
        } else {
            retention::Sweep::idle(now_ms, self.cfg.retention_ms, proxy.unsettled_until_ms)
        };
        let gone: Vec<(usize, u64)> = proxy
            .slots
            .iter_mut()
            .filter_map(|(&lease, slot)| {
                let Slot {
                    lease: kept,
                    inflight,
                    waiting,
                } = slot;
                let mark = kept.forget(&sweep, *waiting > 0, || Some(inflight))?;
                Some((lease, mark))
            })
            .take(sweep.most)
            .collect();
        for (lease, mark) in gone {
            let proxy = self.proxy.as_mut().expect("checked above");
            proxy.slots.remove(&lease);
            proxy.rule.forgotten_above = record::forgotten_above(proxy.rule.forgotten_above, mark);
            self.stats.forgotten += 1;
            let record = Record::Forget {
                lease: lease_name(lease),
                last_token: mark,
            };
            self.queue_lazy(record);
        }
    }

    /// Queues a record nobody waits for: dropped, as the store's bounded
    /// queue drops it, if a standalone proxy's queue is full. Whether it
    /// was queued.
    fn queue_lazy(&mut self, record: Record) -> bool {
        let proxy = self.proxy.as_ref().expect("only a running proxy queues");
        let dropped = proxy.primacy.is_none() && proxy.queue.len() >= self.cfg.journal_queue;
        if let Record::Renew { token, .. } = record {
            let lease = record.lease().and_then(lease_index);
            if let Some(t) = lease.and_then(|l| self.truth[l].terms.get_mut(&token)) {
                t.hint_dropped = dropped;
                if dropped {
                    // Lost: a start may end the term by an older hint.
                    t.hint_queued_step = self.step;
                }
            }
        }
        if dropped {
            self.stats.lazy_records_dropped += 1;
            return false;
        }
        self.queue(record, Ack::None);
        true
    }

    fn queue(&mut self, record: Record, ack: Ack) {
        if let Record::Renew { token, .. } = record {
            if let Some(lease) = record.lease().and_then(lease_index) {
                if let Some(t) = self.truth[lease].terms.get_mut(&token) {
                    t.hint_queued_step = self.step;
                }
            }
        }
        let proxy = self.proxy.as_mut().expect("only a running proxy queues");
        proxy.queue.push(Queued {
            record,
            ack,
            step: self.step,
        });
        if !proxy.writing {
            proxy.writing = true;
            let inc = proxy.inc;
            let delay = self.rng.u64(0..=1);
            self.after(delay, Ev::Flush(inc));
        }
    }

    /// The writer takes what is queued and runs the core's plan up to the
    /// sync, which takes a while.
    fn flush(&mut self, inc: u64) {
        let Some(proxy) = self.proxy.as_mut().filter(|p| p.inc == inc) else {
            return;
        };
        let batch = std::mem::take(&mut proxy.queue);
        if batch.is_empty() {
            proxy.writing = false;
            return;
        }
        let mut buf = Vec::new();
        let max_token = writer::encode_batch(batch.iter().map(|q| &q.record), &mut buf);
        if let Some(primacy) = proxy.primacy {
            // One etcd transaction, which holds only while this member's
            // session holds the election.
            let member = self.inc_member[inc as usize];
            let op = EtcdOp::Commit {
                session: primacy.session,
                inc,
                batch,
            };
            self.send_etcd(member, op);
            return;
        }
        // The file journal's rule.
        let sync = writer::batch_syncs(proxy.health, batch.iter().map(|q| &q.record));
        let log = append::Log {
            header: proxy.header,
            len: proxy.len,
            reserved: proxy.meta.reserved,
            floor_block: FLOOR_BLOCK,
        };
        let len_before = proxy.len;
        let mut steps: Vec<Step> = append::plan(&log, buf.len() as u64, sync, max_token)
            .into_iter()
            .collect();
        steps.reverse();
        while let Some(step) = steps.pop() {
            match step {
                Step::RaiseReserved(reserved) => {
                    proxy.meta.reserved = reserved;
                    self.meta_file = Some(proxy.meta.encode());
                }
                Step::WriteBatch => {
                    self.log.write(proxy.len, &buf);
                    proxy.len += buf.len() as u64;
                }
                Step::Sync => {
                    steps.reverse();
                    let delay = self.rng.u64(1..=5);
                    self.after(
                        delay,
                        Ev::Synced {
                            inc,
                            rest: steps,
                            batch,
                            len_before,
                        },
                    );
                    return;
                }
                Step::WriteHeader(header) => {
                    self.log.write(header.offset(), &header.encode());
                    proxy.header = header;
                }
            }
        }
        self.batch_done(batch, true);
    }

    fn synced(&mut self, inc: u64, rest: Vec<Step>, batch: Vec<Queued>, len_before: u64) {
        if self.proxy.as_ref().is_none_or(|p| p.inc != inc) {
            return;
        }
        if self.chance(self.cfg.sync_failures_per_mille) {
            // EIO: nothing became durable; the writer cuts the batch off.
            self.stats.failed_syncs += 1;
            let proxy = self.proxy.as_mut().expect("checked");
            proxy.health = Health::after(false);
            proxy.len = len_before;
            self.log.set_len(len_before);
            self.batch_done(batch, false);
            return;
        }
        self.log.sync();
        self.hints_durable(&batch);
        let proxy = self.proxy.as_mut().expect("checked");
        proxy.health = Health::after(true);
        for step in rest {
            if let Step::WriteHeader(header) = step {
                self.log.write(header.offset(), &header.encode());
                proxy.header = header;
            }
        }
        self.batch_done(batch, true);
    }

    /// The renewal records of `batch` are durable: their hints count.
    fn hints_durable(&mut self, batch: &[Queued]) {
        for q in batch {
            if let Record::Renew { token, .. } = q.record {
                if let Some(lease) = q.record.lease().and_then(lease_index) {
                    if let Some(t) = self.truth[lease].terms.get_mut(&token) {
                        t.hint_durable_step = t.hint_durable_step.max(q.step);
                    }
                }
            }
        }
    }

    /// Answers what waited for a batch; the writer takes the next one.
    fn batch_done(&mut self, batch: Vec<Queued>, ok: bool) {
        for q in batch {
            match q.ack {
                Ack::Grant {
                    req,
                    grant,
                    lease_id,
                    previous,
                } => self.grant_done(req, (grant, lease_id), previous, ok),
                Ack::Release { req } => self.release_done(&req, ok),
                Ack::Durable | Ack::None => {}
            }
        }
        let proxy = self
            .proxy
            .as_mut()
            .expect("a batch ends on a running proxy");
        if proxy.queue.is_empty() {
            proxy.writing = false;
        } else {
            let inc = proxy.inc;
            self.after(0, Ev::Flush(inc));
        }
    }

    /// A release's record is durable (`ok`) or not, or nobody waits for it:
    /// its answer.
    fn release_done(&mut self, req: &Req, ok: bool) {
        if ok {
            self.stats.releases += 1;
            if let Some(t) = self.truth[req.lease].terms.get_mut(&req.token) {
                t.release_acked = true;
            }
            self.reply(req, Answer::Released);
        } else {
            self.reply(req, Answer::Failed);
        }
    }

    /// A grant's record is durable (`ok`) or not. As the lease store does,
    /// the answer counts the time spent persisting against the term (it
    /// may have expired meanwhile, on a member that was paused).
    fn grant_done(
        &mut self,
        req: Req,
        (grant, lease_id): (Grant, [u8; 32]),
        previous: Option<Term>,
        ok: bool,
    ) {
        let p = self.proxy_now();
        let token = grant.token;
        let proxy = self.proxy.as_mut().expect("checked");
        if !ok {
            // A term that ran out while it was persisted may have been
            // forgotten meanwhile (the mark is above its token already).
            if let Some(slot) = proxy.slots.get_mut(&req.lease) {
                slot.lease.abandon(token, previous);
            }
            self.reply(&req, Answer::Failed);
            return;
        }
        let expires_in_ms = grant.expires_in_ms(p);
        self.stats.grants += 1;
        let before = self.truth[req.lease]
            .terms
            .get(&token)
            .map_or(u64::MAX, |t| t.granted_before);
        if token <= before {
            self.fail(format!(
                "lease l{} granted token {token}, issued after token {before} was granted",
                req.lease
            ));
        }
        let promised_in = self.promised_ms(expires_in_ms);
        let expires_in = self.to_global_ms(expires_in_ms);
        let truth = &mut self.truth[req.lease];
        truth.max_acked = truth.max_acked.max(token);
        if let Some(t) = truth.terms.get_mut(&token) {
            t.acked = true;
            t.promised_until_ms = t.promised_until_ms.max(self.now + promised_in);
            t.live_until_ms = t.live_until_ms.max(self.now + expires_in);
        }
        self.reply(
            &req,
            Answer::Granted {
                lease: req.lease,
                token,
                lease_id,
                expires_in_ms,
            },
        );
    }

    // -- crashes and starts -------------------------------------------------

    fn schedule_crash(&mut self) {
        let mean = self.cfg.crash_every_ms.max(2);
        let at = self.rng.u64(1..2 * mean);
        self.after(at, Ev::Crash(0));
    }

    fn crash(&mut self) {
        let Some(proxy) = self.proxy.take() else {
            return;
        };
        self.stats.crashes += 1;
        self.abandon(proxy.inc);
        if self.chance(self.cfg.power_cuts_per_mille) {
            self.stats.power_cuts += 1;
            self.power_cut();
        }
        if self.chance(self.cfg.damage_per_mille) {
            self.damage();
        }
        let down = self.rng.u64(1..=300);
        self.after(down, Ev::Restart(0));
    }

    /// The file journal's change of identity at a start, step by step as
    /// the core plans it (`fencegate_core::journal::writer`). The process
    /// may die before any step: `None`.
    fn change_identity(
        &mut self,
        mut header: Header,
        mut len: u64,
        mut meta: Meta,
    ) -> Option<(Header, u64, Meta)> {
        let random = self.rng.u64(..);
        let next = writer::next_identity(meta.identity, Some(random));
        for step in writer::change_identity(meta, next) {
            if self.chance(self.cfg.start_crashes_per_mille) {
                return None;
            }
            match step {
                IdentityStep::WriteMeta(m) => {
                    meta = m;
                    self.meta_file = Some(meta.encode());
                }
                IdentityStep::Append(id) => {
                    let own = writer::identity_append(id);
                    let log = append::Log {
                        header,
                        len,
                        reserved: meta.reserved,
                        floor_block: FLOOR_BLOCK,
                    };
                    for step in append::plan(&log, own.bytes.len() as u64, own.sync, own.max_token)
                    {
                        match step {
                            Step::RaiseReserved(_) => {}
                            Step::WriteBatch => {
                                self.log.write(len, &own.bytes);
                                len += own.bytes.len() as u64;
                            }
                            Step::Sync => self.log.sync(),
                            Step::WriteHeader(h) => {
                                self.log.write(h.offset(), &h.encode());
                                header = h;
                            }
                        }
                    }
                }
            }
        }
        Some((header, len, meta))
    }

    /// The power goes: what was not synced may be lost or torn.
    fn power_cut(&mut self) {
        let rng = &mut self.rng;
        let mut tear_rng = rng.fork();
        let cut = self.log.power_cut(
            |_| rng.bool(),
            |len| (tear_rng.u32(0..5) == 0).then(|| tear_rng.usize(0..len.max(1))),
        );
        if cut.torn {
            self.stats.torn_writes += 1;
        }
    }

    /// The process died during a start, before it served: it may take
    /// the power with it, and it starts again later.
    fn crash_at_start(&mut self) {
        self.stats.start_crashes += 1;
        if self.chance(self.cfg.power_cuts_per_mille) {
            self.stats.power_cuts += 1;
            self.power_cut();
        }
        let down = self.rng.u64(1..=300);
        self.after(down, Ev::Restart(0));
    }

    /// A proxy is gone (its process died, or a new term of primacy replaced
    /// it): every request it held fails, every write it forwarded has lost
    /// its connection.
    fn abandon(&mut self, inc: u64) {
        let lost: Vec<(u64, usize)> = self
            .open
            .iter()
            .filter(|(_, (_, i))| *i == inc)
            .map(|(id, (client, _))| (*id, *client))
            .collect();
        for (id, client) in lost {
            self.open.remove(&id);
            self.after(
                0,
                Ev::Deliver {
                    client,
                    req: id,
                    answer: Answer::Failed,
                },
            );
        }
        for w in 0..self.writes.len() {
            if self.writes[w].inc == inc && self.writes[w].gone_ms.is_none() {
                self.connection_gone(w);
            }
        }
    }

    /// The disk loses the last sectors of what the log's header claims as
    /// durable, or flips a bit in its last record: acknowledged records are
    /// lost, and the start must see it. (Damage past the claim, to a batch
    /// whose header has not reached the disk yet, cannot be told from a
    /// torn write by any start: it is out of the model, see
    /// docs/durability.md.)
    fn damage(&mut self) {
        // The page cache reaches the disk first (after a kill it would).
        self.log.sync();
        let Some(header) = Header::read(self.log.durable()) else {
            return;
        };
        let claimed = header.durable_len as usize;
        let first = fencegate_core::journal::record::HEADER_LEN + 48;
        if claimed < first || self.log.durable().len() < claimed {
            return;
        }
        self.stats.damaged_logs += 1;
        self.damaged = true;
        if self.rng.bool() || self.log.durable().len() > claimed {
            let at = self.rng.usize(claimed - 48..claimed);
            self.log.damage(at, true);
        } else {
            let at = self.rng.usize(claimed - 4..claimed);
            self.log.damage(at, false);
        }
    }

    /// Starts the proxy on what the disk holds: the core decides what the
    /// log is worth, the shell writes what it decides.
    fn start(&mut self) {
        self.incarnation += 1;
        let inc = self.incarnation;
        // A new process: it knows no key's state.
        let member = &mut self.members[0];
        member.generation += 1;
        member.key_states = Some(KeyStates::new(self.cfg.key_states));
        member.primacy_since_ms = self.now;
        let clock_offset_ms = self.rng.u64(0..1_000_000);
        let half = (self.cfg.tolerance_ms / 2) as i64;
        let wall_error_ms = self.rng.i64(-half..=half);
        let unsettled_ms = restart::unsettled_ms(self.cfg.upstream_timeout_ms, self.cfg.settle_ms);
        let bytes = self.log.bytes().to_vec();
        let found = recovery::Found {
            log: &bytes,
            log_missing: bytes.is_empty(),
            meta: MetaFile::read(self.meta_file.as_deref()),
        };
        let settings = recovery::OpenSettings {
            floor_block: FLOOR_BLOCK,
            ..recovery::OpenSettings::default()
        };
        let mut plan = match recovery::open_plan(found, settings) {
            Ok(plan) => plan,
            Err(why) => {
                self.fail(format!("the start refused the log: {why:?}"));
                return;
            }
        };
        // As the file journal: each step in order (the simulated disk has
        // no place for the damaged copy, which nothing reads).
        for step in std::mem::take(&mut plan.steps) {
            match step {
                recovery::OpenStep::WriteMeta(meta) => self.meta_file = Some(meta.encode()),
                recovery::OpenStep::WriteLog(image) => self.log.replace(image),
                recovery::OpenStep::CutLog(len) => {
                    self.log.set_len(len);
                    self.log.sync();
                }
                recovery::OpenStep::KeepDamagedCopy => {}
            }
        }
        let (header, len, meta) = (plan.header, plan.len, plan.meta());
        let recovered = plan.recovered;
        let rule = RestartRule {
            unsettled_ms,
            ..RestartRule::default()
        }
        .recovered(&recovered);
        let leases = recovered.leases;
        let lost = recovered.lost_records;
        // Each start gives the log a new identity, as the file journal
        // does: named in the meta file first, then carried by the log
        // (durably), then the old one dropped from the meta file.
        let lost = lost.or_else(|| self.loss_unchecked.take());
        let Some((header, len, meta)) = self.change_identity(header, len, meta) else {
            self.loss_unchecked = lost;
            self.inc_member.push(0);
            self.crash_at_start();
            return;
        };
        let now_ms = self.now + clock_offset_ms;
        let wall_ms = (WALL_BASE_MS + self.now).saturating_add_signed(wall_error_ms);
        self.inc_member.push(0);
        let mut proxy = Proxy {
            inc,
            clock_offset_ms,
            skew_ppm: 0,
            primacy: None,
            wall_error_ms,
            slots: BTreeMap::new(),
            unsettled_until_ms: rule.window_until_ms(now_ms),
            settling_until_ms: 0,
            rule,
            header,
            len,
            meta,
            queue: Vec::new(),
            writing: false,
            health: Health::Healthy,
        };
        let Some(endings) = self.restore_into(&mut proxy, &leases, now_ms, wall_ms) else {
            return;
        };
        if inc > 1 {
            self.check_start(&leases, &proxy, now_ms, wall_ms, lost.as_ref());
        }
        if lost.is_some() {
            self.stats.starts_after_loss += 1;
        }
        self.damaged = false;
        self.serve(proxy, endings);
        if inc > 1 {
            self.schedule_crash();
        }
    }

    /// What a start must keep of what was acknowledged, checked against the
    /// answers the clients got; and what the terms may do from here on.
    fn check_start(
        &mut self,
        records: &[LeaseRecord],
        proxy: &Proxy,
        now_ms: u64,
        wall_ms: u64,
        lost: Option<&recovery::Loss>,
    ) {
        let tol = self.cfg.tolerance_ms;
        if self.cfg.trace {
            for (lease, slot) in &proxy.slots {
                if let Some(t) = slot.lease.state().term() {
                    eprintln!(
                        "  start: l{lease} term {} live for {} ms more, released {}",
                        t.token,
                        t.deadline_ms.saturating_sub(now_ms),
                        t.released
                    );
                }
            }
            for r in records {
                eprintln!("  record: {r:?}");
            }
        }
        if let Some(why) = lost {
            if !self.damaged {
                self.fail(format!(
                    "a start after a crash or power cut, with no damage to the disk, found \
                     acknowledged records lost: {why}"
                ));
                return;
            }
        }
        // What the holders were promised survives the start, but where
        // the start may end a term early: lost records, a release that may
        // have reached the journal, a renewal whose hint may not have.
        let now = self.now;
        let skew = self.slack_skew_ppm();
        let mut ended_early = Vec::new();
        for (lease, truth) in self.truth.iter_mut().enumerate() {
            let newest = truth.max_acked;
            for (token, t) in truth.terms.iter_mut() {
                let hint_lost = t.hint_queued_step > t.hint_durable_step;
                // The new process owes no record: its slot holds the hint
                // the journal kept (and its wall clock may read earlier).
                t.hint_dropped = false;
                if lost.is_some() || t.release_issued || hint_lost {
                    t.may_end_early = true;
                }
                let slack = skew_slack_ms(t.ttl_ms, skew);
                if *token == newest
                    && t.acked
                    && !t.may_end_early
                    && now + slack < t.promised_until_ms
                {
                    let held = proxy
                        .slots
                        .get(&lease)
                        .and_then(|s| s.lease.state().term())
                        .is_some_and(|term| term.token == *token && term.is_live(now_ms));
                    if !held {
                        ended_early.push((lease, *token, t.promised_until_ms));
                    }
                }
            }
        }
        if let Some((lease, token, until)) = ended_early.first() {
            self.fail(format!(
                "lease l{lease} term {token}, promised until {until} ms, was not held after a \
                 start at {now} ms"
            ));
            return;
        }
        for (lease, truth) in self.truth.iter().enumerate() {
            let slot = proxy.slots.get(&lease);
            let last = slot.map_or_else(
                || restart::new_lease(&proxy.rule).0.last_token(),
                |s| s.lease.state().last_token(),
            );
            if last < truth.max_acked {
                let what = format!(
                    "lease l{lease} restarted with last token {last}, below the granted {}",
                    truth.max_acked
                );
                self.fail(what);
                return;
            }
            let current = slot.and_then(|s| s.lease.state().term());
            if let (Some(term), Some(t)) = (current, truth.terms.get(&truth.max_acked)) {
                if term.token == truth.max_acked && t.release_acked && !term.released {
                    let what = format!(
                        "lease l{lease} term {} was released with an answer, and a start \
                         brought it back",
                        term.token
                    );
                    self.fail(what);
                    return;
                }
            }
            if lost.is_some() {
                if let Some(term) = current.filter(|t| t.is_live(now_ms)) {
                    let what = format!(
                        "lease l{lease} term {} held after a start that lost records",
                        term.token
                    );
                    self.fail(what);
                    return;
                }
            }
        }
        if lost.is_none() {
            // A recovered term that may still be live (by its hint) is held,
            // for at most its TTL.
            for record in records {
                let Some(t) = record.term.as_ref().filter(|t| !t.released) else {
                    continue;
                };
                let lease = lease_index(&record.lease).expect("checked at the start");
                let may_live =
                    t.wall_deadline_ms == 0 || t.wall_deadline_ms + t.ttl_ms / 2 + tol > wall_ms;
                let Some(term) = proxy.slots.get(&lease).and_then(|s| s.lease.state().term())
                else {
                    continue;
                };
                if may_live && !term.is_live(now_ms) {
                    let what = format!(
                        "lease l{lease} term {} may still be live, and the start ended it",
                        t.token
                    );
                    self.fail(what);
                    return;
                }
                if term.is_live(now_ms) && term.deadline_ms > now_ms + t.ttl_ms {
                    let what = format!(
                        "lease l{lease} term {} held for more than its TTL after a start",
                        t.token
                    );
                    self.fail(what);
                    return;
                }
            }
        }
        // From here on, a term that may have been live shortly before the
        // start may be held again for up to a TTL (on the new clock).
        let skew_ppm = proxy.skew_ppm;
        for truth in &mut self.truth {
            for t in truth.terms.values_mut() {
                if !t.release_acked && t.live_until_ms + t.ttl_ms / 2 + 2 * tol > self.now {
                    let held = global_ms(t.ttl_ms, skew_ppm);
                    t.live_until_ms = t.live_until_ms.max(self.now + held);
                }
            }
        }
    }
}

impl World {
    /// Restores the recovered leases into `proxy` with the core's restart
    /// rule; the releases to record once serving (terms a hint ended).
    fn restore_into(
        &mut self,
        proxy: &mut Proxy,
        records: &[LeaseRecord],
        now_ms: u64,
        wall_ms: u64,
    ) -> Option<Vec<restart::Ending>> {
        let tolerance_ms = self.cfg.tolerance_ms;
        let restored =
            restart::restore_all(records.to_vec(), &proxy.rule, now_ms, wall_ms, tolerance_ms);
        let restart::Restoration { leases, endings } = match restored {
            Ok(r) => r,
            Err(why) => {
                self.fail(format!("the start refused a lease: {why}"));
                return None;
            }
        };
        for restored in leases {
            let Some(lease) = lease_index(restored.name.as_str()) else {
                self.fail(format!(
                    "a lease the simulation never named: {}",
                    restored.name.as_str()
                ));
                return None;
            };
            proxy
                .slots
                .insert(lease, Slot::new(slot::Slot::from(restored)));
        }
        Some(endings)
    }

    /// `proxy` serves from now on; a term its hint ended is recorded as
    /// ended.
    fn serve(&mut self, proxy: Proxy, endings: Vec<restart::Ending>) {
        let inc = proxy.inc;
        self.proxy = Some(proxy);
        let every = self.rng.u64(20..=200);
        self.after(every, Ev::Sweep(inc));
        for ending in endings {
            let record = Record::Release {
                lease: ending.lease.as_str().to_owned(),
                token: ending.token,
                quiet: ending.quiet(),
            };
            self.queue(record, Ack::Durable);
        }
    }

    // -- cluster mode: members, their etcd sessions, the election ----------

    /// Self-fencing: a primary admits nothing once etcd could have let its
    /// election lease go (and another member win).
    fn check_primacy(&mut self, what: &str) {
        let Some(primacy) = self.proxy.as_ref().and_then(|p| p.primacy) else {
            return;
        };
        let (member, expires, _) = self.etcd.sessions[&primacy.session];
        if self.now >= expires {
            self.fail(format!(
                "member {member} admitted {what} at {} ms, but etcd could let its election \
                 lease go at {expires} ms",
                self.now
            ));
        }
    }

    fn member_ms(&self, m: usize) -> u64 {
        let member = &self.members[m];
        local_ms(member.clock_offset_ms, member.skew_ppm, self.now)
    }

    fn member_ttl_ms(&self) -> u64 {
        self.cfg.member_ttl_s * 1000
    }

    fn send_etcd(&mut self, member: usize, op: EtcdOp) {
        if self.members[member].cut_off_until > self.now {
            // Lost on the way. A commit's waiters learn it as a failure
            // (the member's etcd client times out); a session is asked
            // for again.
            let generation = self.members[member].generation;
            if matches!(op, EtcdOp::Grant) {
                let again = cluster::beat_ms(self.member_ttl_ms());
                self.after(again, Ev::Regrant { member, generation });
            }
            if let EtcdOp::Commit { inc, batch, .. } = op {
                let timeout = self.cfg.upstream_timeout_ms;
                let reply = EtcdReply::Committed {
                    inc,
                    batch,
                    ok: false,
                };
                self.after(
                    timeout,
                    Ev::FromEtcd {
                        member,
                        generation,
                        sent_ms: 0,
                        reply,
                    },
                );
            }
            return;
        }
        let generation = self.members[member].generation;
        let sent_ms = self.member_ms(member);
        let delay = self.net();
        self.after(
            delay,
            Ev::AtEtcd {
                member,
                generation,
                sent_ms,
                op,
            },
        );
    }

    /// A member's process starts: a new session, then it polls and beats.
    fn member_start(&mut self, m: usize) {
        let clock_offset_ms = self.rng.u64(0..1_000_000);
        let member = &mut self.members[m];
        member.alive = true;
        member.stopping = false;
        member.generation += 1;
        member.clock_offset_ms = clock_offset_ms;
        member.session = None;
        member.key_states = Some(KeyStates::new(self.cfg.key_states));
        self.send_etcd(m, EtcdOp::Grant);
        let mean = self.cfg.crash_every_ms.max(2) * self.members.len() as u64;
        let at = self.rng.u64(1..2 * mean);
        self.after(at, Ev::Crash(m));
    }

    /// A member's process dies: whatever it served is gone; etcd lets its
    /// session go a TTL after the last keepalive.
    fn member_crash(&mut self, m: usize) {
        if !self.members[m].alive {
            return;
        }
        self.stats.crashes += 1;
        self.member_exit(m);
    }

    /// A member's process is gone (crashed or stopped); it starts again a
    /// while later.
    fn member_exit(&mut self, m: usize) {
        if let Some(proxy) = self.proxy.take() {
            self.abandon(proxy.inc);
        }
        let member = &mut self.members[m];
        member.alive = false;
        member.generation += 1;
        member.session = None;
        let down = self.rng.u64(1..=3_000);
        self.after(down, Ev::MemberStart(m));
    }

    /// A member's process is stopped (SIGTERM). Serving, it stops
    /// admitting and waits for its writes, as the shell's `lead` and
    /// `drain` do; otherwise it gives its session back and exits.
    fn member_stop(&mut self, m: usize) {
        if !self.members[m].alive {
            return;
        }
        self.stats.stops += 1;
        let Some(session) = self.members[m].session.map(|s| s.id) else {
            return self.member_exit(m);
        };
        if !self.serving(session) {
            self.send_etcd(
                m,
                EtcdOp::Resign {
                    session,
                    clean: false,
                },
            );
            return self.member_exit(m);
        }
        if let Some(p) = self.proxy.as_mut().and_then(|p| p.primacy.as_mut()) {
            p.revoked = true;
        }
        // No more keepalives: the session lives on until its TTL at most;
        // and no new one (a refused commit meanwhile does not start one).
        self.members[m].session = None;
        self.members[m].stopping = true;
        let generation = self.members[m].generation;
        let bound_ms = self.member_ms(m) + DRAIN_MS;
        self.drain(m, generation, session, bound_ms);
    }

    /// A stopping primary's wait for its writes (the shell's `drain`, every
    /// 10 ms up to `DRAIN_MS`): once the core's rule says they are done,
    /// the handover is recorded as clean; either way the session is given
    /// back and the process exits.
    fn drain(&mut self, m: usize, generation: u64, session: u64, bound_ms: u64) {
        let member = &self.members[m];
        if !member.alive || member.generation != generation {
            return;
        }
        let now_ms = self.member_ms(m);
        let Some(proxy) = self.proxy.as_mut() else {
            return self.member_exit(m);
        };
        let in_flight: u64 = proxy.slots.values().map(|s| s.inflight.len()).sum();
        let clean = fencegate_core::cluster::handover_drained(
            in_flight,
            now_ms,
            proxy.settling_until_ms,
            proxy.unsettled_until_ms,
        );
        if !clean && now_ms < bound_ms {
            self.after(
                10,
                Ev::Drain {
                    member: m,
                    generation,
                    session,
                    bound_ms,
                },
            );
            return;
        }
        self.stats.clean_handovers += u64::from(clean);
        self.send_etcd(m, EtcdOp::Resign { session, clean });
        self.member_exit(m);
    }

    fn schedule_pause(&mut self, m: usize) {
        let at = self.rng.u64(1..2 * self.cfg.pause_every_ms.max(2));
        self.after(at, Ev::Pause(m));
    }

    /// SIGSTOP: the member does nothing until it wakes; its clock runs on.
    /// Or it is cut off from etcd while clients still reach it.
    fn pause(&mut self, m: usize) {
        if self.members[m].alive {
            let span = self.rng.u64(0..=2 * self.member_ttl_ms());
            let until = self.now + span;
            let member = &mut self.members[m];
            if self.rng.bool() {
                self.stats.pauses += 1;
                member.paused_until = member.paused_until.max(until);
            } else {
                self.stats.partitions += 1;
                member.cut_off_until = member.cut_off_until.max(until);
            }
        }
        self.schedule_pause(m);
    }

    /// Whether `session` is the member's current one (each session has
    /// one chain of beats and one of polls; they end with it).
    fn current_session(&self, m: usize, session: u64) -> bool {
        self.members[m].alive && self.members[m].session.is_some_and(|s| s.id == session)
    }

    /// Whether the member serves as primary in `session`.
    fn serving(&self, session: u64) -> bool {
        self.proxy
            .as_ref()
            .and_then(|p| p.primacy)
            .is_some_and(|p| p.session == session && !p.revoked)
    }

    fn beat(&mut self, m: usize, session: u64) {
        if !self.current_session(m, session) {
            return;
        }
        // As the shell's elector: a primary that could not confirm its
        // primacy in time (its deadline passed on its own clock) steps
        // down, rather than waiting for etcd to say its session is gone.
        if self.serving(session) && !self.primary_now() {
            self.step_down(m);
            return;
        }
        self.send_etcd(m, EtcdOp::KeepAlive(session));
        let beat = cluster::beat_ms(self.member_ttl_ms());
        self.after(beat, Ev::Beat { member: m, session });
    }

    fn poll(&mut self, m: usize, session: u64) {
        if !self.current_session(m, session) {
            return;
        }
        if !self.serving(session) {
            self.send_etcd(m, EtcdOp::Campaign(session));
        }
        let poll = cluster::poll_ms(self.member_ttl_ms());
        self.after(poll, Ev::Poll { member: m, session });
    }

    /// etcd lets sessions go at their expiry (and the election with them).
    fn etcd_expire(&mut self) {
        let now = self.now;
        for (id, (_, expires, gone)) in self.etcd.sessions.iter_mut() {
            if !*gone && *expires <= now {
                *gone = true;
                if self.etcd.leader == Some(*id) {
                    self.etcd.leader = None;
                }
            }
        }
    }

    fn at_etcd(&mut self, member: usize, generation: u64, sent_ms: u64, op: EtcdOp) {
        self.etcd_expire();
        let ttl_ms = self.member_ttl_ms();
        let live = |etcd: &Etcd, id: u64| etcd.sessions.get(&id).is_some_and(|s| !s.2);
        let reply = match op {
            EtcdOp::Grant => {
                self.etcd.next_id += 1;
                let id = self.etcd.next_id;
                self.etcd
                    .sessions
                    .insert(id, (member, self.now + ttl_ms, false));
                EtcdReply::Granted { session: id }
            }
            EtcdOp::KeepAlive(id) if live(&self.etcd, id) => {
                let now = self.now;
                if let Some(s) = self.etcd.sessions.get_mut(&id) {
                    s.1 = now + ttl_ms;
                }
                EtcdReply::KeptAlive { session: id }
            }
            EtcdOp::KeepAlive(id) => EtcdReply::Gone { session: id },
            EtcdOp::Campaign(id) if !live(&self.etcd, id) => EtcdReply::Gone { session: id },
            EtcdOp::Campaign(id) => {
                let etcd = &mut self.etcd;
                if etcd.leader.is_none() {
                    // The winner reads the records of the election before
                    // and records its own (the shell's `record_election`).
                    etcd.leader = Some(id);
                    let bytes = |e: Option<u64>| e.map(u64::to_be_bytes);
                    let (elected, handed_over) = (bytes(etcd.elected), bytes(etcd.handed_over));
                    etcd.won_clean = fencegate_core::cluster::takeover_clean(
                        elected.as_ref().map(|b| &b[..]),
                        handed_over.as_ref().map(|b| &b[..]),
                    );
                    etcd.elected = Some(id);
                }
                if etcd.leader == Some(id) {
                    EtcdReply::Won {
                        session: id,
                        clean: etcd.won_clean,
                    }
                } else {
                    EtcdReply::Lost
                }
            }
            EtcdOp::Resign { session, clean } => {
                let etcd = &mut self.etcd;
                if etcd.leader == Some(session) && live(etcd, session) {
                    if clean {
                        etcd.handed_over = etcd.elected;
                    }
                    etcd.leader = None;
                }
                if let Some(s) = etcd.sessions.get_mut(&session) {
                    s.2 = true;
                }
                return;
            }
            EtcdOp::Commit {
                session,
                inc,
                batch,
            } => {
                let ok = self.etcd.leader == Some(session) && live(&self.etcd, session);
                if ok {
                    self.etcd_apply(&batch);
                    self.hints_durable(&batch);
                }
                EtcdReply::Committed { inc, batch, ok }
            }
        };
        if self.members[member].cut_off_until > self.now {
            // The answer is lost; a commit's waiters time out; a session is
            // asked for again.
            if let EtcdReply::Granted { .. } = reply {
                let again = cluster::beat_ms(self.member_ttl_ms());
                self.after(again, Ev::Regrant { member, generation });
            }
            if let EtcdReply::Committed { inc, batch, ok: _ } = reply {
                let reply = EtcdReply::Committed {
                    inc,
                    batch,
                    ok: false,
                };
                let timeout = self.cfg.upstream_timeout_ms;
                self.after(
                    timeout,
                    Ev::FromEtcd {
                        member,
                        generation,
                        sent_ms,
                        reply,
                    },
                );
            }
            return;
        }
        let delay = self.net();
        self.after(
            delay,
            Ev::FromEtcd {
                member,
                generation,
                sent_ms,
                reply,
            },
        );
    }

    fn etcd_answered(&mut self, m: usize, generation: u64, sent_ms: u64, reply: EtcdReply) {
        if self.members[m].generation != generation || !self.members[m].alive {
            return;
        }
        let margin_ms = self.cfg.margin_ms;
        let ttl_s = self.cfg.member_ttl_s as i64;
        let current = self.members[m].session.map(|s| s.id);
        match reply {
            EtcdReply::Granted { session } => {
                self.members[m].session = Some(Session {
                    id: session,
                    sent_ms,
                });
                self.after(0, Ev::Poll { member: m, session });
                let beat = cluster::beat_ms(self.member_ttl_ms());
                self.after(beat, Ev::Beat { member: m, session });
            }
            EtcdReply::KeptAlive { session } if current == Some(session) => {
                // As the shell's elector: the renewed session is the one
                // this answer confirmed.
                if let Some(s) = self.members[m].session.as_mut() {
                    s.sent_ms = sent_ms;
                }
                let until = fencegate_core::cluster::primacy_deadline(sent_ms, ttl_s, margin_ms);
                if let Some(p) = self.proxy.as_mut().and_then(|p| p.primacy.as_mut()) {
                    if p.session == session {
                        p.until_ms = cluster::primacy_confirmed(p.until_ms, until);
                    }
                }
            }
            EtcdReply::Gone { session } if current == Some(session) => self.step_down(m),
            EtcdReply::Won { session, clean }
                if current == Some(session) && !self.serving(session) =>
            {
                let confirmed = self.members[m].session.map_or(0, |s| s.sent_ms);
                self.take_over(m, session, confirmed, clean);
            }
            EtcdReply::Committed { inc, batch, ok }
                if self.proxy.as_ref().is_some_and(|p| p.inc == inc) =>
            {
                self.batch_done(batch, ok);
                if !ok {
                    self.step_down(m);
                }
            }
            _ => {}
        }
    }

    /// A committed batch changes etcd's lease state with the etcd journal's
    /// rules.
    fn etcd_apply(&mut self, batch: &[Queued]) {
        for q in batch {
            // As the etcd journal: the lease's state, changed, written if
            // the change changed it.
            let lease = match &q.record {
                Record::Forget { lease, .. } => lease.as_str(),
                record => match record.lease() {
                    Some(lease) => lease,
                    None => continue,
                },
            };
            let mut state = self.etcd.state.lease(lease);
            if state.record(&q.record) {
                self.etcd.state.apply(lease.to_owned(), state);
            }
        }
    }

    /// Primacy is lost (or the session is): nothing more is admitted
    /// (writes in flight finish), and, as the member does, the old session
    /// is given back and a new one starts from what etcd holds.
    fn step_down(&mut self, m: usize) {
        if self.members[m].stopping {
            return;
        }
        if let Some(p) = self.proxy.as_mut().and_then(|p| p.primacy.as_mut()) {
            if !p.revoked {
                p.revoked = true;
                self.stats.step_downs += 1;
            }
        }
        // The session is given back (the shell's `in_session` revokes its
        // etcd lease, best effort): its election key goes at once, not at
        // the TTL's end.
        if let Some(old) = self.members[m].session.take() {
            let resign = EtcdOp::Resign {
                session: old.id,
                clean: false,
            };
            self.send_etcd(m, resign);
        }
        self.send_etcd(m, EtcdOp::Grant);
    }

    /// Member `m` won the election with `session`, last confirmed by a
    /// message it sent at `confirmed_ms`: it loads the lease state from
    /// etcd and serves it under the restart rule (ids as digests, terms
    /// held, the takeover window for the writes of the previous primary).
    fn take_over(&mut self, m: usize, session: u64, confirmed_ms: u64, clean: bool) {
        if let Some(old) = self.proxy.take() {
            self.abandon(old.inc);
        }
        self.stats.takeovers += 1;
        self.stats.clean_takeovers += u64::from(clean);
        // What the member loads: every lease etcd holds, as the etcd
        // journal's records (ids as digests).
        let records = self.etcd.state.records();
        self.incarnation += 1;
        let inc = self.incarnation;
        self.inc_member.push(m);
        // The process's key states outlive its terms of primacy; each
        // begins knowing none (the core's rule, as the shell calls it).
        if let Some(states) = self.members[m].key_states.as_mut() {
            states.take_over();
        }
        self.members[m].primacy_since_ms = self.now;
        let half = (self.cfg.tolerance_ms / 2) as i64;
        let wall_error_ms = self.rng.i64(-half..=half);
        let member = &self.members[m];
        let (clock_offset_ms, skew_ppm) = (member.clock_offset_ms, member.skew_ppm);
        let now_ms = self.member_ms(m);
        let wall_ms = (WALL_BASE_MS + self.now).saturating_add_signed(wall_error_ms);
        let rule = fencegate_core::cluster::takeover_rule(
            clean,
            restart::unsettled_ms(self.cfg.upstream_timeout_ms, self.cfg.settle_ms),
            self.etcd.state.forgotten_above(),
        );
        let until_ms = fencegate_core::cluster::primacy_deadline(
            confirmed_ms,
            self.cfg.member_ttl_s as i64,
            self.cfg.margin_ms,
        );
        let mut proxy = Proxy {
            inc,
            clock_offset_ms,
            skew_ppm,
            primacy: Some(Primacy {
                session,
                until_ms,
                revoked: false,
            }),
            wall_error_ms,
            slots: BTreeMap::new(),
            unsettled_until_ms: rule.window_until_ms(now_ms),
            settling_until_ms: 0,
            rule,
            header: Header {
                seq: 0,
                durable_len: 0,
                compacted_len: 0,
                token_floor: 0,
            },
            len: 0,
            meta: Meta::default(),
            queue: Vec::new(),
            writing: false,
            health: Health::Healthy,
        };
        let Some(endings) = self.restore_into(&mut proxy, &records, now_ms, wall_ms) else {
            return;
        };
        self.check_start(&records, &proxy, now_ms, wall_ms, None);
        self.serve(proxy, endings);
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
