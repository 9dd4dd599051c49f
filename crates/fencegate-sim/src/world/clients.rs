//! The clients: writers that acquire, write, renew and release on clocks
//! of their own, pause, stop, and go on as zombies.

use super::*;

impl World {
    // -- clients ------------------------------------------------------------

    pub(super) fn wake(&mut self, c: usize) {
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
    pub(super) fn new_write(&mut self) -> Op {
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
    pub(super) fn shape(&mut self, n: usize) -> usize {
        if self.shapes.u32(0..4) == 0 {
            self.shapes.usize(1..n)
        } else {
            0
        }
    }

    /// The client thinks its term is over (or was told so).
    pub(super) fn give_up(
        &mut self,
        c: usize,
        lease: usize,
        token: u64,
        lease_id: [u8; 32],
        ttl_ms: u64,
    ) {
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
    pub(super) fn send(
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

    pub(super) fn reply(&mut self, req: &Req, answer: Answer) {
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

    pub(super) fn deliver(&mut self, c: usize, _req: u64, answer: Answer) {
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
}
