//! The simulated etcd of cluster mode: members' sessions (etcd leases)
//! that expire, the election, and the lease state a primary's batches
//! commit, changed by the etcd journal's rules
//! (`fencegate_core::lease::slot::record_into`).

use super::*;

impl Etcd {
    /// Session `id` campaigns: it wins if nobody leads, reading the
    /// records of the election before and recording its own (the shell's
    /// `record_election`).
    fn campaign(&mut self, id: u64) -> EtcdReply {
        if self.leader.is_none() {
            self.leader = Some(id);
            let bytes = |e: Option<u64>| e.map(u64::to_be_bytes);
            let (elected, handed_over) = (bytes(self.elected), bytes(self.handed_over));
            self.won_clean = fencegate_core::cluster::takeover_clean(
                elected.as_ref().map(|b| &b[..]),
                handed_over.as_ref().map(|b| &b[..]),
            );
            self.elected = Some(id);
        }
        if self.leader == Some(id) {
            EtcdReply::Won {
                session: id,
                clean: self.won_clean,
            }
        } else {
            EtcdReply::Lost
        }
    }
}

impl World {
    /// etcd lets sessions go at their expiry (and the election with them).
    pub(super) fn etcd_expire(&mut self) {
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

    pub(super) fn at_etcd(&mut self, member: usize, generation: u64, sent_ms: u64, op: EtcdOp) {
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
            EtcdOp::Campaign(id) => self.etcd.campaign(id),
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
            self.etcd_reply_lost(member, generation, sent_ms, reply);
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

    /// etcd's answer to a member cut off from it is lost: a commit's
    /// waiters time out, and a session is asked for again.
    fn etcd_reply_lost(&mut self, member: usize, generation: u64, sent_ms: u64, reply: EtcdReply) {
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
    }

    /// A committed batch changes etcd's lease state with the etcd journal's
    /// rules.
    pub(super) fn etcd_apply(&mut self, batch: &[Queued]) {
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
            if slot::record_into(&mut state, &q.record) {
                self.etcd.state.apply(lease.to_owned(), state);
            }
        }
    }
}
