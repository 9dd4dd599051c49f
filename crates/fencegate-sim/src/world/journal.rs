//! The proxy's journal: records queued (a lazy one dropped by a full
//! queue), batches written and synced by the core's plan on the simulated
//! disk, and the answers that waited for them.

use super::*;

impl World {
    // -- the journal ----------------------------------------------------------

    /// The lease store's sweep: forgets, by the core's rule, the leases
    /// quiet for the retention time (or, making room, for none), raising
    /// the mark new terms of a name not in the store start above, and
    /// journals each (as the shell's `forget`).
    pub(super) fn sweep(&mut self, inc: u64) {
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
    pub(super) fn queue_lazy(&mut self, record: Record) -> bool {
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

    pub(super) fn queue(&mut self, record: Record, ack: Ack) {
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
    pub(super) fn flush(&mut self, inc: u64) {
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

    pub(super) fn synced(
        &mut self,
        inc: u64,
        rest: Vec<Step>,
        batch: Vec<Queued>,
        len_before: u64,
    ) {
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
    pub(super) fn hints_durable(&mut self, batch: &[Queued]) {
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
    pub(super) fn batch_done(&mut self, batch: Vec<Queued>, ok: bool) {
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
    pub(super) fn release_done(&mut self, req: &Req, ok: bool) {
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
    pub(super) fn grant_done(
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
}
