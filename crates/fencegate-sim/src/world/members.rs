//! Cluster mode: members, their sessions on the simulated etcd, the
//! election, takeovers and step-downs, and etcd applying the lease state.

use super::*;

impl World {
    // -- cluster mode: members, their etcd sessions, the election ----------

    pub(super) fn member_ms(&self, m: usize) -> u64 {
        let member = &self.members[m];
        local_ms(member.clock_offset_ms, member.skew_ppm, self.now)
    }

    pub(super) fn member_ttl_ms(&self) -> u64 {
        self.cfg.member_ttl_s * 1000
    }

    pub(super) fn send_etcd(&mut self, member: usize, op: EtcdOp) {
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
    pub(super) fn member_start(&mut self, m: usize) {
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
    pub(super) fn member_crash(&mut self, m: usize) {
        if !self.members[m].alive {
            return;
        }
        self.stats.crashes += 1;
        self.member_exit(m);
    }

    /// A member's process is gone (crashed or stopped); it starts again a
    /// while later.
    pub(super) fn member_exit(&mut self, m: usize) {
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
    pub(super) fn member_stop(&mut self, m: usize) {
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
    pub(super) fn drain(&mut self, m: usize, generation: u64, session: u64, bound_ms: u64) {
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

    pub(super) fn schedule_pause(&mut self, m: usize) {
        let at = self.rng.u64(1..2 * self.cfg.pause_every_ms.max(2));
        self.after(at, Ev::Pause(m));
    }

    /// SIGSTOP: the member does nothing until it wakes; its clock runs on.
    /// Or it is cut off from etcd while clients still reach it.
    pub(super) fn pause(&mut self, m: usize) {
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
    pub(super) fn current_session(&self, m: usize, session: u64) -> bool {
        self.members[m].alive && self.members[m].session.is_some_and(|s| s.id == session)
    }

    /// Whether the member serves as primary in `session`.
    pub(super) fn serving(&self, session: u64) -> bool {
        self.proxy
            .as_ref()
            .and_then(|p| p.primacy)
            .is_some_and(|p| p.session == session && !p.revoked)
    }

    pub(super) fn beat(&mut self, m: usize, session: u64) {
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

    pub(super) fn poll(&mut self, m: usize, session: u64) {
        if !self.current_session(m, session) {
            return;
        }
        if !self.serving(session) {
            self.send_etcd(m, EtcdOp::Campaign(session));
        }
        let poll = cluster::poll_ms(self.member_ttl_ms());
        self.after(poll, Ev::Poll { member: m, session });
    }

    pub(super) fn etcd_answered(
        &mut self,
        m: usize,
        generation: u64,
        sent_ms: u64,
        reply: EtcdReply,
    ) {
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

    /// Primacy is lost (or the session is): nothing more is admitted
    /// (writes in flight finish), and, as the member does, the old session
    /// is given back and a new one starts from what etcd holds.
    pub(super) fn step_down(&mut self, m: usize) {
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
    pub(super) fn take_over(&mut self, m: usize, session: u64, confirmed_ms: u64, clean: bool) {
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
