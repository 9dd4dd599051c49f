//! Writes in flight, counted by term: the bookkeeping behind the handover
//! guarantee. Pure data, no locks or time; the lease store owns one per lease.

/// Admitted, unfinished writes of one lease, by token.
///
/// Almost always empty or one entry (the current term); during a handover the
/// previous term's stragglers appear beside the new term's first writes.
#[derive(Debug, Default)]
pub struct Inflight {
    terms: Vec<(u64, u32)>,
    /// Whether a newer term's write is waiting for a term to drain, so that
    /// finishing writes only pay for a wake-up when someone listens.
    waiters: bool,
}

impl Inflight {
    /// The newest term older than `token` with writes in flight, if any.
    pub fn older_than(&self, token: u64) -> Option<u64> {
        self.terms
            .iter()
            .filter(|(t, _)| *t < token)
            .map(|(t, _)| *t)
            .max()
    }

    /// Notes that a write waits for an older term to drain.
    pub fn note_waiter(&mut self) {
        self.waiters = true;
    }

    /// Counts one more write of `token` in flight.
    pub fn add(&mut self, token: u64) {
        match self.terms.iter_mut().find(|(t, _)| *t == token) {
            Some((_, n)) => *n += 1,
            None => self.terms.push((token, 1)),
        }
    }

    /// Counts one write of `token` finished. Returns whether waiting writes
    /// must be woken: that was the last write of its term in flight and a
    /// write was waiting (waiters that still must wait note themselves again).
    pub fn remove(&mut self, token: u64) -> bool {
        let Some(i) = self.terms.iter().position(|(t, _)| *t == token) else {
            return false;
        };
        self.terms[i].1 -= 1;
        if self.terms[i].1 == 0 {
            self.terms.swap_remove(i);
            std::mem::take(&mut self.waiters)
        } else {
            false
        }
    }

    /// Writes in flight, all terms together.
    pub fn len(&self) -> u64 {
        self.terms.iter().map(|(_, n)| u64::from(*n)).sum()
    }

    /// Whether no write is in flight.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_term() {
        let mut f = Inflight::default();
        assert_eq!(f.older_than(5), None);
        f.add(3);
        f.add(3);
        f.add(5);
        assert_eq!(
            (f.older_than(5), f.older_than(3), f.older_than(9)),
            (Some(3), None, Some(5))
        );
        assert_eq!(f.len(), 3);
        assert!(!f.remove(3), "one write of term 3 is left");
        assert!(!f.remove(3), "term 3 drained, but nobody waits: no wake-up");
        assert_eq!(f.older_than(5), None);
        f.add(3);
        f.note_waiter();
        assert!(f.remove(3), "term 3 drained with a waiter: wake it");
        assert!(!f.remove(7), "unknown terms are ignored");
        assert!(!f.remove(5), "the waiter was woken already");
        assert!(f.is_empty());
    }
}
