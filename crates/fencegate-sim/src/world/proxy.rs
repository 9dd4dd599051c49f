//! The proxy: each lease the core's slot (`fencegate_core::lease::slot`),
//! as the lease store keeps it; requests arrive, are decided by the slot's
//! procedures, and are forwarded to the backend and the storage models.

use super::*;

impl World {
    // -- the proxy ----------------------------------------------------------

    pub(super) fn proxy_now(&self) -> u64 {
        self.proxy
            .as_ref()
            .map_or(0, |p| local_ms(p.clock_offset_ms, p.skew_ppm, self.now))
    }

    /// Whether the proxy may send anything now: standalone always; in
    /// cluster mode while its primacy is live on its own clock.
    pub(super) fn primary_now(&self) -> bool {
        let now_ms = self.proxy_now();
        self.proxy.as_ref().and_then(|p| p.primacy).is_none_or(|p| {
            fencegate_core::cluster::primacy_admits(now_ms, p.until_ms, p.revoked, true)
        })
    }

    /// How long `ms` on the proxy's clock surely lasts on the simulated
    /// clock (rounded down).
    pub(super) fn promised_ms(&self, ms: u64) -> u64 {
        global_ms_floor(ms, self.proxy.as_ref().map_or(0, |p| p.skew_ppm))
    }

    /// How far the clocks of two proxies may run apart (ppm).
    pub(super) fn slack_skew_ppm(&self) -> u64 {
        if self.cluster() {
            self.cfg.member_skew_ppm.unsigned_abs()
        } else {
            0
        }
    }

    /// How long `ms` on the proxy's clock lasts on the simulated clock.
    pub(super) fn to_global_ms(&self, ms: u64) -> u64 {
        global_ms(ms, self.proxy.as_ref().map_or(0, |p| p.skew_ppm))
    }

    pub(super) fn wall_ms(&self) -> u64 {
        let error = self.proxy.as_ref().map_or(0, |p| p.wall_error_ms);
        (WALL_BASE_MS + self.now).saturating_add_signed(error)
    }

    pub(super) fn arrive(&mut self, req: Req) {
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

    pub(super) fn acquire(&mut self, req: Req, ttl_ms: u64) {
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

    pub(super) fn renew(&mut self, req: Req) {
        let p = self.proxy_now();
        let wall = self.wall_ms();
        let proxy = self.proxy.as_mut().expect("arrive checked");
        let Some(slot) = proxy.slots.get_mut(&req.lease) else {
            self.reply(&req, Answer::Refused);
            return;
        };
        let presented = presented(&req);
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

    pub(super) fn release(&mut self, req: Req) {
        let p = self.proxy_now();
        let proxy = self.proxy.as_mut().expect("arrive checked");
        let Some(slot) = proxy.slots.get_mut(&req.lease) else {
            self.reply(&req, Answer::Refused);
            return;
        };
        let presented = presented(&req);
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

    pub(super) fn write(&mut self, req: Req) {
        // Checked again right before a write leaves (after a wait at the
        // barrier too), as the fence's before-send check does.
        if !self.primary_now() {
            self.reply(&req, Answer::Failed);
            return;
        }
        let p = self.proxy_now();
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
            Decision::Wait { until_ms, .. } => self.wait_at_barrier(req, inc, p, until_ms),
            Decision::Refuse(_) => {
                self.stats.writes_refused += 1;
                self.reply(&req, Answer::Refused);
            }
        }
    }

    /// A write told to wait at the barrier (at `p` on the proxy's clock,
    /// until `until_ms` by the clock alone): refused once it waited as long
    /// as it may (503), else looked at again a moment later (a write
    /// finishing would wake it), the lease held meanwhile.
    fn wait_at_barrier(&mut self, req: Req, inc: u64, p: u64, until_ms: Option<u64>) {
        let first_try_ms = match req.op {
            Op::Write { first_try_ms, .. } => first_try_ms,
            _ => None,
        };
        let first = first_try_ms.unwrap_or(p);
        if first_try_ms.is_none() {
            self.stats.barrier_waits += 1;
        }
        let max_wait_ms = self.cfg.upstream_timeout_ms;
        if admission::may_wait(first, p, max_wait_ms, until_ms).is_err() {
            self.reply(&req, Answer::Failed);
            return;
        }
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

    /// Sends an admitted write to the backend: it answers after a latency
    /// (sometimes past the upstream timeout) and applies the write before
    /// or after it answers, within the settle time after the connection
    /// is gone, or, for a rogue write, later.
    pub(super) fn forward(&mut self, req: Req, inc: u64, cond: Option<Cond>) {
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
    pub(super) fn connection_gone(&mut self, w: usize) {
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

    pub(super) fn apply(&mut self, w: usize) {
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
    pub(super) fn apply_to_etcd(&mut self, w: usize) {
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
    pub(super) fn apply_to_dynamo(&mut self, w: usize) {
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

    pub(super) fn live_write(&self, w: usize) -> bool {
        let write = &self.writes[w];
        self.proxy.as_ref().is_some_and(|p| p.inc == write.inc) && write.gone_ms.is_none()
    }

    pub(super) fn answered(&mut self, w: usize) {
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

    pub(super) fn body_done(&mut self, w: usize) {
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

    pub(super) fn timeout(&mut self, w: usize) {
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
    pub(super) fn serving_member(&self, inc: u64) -> usize {
        self.inc_member[inc as usize]
    }

    /// The core's plan for a write on a route with preconditions (`Ok(None)`
    /// on other routes); `Err(key)`: 428, nothing sent. Checks that a
    /// precondition names a state the key held since this member's term of
    /// primacy began (a new primary starts knowing none).
    pub(super) fn plan_condition(&mut self, req: &Req, inc: u64) -> Result<Option<Cond>, usize> {
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
    pub(super) fn key_states(&mut self, m: usize, generation: u64) -> Option<&mut KeyStates> {
        let member = &mut self.members[m];
        if member.generation != generation {
            return None;
        }
        member.key_states.as_mut()
    }

    /// The member's process learns from the answer to write `w` (`unknown`:
    /// it stopped waiting for it).
    pub(super) fn learn_write(&mut self, w: usize, unknown: bool) {
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

    /// A read of a key on a route with preconditions: the storage serves it
    /// a moment later, and its answer teaches the member's process.
    pub(super) fn read(&mut self, req: Req, key: usize, shape: usize) {
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

    pub(super) fn read_answered(&mut self, r: usize) {
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

    pub(super) fn reply_to(&mut self, client: usize, req: u64, answer: Answer) {
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
}

/// What a client's renewal or release presents (no authentication here).
fn presented(req: &Req) -> slot::Presented<'_> {
    slot::Presented {
        token: req.token,
        lease_id: Some(&req.lease_id),
        holder: None,
    }
}
