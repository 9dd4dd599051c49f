//! The checker: the truth of every term, learnt from the answers the
//! clients got, and the guarantees checked against it: at each grant,
//! renewal, refusal and admission (in the proxy's procedures), at each
//! start, at each learnt key state, and on the storage models.

use super::*;

#[derive(Debug)]
pub(super) struct TermTruth {
    pub(super) ttl_ms: u64,
    /// The highest token granted (answered) when this one was issued: it
    /// must be above it. (Its own answer may come after a later term's: a
    /// primary paused between its commit and its answer.)
    pub(super) granted_before: u64,
    /// No later than this (simulated time) may the term still be live.
    pub(super) live_until_ms: u64,
    /// What the holder was promised: the latest deadline an answer gave it
    /// (simulated time). Until then the term is held, its writes and
    /// renewals are admitted and nobody else is granted the lease, unless
    /// it may have ended early (`may_end_early`).
    pub(super) promised_until_ms: u64,
    /// The step at which the last renewal record (its wall-clock hint) was
    /// queued for the journal, and the step the last durable one was
    /// queued at: a start may end the term by an older hint while they
    /// differ (a record lost with a failed sync or a crash).
    pub(super) hint_queued_step: u64,
    pub(super) hint_durable_step: u64,
    /// The journal's queue dropped the record of its last due hint: the
    /// next renewal must record one (`restart::renewal_recorded`).
    pub(super) hint_dropped: bool,
    /// A start may have ended the term before its promise: records were
    /// lost, its release may have reached the journal, or the hint of its
    /// last renewal may not have (a documented, safe loss).
    pub(super) may_end_early: bool,
    pub(super) acked: bool,
    pub(super) release_acked: bool,
    pub(super) release_issued: bool,
}

#[derive(Debug, Default)]
pub(super) struct LeaseTruth {
    pub(super) terms: BTreeMap<u64, TermTruth>,
    pub(super) max_acked: u64,
    pub(super) applied_max: u64,
}

impl LeaseTruth {
    /// Why term `token` has ended at `now`, if it has.
    pub(super) fn ended(&self, token: u64, now: u64) -> Option<&'static str> {
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

impl World {
    /// Whether the holder of term `token` of `lease` was promised it is
    /// live now (see [`TermTruth::promised_until_ms`]).
    pub(super) fn promised(&self, lease: usize, token: u64) -> bool {
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
    pub(super) fn check_refusal(&mut self, req: &Req, what: &str) {
        if self.promised(req.lease, req.token) {
            let until = self.truth[req.lease].terms[&req.token].promised_until_ms;
            self.fail(format!(
                "lease l{} term {}, promised until {until} ms, had its {what} refused",
                req.lease, req.token
            ));
        }
    }

    /// What a member's process learned about `key` from an exchange sent at
    /// `sent_ms` must be a state the key held while it ran.
    pub(super) fn check_learned(
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

    /// What a start must keep of what was acknowledged, checked against the
    /// answers the clients got; and what the terms may do from here on.
    pub(super) fn check_start(
        &mut self,
        records: &[LeaseRecord],
        proxy: &Proxy,
        now_ms: u64,
        wall_ms: u64,
        lost: Option<&recovery::Loss>,
    ) {
        if self.cfg.trace {
            trace_start(records, proxy, now_ms);
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
        let broken = self
            .promises_kept(proxy, now_ms, lost.is_some())
            .or_else(|| self.leases_restored(proxy, now_ms, lost.is_some()))
            .or_else(|| match lost {
                None => self.recovered_terms_held(records, proxy, now_ms, wall_ms),
                Some(_) => None,
            });
        if let Some(what) = broken {
            self.fail(what);
            return;
        }
        // From here on, a term that may have been live shortly before the
        // start may be held again for up to a TTL (on the new clock).
        let tol = self.cfg.tolerance_ms;
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

    /// What the holders were promised survives the start, but where the
    /// start may end a term early: lost records, a release that may have
    /// reached the journal, a renewal whose hint may not have. The first
    /// promise broken, if any.
    fn promises_kept(&mut self, proxy: &Proxy, now_ms: u64, lost: bool) -> Option<String> {
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
                if lost || t.release_issued || hint_lost {
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
        let (lease, token, until) = ended_early.first()?;
        Some(format!(
            "lease l{lease} term {token}, promised until {until} ms, was not held after a \
             start at {now} ms"
        ))
    }

    /// Every lease's tokens continue above what was granted, a release
    /// answered stays released, and a start that lost records holds no
    /// term. The first lease that breaks one, if any.
    fn leases_restored(&self, proxy: &Proxy, now_ms: u64, lost: bool) -> Option<String> {
        for (lease, truth) in self.truth.iter().enumerate() {
            let slot = proxy.slots.get(&lease);
            let last = slot.map_or_else(
                || restart::new_lease(&proxy.rule).0.last_token(),
                |s| s.lease.state().last_token(),
            );
            if last < truth.max_acked {
                return Some(format!(
                    "lease l{lease} restarted with last token {last}, below the granted {}",
                    truth.max_acked
                ));
            }
            let current = slot.and_then(|s| s.lease.state().term());
            if let (Some(term), Some(t)) = (current, truth.terms.get(&truth.max_acked)) {
                if term.token == truth.max_acked && t.release_acked && !term.released {
                    return Some(format!(
                        "lease l{lease} term {} was released with an answer, and a start \
                         brought it back",
                        term.token
                    ));
                }
            }
            if let Some(term) = current.filter(|t| lost && t.is_live(now_ms)) {
                return Some(format!(
                    "lease l{lease} term {} held after a start that lost records",
                    term.token
                ));
            }
        }
        None
    }

    /// A recovered term that may still be live (by its hint) is held, for
    /// at most its TTL. The first that is not, if any.
    fn recovered_terms_held(
        &self,
        records: &[LeaseRecord],
        proxy: &Proxy,
        now_ms: u64,
        wall_ms: u64,
    ) -> Option<String> {
        let tol = self.cfg.tolerance_ms;
        for record in records {
            let Some(t) = record.term.as_ref().filter(|t| !t.released) else {
                continue;
            };
            let lease = lease_index(&record.lease).expect("checked at the start");
            let may_live =
                t.wall_deadline_ms == 0 || t.wall_deadline_ms + t.ttl_ms / 2 + tol > wall_ms;
            let Some(term) = proxy.slots.get(&lease).and_then(|s| s.lease.state().term()) else {
                continue;
            };
            if may_live && !term.is_live(now_ms) {
                return Some(format!(
                    "lease l{lease} term {} may still be live, and the start ended it",
                    t.token
                ));
            }
            if term.is_live(now_ms) && term.deadline_ms > now_ms + t.ttl_ms {
                return Some(format!(
                    "lease l{lease} term {} held for more than its TTL after a start",
                    t.token
                ));
            }
        }
        None
    }

    /// Self-fencing: a primary admits nothing once etcd could have let its
    /// election lease go (and another member win).
    pub(super) fn check_primacy(&mut self, what: &str) {
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
}

/// What a start found (the `--trace` of the `simulate` example).
fn trace_start(records: &[LeaseRecord], proxy: &Proxy, now_ms: u64) {
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
