//! The simulated world: clients, the proxy around the real core, its
//! journal on a disk that loses what was not synced, a slow backend, and
//! the checker. One event at a time, in time order; ties in the order they
//! were scheduled; every random choice from one seeded generator.

use std::collections::BTreeMap;

use fencegate_core::journal::append::{self, Step};
use fencegate_core::journal::record::{Header, LeaseRecord, Record};
use fencegate_core::journal::recovery::{self, Meta, MetaFile};
use fencegate_core::lease::admission::{self, Decision, WriteCheck};
use fencegate_core::lease::id::LeaseId;
use fencegate_core::lease::inflight::Inflight;
use fencegate_core::lease::machine::{AcquireRefused, LeaseState, Term};
use fencegate_core::lease::restart::{self, RestartRule};

use crate::disk::File;

/// The wall clock's Unix time at the simulation's start.
const WALL_BASE_MS: u64 = 1_800_000_000_000;
/// Tokens reserved at a time in the meta file (the proxy's default).
const FLOOR_BLOCK: u64 = 4096;

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
    /// Of the writes, how many in a thousand the backend applies after the
    /// documented bound (left out of the order check).
    pub rogue_per_mille: u32,
}

impl Config {
    pub fn new(seed: u64, steps: u64) -> Self {
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
            rogue_per_mille: 5,
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
    pub power_cuts: u64,
    pub torn_writes: u64,
    pub damaged_logs: u64,
    pub failed_syncs: u64,
    pub starts_after_loss: u64,
    pub held_refusals: u64,
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
    Acquire { ttl_ms: u64 },
    Renew,
    Release,
    Write { first_try_ms: Option<u64> },
}

#[derive(Clone, Debug)]
struct Req {
    id: u64,
    client: usize,
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
    Synced {
        inc: u64,
        rest: Vec<Step>,
        batch: Vec<Queued>,
        len_before: u64,
    },
    Apply(usize),
    Answered(usize),
    BodyDone(usize),
    Timeout(usize),
    Crash,
    Restart,
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
}

impl Client {
    fn local_ms(&self, now: u64) -> u64 {
        let skewed = now as i128 * (1_000_000 + self.skew_ppm as i128) / 1_000_000;
        self.offset_ms + skewed as u64
    }

    /// When, on the simulated clock, this client's clock reads `local`.
    fn global_ms(&self, local: u64) -> u64 {
        let l = local.saturating_sub(self.offset_ms) as i128;
        (l * 1_000_000 / (1_000_000 + self.skew_ppm as i128)) as u64
    }
}

// ---------------------------------------------------------------------------
// The proxy: a thin shell around the core, as the lease store is.

#[derive(Debug)]
struct Slot {
    state: LeaseState,
    inflight: Inflight,
    unsettled_from: u64,
    wall_deadline_ms: u64,
}

#[derive(Debug)]
enum Ack {
    Grant {
        req: Req,
        token: u64,
        previous: Option<Term>,
    },
    Release {
        req: Req,
    },
    None,
}

#[derive(Debug)]
struct Queued {
    record: Record,
    ack: Ack,
}

#[derive(Debug)]
struct Proxy {
    inc: u64,
    /// The proxy's monotonic clock reads `now + clock_offset_ms`.
    clock_offset_ms: u64,
    /// Its wall clock's error.
    wall_error_ms: i64,
    slots: BTreeMap<usize, Slot>,
    unsettled_until_ms: u64,
    rule: RestartRule,
    header: Header,
    len: u64,
    meta: Meta,
    queue: Vec<Queued>,
    writing: bool,
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
}

// ---------------------------------------------------------------------------
// What the checker knows: the truth of every term, from the answers.

#[derive(Debug)]
struct TermTruth {
    ttl_ms: u64,
    /// No later than this (simulated time) may the term still be live.
    live_until_ms: u64,
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
    stats: Stats,
    violation: Option<Violation>,
}

impl World {
    fn new(cfg: Config) -> Self {
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
            })
            .collect();
        let mut world = Self {
            truth: (0..cfg.leases).map(|_| LeaseTruth::default()).collect(),
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
            stats: Stats::default(),
            violation: None,
        };
        world.start();
        for c in 0..world.clients.len() {
            let at = world.rng.u64(0..50);
            world.at(at, Ev::Wake(c));
        }
        world.schedule_crash();
        world
    }

    fn play(&mut self) {
        while self.step < self.cfg.steps && self.violation.is_none() {
            let Some(((at, _), ev)) = self.events.pop_first() else {
                break;
            };
            self.now = at;
            self.step += 1;
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

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Wake(c) => self.wake(c),
            Ev::Arrive(req) => self.arrive(req),
            Ev::Deliver {
                client,
                req,
                answer,
            } => self.deliver(client, req, answer),
            Ev::Retry { inc, req } => {
                if self.open.get(&req.id).is_some_and(|(_, i)| *i == inc) {
                    self.write(req)
                }
            }
            Ev::Flush(inc) => self.flush(inc),
            Ev::Synced {
                inc,
                rest,
                batch,
                len_before,
            } => self.synced(inc, rest, batch, len_before),
            Ev::Apply(w) => self.apply(w),
            Ev::Answered(w) => self.answered(w),
            Ev::BodyDone(w) => self.body_done(w),
            Ev::Timeout(w) => self.timeout(w),
            Ev::Crash => self.crash(),
            Ev::Restart => self.start(),
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
                    let op = Op::Write { first_try_ms: None };
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
                        let op = Op::Write { first_try_ms: None };
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
                        let op = Op::Write { first_try_ms: None };
                        self.send(c, lease, token, lease_id, op, Some(at));
                    }
                    _ => {
                        let op = Op::Write { first_try_ms: None };
                        self.send(c, lease, token, lease_id, op, None);
                    }
                }
                self.after(next, Ev::Wake(c));
            }
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
            (
                Answer::Renewed { expires_in_ms },
                Hold::Holding {
                    lease,
                    token,
                    lease_id,
                    ttl_ms,
                    ..
                },
            ) => {
                self.clients[c].hold = Hold::Holding {
                    lease,
                    token,
                    lease_id,
                    end_local_ms: local + expires_in_ms,
                    ttl_ms,
                };
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
            .map_or(0, |p| self.now + p.clock_offset_ms)
    }

    fn wall_ms(&self) -> u64 {
        let error = self.proxy.as_ref().map_or(0, |p| p.wall_error_ms);
        (WALL_BASE_MS + self.now).saturating_add_signed(error)
    }

    fn arrive(&mut self, req: Req) {
        let Some(inc) = self.proxy.as_ref().map(|p| p.inc) else {
            // Connection refused.
            self.reply(&req, Answer::Failed);
            return;
        };
        self.open.insert(req.id, (req.client, inc));
        match req.op {
            Op::Acquire { ttl_ms } => self.acquire(req, ttl_ms),
            Op::Renew => self.renew(req),
            Op::Release => self.release(req),
            Op::Write { .. } => self.write(req),
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
        let slot = proxy.slots.entry(req.lease).or_insert_with(|| {
            let (state, unsettled_from) = restart::new_lease(&rule);
            Slot {
                state,
                inflight: Inflight::default(),
                unsettled_from,
                wall_deadline_ms: 0,
            }
        });
        let previous = slot.state.term().cloned();
        let lease_id = LeaseId::from_bytes(raw);
        match slot.state.acquire(p, &holder, ttl_ms, lease_id.clone()) {
            Ok(grant) => {
                let quiet = admission::quiet_below(
                    Some(&mut slot.inflight),
                    slot.unsettled_from,
                    proxy.unsettled_until_ms,
                    grant.token,
                    p,
                );
                slot.wall_deadline_ms = wall + ttl_ms;
                let record = Record::Grant {
                    lease: lease_name(req.lease),
                    token: grant.token,
                    holder,
                    ttl_ms,
                    lease_id: lease_id.to_text(),
                    quiet,
                    wall_ms: wall,
                };
                let token = grant.token;
                self.truth[req.lease].terms.insert(
                    token,
                    TermTruth {
                        ttl_ms,
                        live_until_ms: self.now + ttl_ms,
                        acked: false,
                        release_acked: false,
                        release_issued: false,
                    },
                );
                let ack = Ack::Grant {
                    req,
                    token,
                    previous,
                };
                self.queue(record, ack);
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
        match slot
            .state
            .renew(p, req.token, Some(&req.lease_id), None, None)
        {
            Ok(grant) => {
                let due = restart::wall_hint_due(slot.wall_deadline_ms, wall, grant.ttl_ms);
                if due {
                    slot.wall_deadline_ms = wall + grant.ttl_ms;
                }
                let expires_in_ms = grant.deadline_ms - p;
                self.stats.renewals += 1;
                if let Some(why) = self.truth[req.lease].ended(req.token, self.now) {
                    self.fail(format!(
                        "lease l{} term {} renewed, but it {why}",
                        req.lease, req.token
                    ));
                }
                if let Some(t) = self.truth[req.lease].terms.get_mut(&req.token) {
                    t.live_until_ms = t.live_until_ms.max(self.now + expires_in_ms);
                }
                if due {
                    let record = Record::Renew {
                        lease: lease_name(req.lease),
                        token: req.token,
                        ttl_ms: grant.ttl_ms,
                        wall_ms: wall,
                    };
                    self.queue(record, Ack::None);
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
        match slot.state.release(p, req.token, Some(&req.lease_id), None) {
            Ok(()) => {
                let quiet = admission::quiet_below(
                    Some(&mut slot.inflight),
                    slot.unsettled_from,
                    proxy.unsettled_until_ms,
                    req.token + 1,
                    p,
                );
                if let Some(t) = self.truth[req.lease].terms.get_mut(&req.token) {
                    t.release_issued = true;
                }
                let record = Record::Release {
                    lease: lease_name(req.lease),
                    token: req.token,
                    quiet,
                };
                self.queue(record, Ack::Release { req });
            }
            Err(_) => self.reply(&req, Answer::Refused),
        }
    }

    fn write(&mut self, req: Req) {
        let first_try_ms = match req.op {
            Op::Write { first_try_ms } => first_try_ms,
            _ => None,
        };
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
        let decision = admission::decide(
            &slot.state,
            &mut slot.inflight,
            slot.unsettled_from,
            proxy.unsettled_until_ms,
            p,
            check,
        );
        match decision {
            Decision::Admit(_) => {
                slot.inflight.add(req.token);
                self.stats.writes_admitted += 1;
                if let Some(why) = self.truth[req.lease].ended(req.token, self.now) {
                    self.fail(format!(
                        "lease l{} term {} had a write admitted, but it {why}",
                        req.lease, req.token
                    ));
                }
                self.forward(req, inc);
            }
            Decision::Wait { until_ms, .. } => {
                let first = first_try_ms.unwrap_or(self.now);
                if first_try_ms.is_none() {
                    self.stats.barrier_waits += 1;
                }
                if self.now >= first + max_wait_ms {
                    // The earlier term's writes did not finish in time: 503.
                    self.reply(&req, Answer::Failed);
                    return;
                }
                // Woken when the clock alone ends the wait, or looked at
                // again a moment later (a write finishing would wake it).
                let retry = until_ms
                    .map_or(u64::MAX, |u| u.saturating_sub(p))
                    .clamp(1, 3);
                let req = Req {
                    op: Op::Write {
                        first_try_ms: Some(first),
                    },
                    ..req
                };
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
    fn forward(&mut self, req: Req, inc: u64) {
        let timeout = self.cfg.upstream_timeout_ms;
        let settle = self.cfg.settle_ms;
        let latency = if self.rng.u32(0..10) < 8 {
            self.rng.u64(0..=10)
        } else {
            self.rng.u64(0..=2 * timeout)
        };
        let rogue = self.chance(self.cfg.rogue_per_mille);
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
        let settle = self.cfg.settle_ms;
        let write = &mut self.writes[w];
        if write.gone_ms.is_some() {
            return;
        }
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
        let write = &mut self.writes[w];
        write.applied = true;
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

    fn live_write(&self, w: usize) -> bool {
        let write = &self.writes[w];
        self.proxy.as_ref().is_some_and(|p| p.inc == write.inc) && write.gone_ms.is_none()
    }

    fn answered(&mut self, w: usize) {
        if !self.live_write(w) {
            return;
        }
        let p = self.proxy_now();
        let settle = self.cfg.settle_ms;
        let (lease, token) = (self.writes[w].lease, self.writes[w].token);
        if let Some(slot) = self.proxy.as_mut().and_then(|px| px.slots.get_mut(&lease)) {
            slot.inflight.answered(token, p + settle);
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
        let (lease, token, client, req) = (write.lease, write.token, write.client, write.req);
        if let Some(slot) = self.proxy.as_mut().and_then(|px| px.slots.get_mut(&lease)) {
            slot.inflight.remove(token, true, 0);
        }
        self.reply_to(client, req, Answer::Written);
    }

    fn timeout(&mut self, w: usize) {
        if !self.live_write(w) {
            return;
        }
        let p = self.proxy_now();
        let settle = self.cfg.settle_ms;
        let (lease, token, client, req) = {
            let write = &self.writes[w];
            (write.lease, write.token, write.client, write.req)
        };
        if let Some(slot) = self.proxy.as_mut().and_then(|px| px.slots.get_mut(&lease)) {
            slot.inflight.remove(token, false, p + settle);
        }
        self.connection_gone(w);
        self.reply_to(client, req, Answer::Failed);
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

    fn queue(&mut self, record: Record, ack: Ack) {
        let proxy = self.proxy.as_mut().expect("only a running proxy queues");
        proxy.queue.push(Queued { record, ack });
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
        let mut max_token = 0;
        for q in &batch {
            q.record.encode_frame(&mut buf);
            if let Record::Grant { token, .. } = q.record {
                max_token = max_token.max(token);
            }
        }
        // As the file journal: grants and releases are durable before
        // their answer, and renewals carry wall-clock hints, synced too.
        let sync = batch.iter().any(|q| {
            !matches!(q.ack, Ack::None)
                || matches!(q.record, Record::Renew { .. } | Record::Release { .. })
        });
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
            proxy.len = len_before;
            self.log.set_len(len_before);
            self.batch_done(batch, false);
            return;
        }
        self.log.sync();
        let proxy = self.proxy.as_mut().expect("checked");
        for step in rest {
            if let Step::WriteHeader(header) = step {
                self.log.write(header.offset(), &header.encode());
                proxy.header = header;
            }
        }
        self.batch_done(batch, true);
    }

    /// Answers what waited for a batch; the writer takes the next one.
    fn batch_done(&mut self, batch: Vec<Queued>, ok: bool) {
        for q in batch {
            match q.ack {
                Ack::Grant {
                    req,
                    token,
                    previous,
                } => self.grant_done(req, token, previous, ok),
                Ack::Release { req } => {
                    if ok {
                        self.stats.releases += 1;
                        if let Some(t) = self.truth[req.lease].terms.get_mut(&req.token) {
                            t.release_acked = true;
                        }
                        self.reply(&req, Answer::Released);
                    } else {
                        self.reply(&req, Answer::Failed);
                    }
                }
                Ack::None => {}
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

    fn grant_done(&mut self, req: Req, token: u64, previous: Option<Term>, ok: bool) {
        let p = self.proxy_now();
        let proxy = self.proxy.as_mut().expect("checked");
        let slot = proxy.slots.get_mut(&req.lease).expect("granted here");
        if !ok {
            slot.state.abandon(token, previous);
            self.reply(&req, Answer::Failed);
            return;
        }
        let Some(term) = slot.state.term().filter(|t| t.token == token) else {
            self.fail(format!(
                "lease l{} term {token} vanished before its answer",
                req.lease
            ));
            return;
        };
        let lease_id = term.lease_id.to_text();
        let expires_in_ms = term.deadline_ms.saturating_sub(p);
        self.stats.grants += 1;
        let max = self.truth[req.lease].max_acked;
        if token <= max {
            self.fail(format!(
                "lease l{} granted token {token} after token {max} was granted",
                req.lease
            ));
        }
        let truth = &mut self.truth[req.lease];
        truth.max_acked = truth.max_acked.max(token);
        if let Some(t) = truth.terms.get_mut(&token) {
            t.acked = true;
            t.live_until_ms = t.live_until_ms.max(self.now + expires_in_ms);
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
        self.after(at, Ev::Crash);
    }

    fn crash(&mut self) {
        let Some(proxy) = self.proxy.take() else {
            return;
        };
        self.stats.crashes += 1;
        // Every request the proxy held is lost with it.
        let lost: Vec<(u64, usize)> = self
            .open
            .iter()
            .filter(|(_, (_, inc))| *inc == proxy.inc)
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
            if self.writes[w].inc == proxy.inc && self.writes[w].gone_ms.is_none() {
                self.connection_gone(w);
            }
        }
        if self.chance(self.cfg.power_cuts_per_mille) {
            self.stats.power_cuts += 1;
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
        if self.chance(self.cfg.damage_per_mille) {
            self.damage();
        }
        let down = self.rng.u64(1..=300);
        self.after(down, Ev::Restart);
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
        let clock_offset_ms = self.rng.u64(0..1_000_000);
        let half = (self.cfg.tolerance_ms / 2) as i64;
        let wall_error_ms = self.rng.i64(-half..=half);
        let unsettled_ms = self.cfg.upstream_timeout_ms + self.cfg.settle_ms;
        let meta = MetaFile::read(self.meta_file.as_deref());
        let bytes = self.log.bytes().to_vec();
        let mut lost = None;
        let (leases, header, len, meta, rule) = if bytes.is_empty() {
            // A new data directory.
            if !matches!(meta, MetaFile::Missing) {
                self.fail("the log is gone but the meta file is there".into());
                return;
            }
            let image = fencegate_core::journal::record::log_image(std::iter::empty(), 0, 0, 0);
            let header = Header::read(&image).expect("a fresh image has a header");
            let len = image.len() as u64;
            self.log.replace(image);
            let meta = Meta::default();
            self.meta_file = Some(meta.encode());
            (Vec::new(), header, len, meta, RestartRule::default())
        } else {
            let (start, replayed) = match recovery::read_log(&bytes) {
                Ok(r) => r,
                Err(recovery::Refusal(why)) => {
                    self.fail(format!("the start refused the log: {why}"));
                    return;
                }
            };
            match recovery::intact(start, &meta, &replayed, FLOOR_BLOCK) {
                Ok(header) => {
                    let Some(header) = header else {
                        self.fail("a version 1 log in the simulation".into());
                        return;
                    };
                    let (floor, reserved) =
                        recovery::intact_floors(Some(header), &meta, replayed.max_token);
                    let reserved = reserved.unwrap_or_else(|| {
                        replayed.max_token.max(floor).saturating_add(FLOOR_BLOCK)
                    });
                    let meta = Meta {
                        reserved,
                        floor,
                        ..Meta::default()
                    };
                    self.meta_file = Some(meta.encode());
                    if replayed.torn_bytes > 0 {
                        self.log.set_len(replayed.good_len);
                        self.log.sync();
                    }
                    let header = Header {
                        token_floor: floor,
                        ..header
                    };
                    let rule = RestartRule {
                        unsettled_ms,
                        token_floor: floor,
                        lost_records: false,
                        hashed_ids: false,
                        forgotten_above: replayed.forgotten_above,
                    };
                    let leases = sorted(replayed.leases);
                    (leases, header, replayed.good_len, meta, rule)
                }
                Err(why) => {
                    let MetaFile::Found(found) = meta else {
                        self.fail(format!("records lost ({why}) and no meta file"));
                        return;
                    };
                    let mut leases = replayed.leases;
                    let floor =
                        recovery::after_loss(&mut leases, replayed.max_token, start, found, 0);
                    let meta = Meta {
                        reserved: floor,
                        floor,
                        ..Meta::default()
                    };
                    self.meta_file = Some(meta.encode());
                    let leases = sorted(leases);
                    let image = fencegate_core::journal::record::log_image(
                        leases.iter(),
                        floor,
                        replayed.forgotten_above,
                        0,
                    );
                    let header = Header::read(&image).expect("a fresh image has a header");
                    let len = image.len() as u64;
                    self.log.replace(image);
                    let rule = RestartRule {
                        unsettled_ms,
                        token_floor: floor,
                        lost_records: true,
                        hashed_ids: false,
                        forgotten_above: replayed.forgotten_above,
                    };
                    lost = Some(why);
                    (leases, header, len, meta, rule)
                }
            }
        };
        let now_ms = self.now + clock_offset_ms;
        let wall_ms = (WALL_BASE_MS + self.now).saturating_add_signed(wall_error_ms);
        let mut proxy = Proxy {
            inc,
            clock_offset_ms,
            wall_error_ms,
            slots: BTreeMap::new(),
            unsettled_until_ms: now_ms + rule.unsettled_ms,
            rule,
            header,
            len,
            meta,
            queue: Vec::new(),
            writing: false,
        };
        let mut ended_by_hint = Vec::new();
        for record in &leases {
            let Some(lease) = lease_index(&record.lease) else {
                self.fail(format!(
                    "a lease the simulation never named: {}",
                    record.lease
                ));
                return;
            };
            let restored = match restart::restore(
                record.clone(),
                &rule,
                now_ms,
                wall_ms,
                self.cfg.tolerance_ms,
            ) {
                Ok(r) => r,
                Err(why) => {
                    self.fail(format!("the start refused lease l{lease}: {why}"));
                    return;
                }
            };
            if restored.ended_by_hint {
                if let Some(t) = restored.state.term() {
                    ended_by_hint.push((lease, t.token));
                }
            }
            proxy.slots.insert(
                lease,
                Slot {
                    state: restored.state,
                    inflight: Inflight::default(),
                    unsettled_from: restored.unsettled_from,
                    wall_deadline_ms: restored.wall_deadline_ms,
                },
            );
        }
        if inc > 1 {
            self.check_start(&leases, &proxy, now_ms, wall_ms, lost.as_deref());
        }
        if lost.is_some() {
            self.stats.starts_after_loss += 1;
        }
        self.damaged = false;
        self.proxy = Some(proxy);
        // A term its hint ended is recorded as ended.
        for (lease, token) in ended_by_hint {
            let record = Record::Release {
                lease: lease_name(lease),
                token,
                quiet: false,
            };
            self.queue(record, Ack::None);
        }
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
        lost: Option<&str>,
    ) {
        let tol = self.cfg.tolerance_ms;
        if let Some(why) = lost {
            if !self.damaged {
                self.fail(format!(
                    "a start after a crash or power cut, with no damage to the disk, found \
                     acknowledged records lost: {why}"
                ));
                return;
            }
        }
        for (lease, truth) in self.truth.iter().enumerate() {
            let slot = proxy.slots.get(&lease);
            let last = slot.map_or_else(
                || restart::new_lease(&proxy.rule).0.last_token(),
                |s| s.state.last_token(),
            );
            if last < truth.max_acked {
                let what = format!(
                    "lease l{lease} restarted with last token {last}, below the granted {}",
                    truth.max_acked
                );
                self.fail(what);
                return;
            }
            let current = slot.and_then(|s| s.state.term());
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
                let Some(term) = proxy.slots.get(&lease).and_then(|s| s.state.term()) else {
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
        // start may be held again for up to a TTL.
        for truth in &mut self.truth {
            for t in truth.terms.values_mut() {
                if !t.release_acked && t.live_until_ms + t.ttl_ms / 2 + 2 * tol > self.now {
                    t.live_until_ms = t.live_until_ms.max(self.now + t.ttl_ms);
                }
            }
        }
    }
}

fn lease_name(lease: usize) -> String {
    format!("l{lease}")
}

fn lease_index(name: &str) -> Option<usize> {
    name.strip_prefix('l')?.parse().ok()
}

/// The recovered leases in name order (the core hands them over in a map).
fn sorted(leases: std::collections::HashMap<String, LeaseRecord>) -> Vec<LeaseRecord> {
    let mut leases: Vec<LeaseRecord> = leases.into_values().collect();
    leases.sort_by(|a, b| a.lease.cmp(&b.lease));
    leases
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
