//! Crashes, power cuts and starts: what the disk kept, the core's plan
//! for the files found, the restore of the recovered leases.

use super::*;

impl World {
    // -- crashes and starts -------------------------------------------------

    pub(super) fn schedule_crash(&mut self) {
        let mean = self.cfg.crash_every_ms.max(2);
        let at = self.rng.u64(1..2 * mean);
        self.after(at, Ev::Crash(0));
    }

    pub(super) fn crash(&mut self) {
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
    pub(super) fn change_identity(
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
    pub(super) fn power_cut(&mut self) {
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
    pub(super) fn crash_at_start(&mut self) {
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
    pub(super) fn abandon(&mut self, inc: u64) {
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
    pub(super) fn damage(&mut self) {
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
    pub(super) fn start(&mut self) {
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

    /// Restores the recovered leases into `proxy` with the core's restart
    /// rule; the releases to record once serving (terms a hint ended).
    pub(super) fn restore_into(
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
    pub(super) fn serve(&mut self, proxy: Proxy, endings: Vec<restart::Ending>) {
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
}
