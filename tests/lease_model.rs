//! Property tests: the pure lease state machine against a small reference
//! model, over random sequences of operations and clock advances.
//!
//! Seen failing against a mutant: with the expiry check written `now_ms >
//! deadline_ms` (a term still live at its deadline) proptest finds a minimal
//! counterexample in well under a second.

use std::collections::HashMap;

use fencegate::lease::machine::{AcquireRefused, LeaseState, Reject};
use fencegate::lease::LeaseId;
use proptest::prelude::*;

/// Which token an operation presents, relative to the lease's history.
#[derive(Clone, Copy, Debug)]
enum TokenPick {
    Current,
    Previous,
    Next,
    Zero,
    Literal(u64),
}

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        lease: u8,
        holder: u8,
        ttl_ms: u64,
    },
    Renew {
        lease: u8,
        token: TokenPick,
        right_id: bool,
        caller: Caller,
        ttl_ms: Option<u64>,
    },
    Release {
        lease: u8,
        token: TokenPick,
        right_id: bool,
        caller: Caller,
    },
    Write {
        lease: u8,
        token: TokenPick,
        right_id: bool,
        id_required: bool,
        caller: Caller,
    },
    Advance {
        ms: u64,
    },
}

/// Who calls, when authentication is on.
#[derive(Clone, Copy, Debug)]
enum Caller {
    /// Authentication off: no holder check.
    Anyone,
    /// The current term's holder.
    Holder,
    /// Some other authenticated caller.
    Other,
}

fn caller() -> impl Strategy<Value = Caller> {
    prop_oneof![
        2 => Just(Caller::Anyone),
        1 => Just(Caller::Holder),
        1 => Just(Caller::Other),
    ]
}

fn token_pick() -> impl Strategy<Value = TokenPick> {
    prop_oneof![
        6 => Just(TokenPick::Current),
        2 => Just(TokenPick::Previous),
        1 => Just(TokenPick::Next),
        1 => Just(TokenPick::Zero),
        1 => (0u64..6).prop_map(TokenPick::Literal),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let lease = 0u8..3;
    let ttl = prop_oneof![Just(1u64), Just(10), 1u64..200];
    prop_oneof![
        3 => (lease.clone(), 0u8..2, ttl.clone()).prop_map(|(lease, holder, ttl_ms)| Op::Acquire { lease, holder, ttl_ms }),
        2 => (lease.clone(), token_pick(), any::<bool>(), caller(), proptest::option::of(ttl))
            .prop_map(|(lease, token, right_id, caller, ttl_ms)| Op::Renew { lease, token, right_id, caller, ttl_ms }),
        1 => (lease.clone(), token_pick(), any::<bool>(), caller())
            .prop_map(|(lease, token, right_id, caller)| Op::Release { lease, token, right_id, caller }),
        4 => (lease, token_pick(), prop::bool::weighted(0.8), prop::bool::weighted(0.8), caller())
            .prop_map(|(lease, token, right_id, id_required, caller)| Op::Write { lease, token, right_id, id_required, caller }),
        3 => prop_oneof![Just(0u64), Just(1), 0u64..150].prop_map(|ms| Op::Advance { ms }),
    ]
}

/// The reference model of one lease, written from the contract's sentences.
#[derive(Default, Debug)]
struct Model {
    /// Every token ever issued, in order.
    issued: Vec<u64>,
    holder_id: u32,
    holder: String,
    ttl_ms: u64,
    deadline_ms: u64,
    released: bool,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Outcome {
    Ok(u64),
    Unknown,
    Stale,
    Mismatch,
    NotHolder,
    Released,
    Expired,
}

impl Model {
    fn current(&self) -> u64 {
        self.issued.last().copied().unwrap_or(0)
    }

    fn live(&self, now: u64) -> bool {
        !self.issued.is_empty() && !self.released && now < self.deadline_ms
    }

    fn token(&self, pick: TokenPick) -> u64 {
        match pick {
            TokenPick::Current => self.current(),
            TokenPick::Previous => self.current().saturating_sub(1),
            TokenPick::Next => self.current() + 1,
            TokenPick::Zero => 0,
            TokenPick::Literal(t) => t,
        }
    }

    /// The name `caller` authenticates as (`None` with authentication off).
    fn caller(&self, caller: Caller) -> Option<String> {
        match caller {
            Caller::Anyone => None,
            Caller::Holder => Some(self.holder.clone()),
            Caller::Other => Some(format!("not-{}", self.holder)),
        }
    }

    fn check(&self, now: u64, token: u64, id_ok: Option<bool>, caller: Caller) -> Outcome {
        // "unknown for a lease never acquired, for token 0 and for a token
        // above the current one; stale below it; then the lease id; then the
        // term's state."
        if !self.issued.contains(&token) {
            return if token < self.current() && token > 0 {
                Outcome::Stale
            } else {
                Outcome::Unknown
            };
        }
        if token < self.current() {
            return Outcome::Stale;
        }
        if id_ok == Some(false) {
            return Outcome::Mismatch;
        }
        // Then, with authentication on, the caller must be the term's holder.
        if matches!(caller, Caller::Other) {
            return Outcome::NotHolder;
        }
        if self.released {
            return Outcome::Released;
        }
        if now >= self.deadline_ms {
            return Outcome::Expired;
        }
        Outcome::Ok(token)
    }
}

fn id_for(n: u32) -> LeaseId {
    let mut raw = [0u8; 16];
    raw[..4].copy_from_slice(&n.to_le_bytes());
    LeaseId::from_bytes(raw)
}

fn outcome<T>(r: Result<T, Reject>, token: u64) -> Outcome {
    match r {
        Ok(_) => Outcome::Ok(token),
        Err(Reject::UnknownToken { .. }) => Outcome::Unknown,
        Err(Reject::StaleToken { .. }) => Outcome::Stale,
        Err(Reject::LeaseIdMismatch { .. }) => Outcome::Mismatch,
        Err(Reject::NotHolder { .. }) => Outcome::NotHolder,
        Err(Reject::Released { .. }) => Outcome::Released,
        Err(Reject::Expired { .. }) => Outcome::Expired,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn machine_matches_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut now: u64 = 0;
        let mut next_id: u32 = 1;
        let mut machines: HashMap<u8, LeaseState> = HashMap::new();
        let mut models: HashMap<u8, Model> = HashMap::new();
        for op in ops {
            match op {
                Op::Advance { ms } => now += ms,
                Op::Acquire { lease, holder, ttl_ms } => {
                    let machine = machines.entry(lease).or_default();
                    let model = models.entry(lease).or_default();
                    let id = next_id;
                    next_id += 1;
                    let holder = format!("h{holder}");
                    let got = machine.acquire(now, &holder, ttl_ms, id_for(id));
                    if model.live(now) {
                        prop_assert!(matches!(got, Err(AcquireRefused::Held(_))), "{got:?}");
                    } else {
                        let token = model.current() + 1;
                        prop_assert_eq!(got.as_ref().map(|g| g.token).ok(), Some(token));
                        // Tokens per lease strictly increase.
                        prop_assert!(model.issued.iter().all(|&t| t < token));
                        model.issued.push(token);
                        model.holder_id = id;
                        model.holder = holder;
                        model.ttl_ms = ttl_ms;
                        model.deadline_ms = now + ttl_ms;
                        model.released = false;
                    }
                }
                Op::Renew { lease, token, right_id, caller, ttl_ms } => {
                    let machine = machines.entry(lease).or_default();
                    let model = models.entry(lease).or_default();
                    let t = model.token(token);
                    let presented = id_for(if right_id { model.holder_id } else { u32::MAX });
                    let who = model.caller(caller);
                    let got = outcome(machine.renew(now, t, Some(presented.expose().as_bytes()), who.as_deref(), ttl_ms), t);
                    let want = model.check(now, t, Some(right_id), caller);
                    prop_assert_eq!(got, want);
                    if let Outcome::Ok(_) = want {
                        let ttl = ttl_ms.unwrap_or(model.ttl_ms);
                        model.ttl_ms = ttl;
                        model.deadline_ms = now + ttl;
                    }
                }
                Op::Release { lease, token, right_id, caller } => {
                    let machine = machines.entry(lease).or_default();
                    let model = models.entry(lease).or_default();
                    let t = model.token(token);
                    let presented = id_for(if right_id { model.holder_id } else { u32::MAX });
                    let who = model.caller(caller);
                    let got = outcome(machine.release(now, t, Some(presented.expose().as_bytes()), who.as_deref()), t);
                    let want = model.check(now, t, Some(right_id), caller);
                    prop_assert_eq!(got, want);
                    if let Outcome::Ok(_) = want {
                        model.released = true;
                    }
                }
                Op::Write { lease, token, right_id, id_required, caller } => {
                    let machine = machines.entry(lease).or_default();
                    let model = models.entry(lease).or_default();
                    let t = model.token(token);
                    let presented = id_for(if right_id { model.holder_id } else { u32::MAX });
                    let (arg, id_ok) = if id_required {
                        (Some(presented.expose().as_bytes()), Some(right_id))
                    } else {
                        (None, None)
                    };
                    let who = model.caller(caller);
                    let got = outcome(machine.check(now, t, arg, who.as_deref()), t);
                    prop_assert_eq!(got, model.check(now, t, id_ok, caller));
                    // A write is admitted only while its term is live.
                    if let Outcome::Ok(_) = got {
                        prop_assert!(model.live(now) && t == model.current());
                    }
                }
            }
            // Inspection agrees with the model after every step.
            for (lease, model) in &models {
                let view = machines[lease].view(now);
                prop_assert_eq!(view.as_ref().map(|v| v.token), model.issued.last().copied());
                if let Some(v) = view {
                    prop_assert_eq!(v.transitions, model.issued.len() as u64);
                    prop_assert_eq!(v.expires_in_ms, if model.live(now) { model.deadline_ms - now } else { 0 });
                }
            }
        }
    }
}
