//! Writes in flight, counted by term: the bookkeeping behind the handover
//! guarantee. Pure data, no locks; time comes in as `now_ms`. The lease store
//! owns one per lease.
//!
//! A write of a term holds back newer terms' writes while it is
//! - **awaiting** its response head: the backend has not answered yet;
//! - **streaming** its response body, for at most the settle time after the
//!   head arrived: the backend has answered, so it has applied the write or
//!   will within the settle time, whether or not the client reads the body;
//! - **lingering** after its outcome became unknown (the upstream timed out,
//!   a connection broke, the client went away): until the settle time has
//!   passed, since the backend may still apply it.

use crate::mutant::{planted, Mutant};

/// One term's writes.
#[derive(Debug, Clone, Copy)]
struct Term {
    token: u64,
    /// Writes waiting for their response head.
    awaiting: u32,
    /// Writes whose response body is still being sent.
    streaming: u32,
    /// Streaming writes hold back newer terms until then at the latest.
    streaming_until_ms: u64,
    /// Writes of unknown outcome hold back newer terms until then.
    linger_until_ms: u64,
}

impl Term {
    /// Whether the term's writes still hold back newer terms at `now_ms`.
    fn blocks(&self, now_ms: u64) -> bool {
        self.awaiting > 0
            || (self.streaming > 0 && now_ms < self.streaming_until_ms)
            || now_ms < self.linger_until_ms
    }

    /// When the term stops holding back newer terms by itself, if only time
    /// decides (no write awaits its head).
    fn unblocks_at(&self) -> Option<u64> {
        if self.awaiting > 0 {
            return None;
        }
        let streaming = if self.streaming > 0 {
            self.streaming_until_ms
        } else {
            0
        };
        Some(streaming.max(self.linger_until_ms))
    }

    fn is_done(&self, now_ms: u64) -> bool {
        self.awaiting == 0 && self.streaming == 0 && now_ms >= self.linger_until_ms
    }
}

/// The newest older term whose writes hold back a newer term's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocked {
    pub older_token: u64,
    /// When every blocking term is done by the clock alone; `None` while some
    /// write still awaits its response head (a finishing write wakes waiters).
    pub until_ms: Option<u64>,
}

/// Admitted, unfinished writes of one lease, by token.
///
/// Almost always empty or one entry (the current term); during a handover the
/// previous term's stragglers appear beside the new term's first writes.
#[derive(Debug, Default)]
pub struct Inflight {
    terms: Vec<Term>,
    /// Whether a newer term's write is waiting for a term to drain, so that
    /// finishing writes only pay for a wake-up when someone listens.
    waiters: bool,
}

impl Inflight {
    /// What holds back a write of `token` at `now_ms`, if anything.
    pub fn older_than(&mut self, token: u64, now_ms: u64) -> Option<Blocked> {
        self.terms.retain(|t| !t.is_done(now_ms));
        let blocking = || {
            self.terms
                .iter()
                .filter(move |t| t.token < token && t.blocks(now_ms))
        };
        let older_token = blocking().map(|t| t.token).max()?;
        let until_ms = blocking()
            .map(Term::unblocks_at)
            .try_fold(0, |acc, at| Some(acc.max(at?)));
        Some(Blocked {
            older_token,
            until_ms,
        })
    }

    /// Notes that a write waits for an older term to drain.
    pub fn note_waiter(&mut self) {
        self.waiters = true;
    }

    fn term(&mut self, token: u64) -> Option<&mut Term> {
        self.terms.iter_mut().find(|t| t.token == token)
    }

    /// Counts one more write of `token` in flight, awaiting its answer.
    pub fn add(&mut self, token: u64) {
        match self.term(token) {
            Some(t) => t.awaiting += 1,
            None => self.terms.push(Term {
                token,
                awaiting: 1,
                streaming: 0,
                streaming_until_ms: 0,
                linger_until_ms: 0,
            }),
        }
    }

    /// A write of `token` got its response head; its body may take until
    /// `until_ms` to hold back newer terms. Returns whether waiters must be
    /// woken (their wait may now end by the clock).
    pub fn answered(&mut self, token: u64, until_ms: u64) -> bool {
        let Some(t) = self.term(token) else {
            return false;
        };
        t.awaiting = t.awaiting.saturating_sub(1);
        t.streaming += 1;
        t.streaming_until_ms = t.streaming_until_ms.max(until_ms);
        let drained = t.awaiting == 0;
        drained && std::mem::take(&mut self.waiters)
    }

    /// A write of `token` is over: its response ended (`streaming`: after
    /// its head was counted by [`Inflight::answered`]). With `linger_until_ms`
    /// its outcome is unknown, and it holds back newer terms until then.
    /// Returns whether waiting writes must be woken.
    pub fn remove(&mut self, token: u64, streaming: bool, linger_until_ms: u64) -> bool {
        let Some(t) = self.term(token) else {
            return false;
        };
        if streaming {
            t.streaming = t.streaming.saturating_sub(1);
            if t.streaming == 0 {
                t.streaming_until_ms = 0;
            }
        } else {
            t.awaiting = t.awaiting.saturating_sub(1);
        }
        t.linger_until_ms = t.linger_until_ms.max(linger_until_ms);
        // With no write awaiting its head, the term's end is up to the clock
        // (or already here): waiters must look again.
        let drained = t.awaiting == 0;
        if t.awaiting == 0 && t.streaming == 0 && t.linger_until_ms == 0 {
            self.terms.retain(|t| t.token != token);
        }
        drained && std::mem::take(&mut self.waiters)
    }

    /// Writes in flight (awaiting or streaming), all terms together.
    pub fn len(&self) -> u64 {
        self.terms
            .iter()
            .map(|t| u64::from(t.awaiting) + u64::from(t.streaming))
            .sum()
    }

    /// Whether no write is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether no write of any term holds anything back at `now_ms` (none
    /// in flight, none of unknown outcome still settling).
    pub fn is_settled(&mut self, now_ms: u64) -> bool {
        self.terms.retain(|t| !t.is_done(now_ms));
        self.terms.is_empty()
    }
}

/// One admitted write, from its admission ([`Inflight::add`]) to its end:
/// how long it holds back newer terms at each step. The shell's write
/// guard and the simulator's writes both live by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteLife {
    token: u64,
    settle_ms: u64,
    phase: Phase,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Sent (or about to be), no answer yet.
    Awaiting,
    /// Answered; its response body holds newer terms back until then at
    /// the latest.
    Streaming { until_ms: u64 },
    /// Over, and counted so.
    Done,
}

/// What the end of a write leaves behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    /// Waiting writes must look again.
    pub wake: bool,
    /// Its outcome is unknown: it holds newer terms back until then, and
    /// the store counts it settling until then too (`None`: its outcome is
    /// known, or there is no settle time).
    pub settles_at_ms: Option<u64>,
}

/// Until when the store counts writes of unknown outcome settling (a
/// handover waits for it, `cluster::handover_drained`), after one more
/// that settles at `settles_at_ms`: the later of the two.
pub fn settling_until(until_ms: u64, settles_at_ms: u64) -> u64 {
    until_ms.max(settles_at_ms)
}

impl WriteLife {
    /// A write of `token` just counted by [`Inflight::add`]; `settle_ms`:
    /// how long the backend may take to apply a write after fencegate
    /// stopped waiting for it.
    pub fn new(token: u64, settle_ms: u64) -> Self {
        Self {
            token,
            settle_ms,
            phase: Phase::Awaiting,
        }
    }

    /// The write's token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Whether the write has ended (finished or abandoned).
    pub fn is_over(&self) -> bool {
        self.phase == Phase::Done
    }

    /// The backend answered at `now_ms` (the response head) and a body
    /// follows: from now on the write holds back newer terms only until the
    /// body ends or the settle time has passed, whichever comes first, so a
    /// client that stops reading cannot hold the next term. Returns whether
    /// waiting writes must be woken.
    pub fn answered(&mut self, inflight: &mut Inflight, now_ms: u64) -> bool {
        if self.phase != Phase::Awaiting {
            return false;
        }
        let until_ms = now_ms.saturating_add(self.settle_ms);
        self.phase = Phase::Streaming { until_ms };
        inflight.answered(self.token, until_ms)
    }

    /// The write is complete (its whole response has arrived): it stops
    /// counting at once. `None` if it had ended already.
    pub fn finish(&mut self, inflight: &mut Inflight) -> Option<Ended> {
        self.end(inflight, 0)
    }

    /// The write ends at `now_ms` with its outcome unknown (the upstream
    /// timed out, a connection broke, the client went away): the backend
    /// may still apply it, so it holds back newer terms for the settle
    /// time, from now or, once answered, from the answer. `None` if it had
    /// ended already.
    pub fn abandon(&mut self, inflight: &mut Inflight, now_ms: u64) -> Option<Ended> {
        let settles_at_ms = match self.phase {
            Phase::Done => return None,
            _ if self.settle_ms == 0 || planted(Mutant::AbandonedWriteSettled) => 0,
            Phase::Awaiting => now_ms.saturating_add(self.settle_ms),
            Phase::Streaming { until_ms } => until_ms,
        };
        self.end(inflight, settles_at_ms)
    }

    fn end(&mut self, inflight: &mut Inflight, settles_at_ms: u64) -> Option<Ended> {
        let streaming = match self.phase {
            Phase::Done => return None,
            Phase::Awaiting => false,
            Phase::Streaming { .. } => true,
        };
        self.phase = Phase::Done;
        let wake = inflight.remove(self.token, streaming, settles_at_ms);
        Some(Ended {
            wake,
            settles_at_ms: (settles_at_ms != 0).then_some(settles_at_ms),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked(older_token: u64, until_ms: Option<u64>) -> Option<Blocked> {
        Some(Blocked {
            older_token,
            until_ms,
        })
    }

    #[test]
    fn counts_by_term() {
        let mut f = Inflight::default();
        assert_eq!(f.older_than(5, 0), None);
        f.add(3);
        f.add(3);
        f.add(5);
        assert_eq!(f.older_than(5, 0), blocked(3, None));
        assert_eq!(f.older_than(3, 0), None);
        assert_eq!(f.older_than(9, 0), blocked(5, None));
        assert_eq!(f.len(), 3);
        assert!(!f.remove(3, false, 0), "one write of term 3 is left");
        assert!(
            !f.remove(3, false, 0),
            "term 3 drained, but nobody waits: no wake-up"
        );
        assert_eq!(f.older_than(5, 0), None);
        f.add(3);
        f.note_waiter();
        assert!(
            f.remove(3, false, 0),
            "term 3 drained with a waiter: wake it"
        );
        assert!(!f.remove(7, false, 0), "unknown terms are ignored");
        assert!(!f.remove(5, false, 0), "the waiter was woken already");
        assert!(f.is_empty());
    }

    #[test]
    fn an_answered_write_holds_back_newer_terms_only_for_the_settle_time() {
        let mut f = Inflight::default();
        f.add(1);
        f.note_waiter();
        // The head arrives at 100; the body may stream until 1100.
        assert!(f.answered(1, 1100), "the waiter can now count on the clock");
        assert_eq!(f.older_than(2, 100), blocked(1, Some(1100)));
        assert_eq!(f.older_than(2, 1099), blocked(1, Some(1100)));
        assert_eq!(f.older_than(2, 1100), None, "a client that does not read");
        // The body ends later: nothing is left.
        assert!(!f.remove(1, true, 0));
        assert!(f.is_empty());
        // A body that ends early ends the wait early.
        f.add(1);
        f.answered(1, 5000);
        f.remove(1, true, 0);
        assert_eq!(f.older_than(2, 0), None);
    }

    #[test]
    fn a_write_s_life_holds_newer_terms_back_as_long_as_its_outcome_may_be_unknown() {
        let mut f = Inflight::default();
        // Abandoned before an answer: the settle time from then.
        f.add(1);
        let mut w = WriteLife::new(1, 500);
        let ended = w.abandon(&mut f, 100).expect("it was in flight");
        assert_eq!(ended.settles_at_ms, Some(600));
        assert_eq!(f.older_than(2, 599), blocked(1, Some(600)));
        assert_eq!(w.abandon(&mut f, 700), None, "it ends once");
        // Answered at 1000, then abandoned: the settle time from the answer.
        f.add(3);
        let mut w = WriteLife::new(3, 500);
        w.answered(&mut f, 1000);
        assert_eq!(
            w.abandon(&mut f, 1400).map(|e| e.settles_at_ms),
            Some(Some(1500))
        );
        // Finished: nothing lingers.
        f.add(5);
        let mut w = WriteLife::new(5, 500);
        w.answered(&mut f, 2000);
        assert_eq!(w.finish(&mut f).map(|e| e.settles_at_ms), Some(None));
        assert_eq!(f.older_than(6, 2000), None);
        // No settle time: an unknown outcome holds nothing back.
        f.add(7);
        let mut w = WriteLife::new(7, 0);
        assert_eq!(w.abandon(&mut f, 3000).map(|e| e.settles_at_ms), Some(None));
        assert!(f.is_settled(3000));
    }

    #[test]
    fn an_unknown_outcome_lingers_for_the_settle_time() {
        let mut f = Inflight::default();
        f.add(1);
        f.add(1);
        f.remove(1, false, 700);
        assert_eq!(f.older_than(2, 0), blocked(1, None), "one still awaits");
        f.remove(1, false, 500);
        assert_eq!(f.older_than(2, 0), blocked(1, Some(700)));
        assert_eq!(f.len(), 0, "lingering writes are not in flight");
        assert_eq!(f.older_than(2, 700), None);
        assert!(f.terms.is_empty(), "done terms are dropped");
    }
}
