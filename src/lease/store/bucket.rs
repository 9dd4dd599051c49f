//! The acquire rate limit: a token bucket per holder. The bucket is pure
//! arithmetic on the proxy's milliseconds; [`HolderBuckets`] keeps one per
//! holder, within a bound.

use dashmap::DashMap;

/// Most holders whose buckets are remembered; past it they all start full
/// again (a bound on memory, at the price of a burst).
const MAX_BUCKETS: usize = 100_000;

/// A token bucket of attempts, in thousandths of an attempt: `rate`
/// attempts per second, a burst of one second's worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bucket {
    milli_tokens: u64,
    at_ms: u64,
}

impl Bucket {
    /// A full bucket at `now_ms`.
    fn full(rate: u64, now_ms: u64) -> Self {
        Self {
            milli_tokens: rate.saturating_mul(1000),
            at_ms: now_ms,
        }
    }

    /// Spends one attempt at `now_ms`, or says in how many milliseconds one
    /// will be there. `rate` is greater than 0.
    fn take(&mut self, rate: u64, now_ms: u64) -> Result<(), u64> {
        // `rate` attempts per 1000 ms is `rate` milli-attempts per ms.
        let refill = now_ms.saturating_sub(self.at_ms).saturating_mul(rate);
        self.milli_tokens = self
            .milli_tokens
            .saturating_add(refill)
            .min(rate.saturating_mul(1000));
        self.at_ms = self.at_ms.max(now_ms);
        if self.milli_tokens >= 1000 {
            self.milli_tokens -= 1000;
            Ok(())
        } else {
            Err((1000 - self.milli_tokens).div_ceil(rate))
        }
    }
}

/// One bucket per holder.
#[derive(Default)]
pub(super) struct HolderBuckets {
    buckets: DashMap<String, Bucket>,
}

impl HolderBuckets {
    /// Spends one of `holder`'s `rate` attempts per second at `now_ms`, or
    /// says in how many milliseconds one will be there. A `rate` of 0 means
    /// no limit.
    pub(super) fn take(&self, holder: &str, rate: u32, now_ms: u64) -> Result<(), u64> {
        let rate = u64::from(rate);
        if rate == 0 {
            return Ok(());
        }
        if self.buckets.len() >= MAX_BUCKETS && !self.buckets.contains_key(holder) {
            self.buckets.clear();
        }
        self.buckets
            .entry(holder.to_owned())
            .or_insert_with(|| Bucket::full(rate, now_ms))
            .take(rate, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_bucket_allows_one_seconds_burst_then_the_rate() {
        let mut bucket = Bucket::full(4, 0);
        for _ in 0..4 {
            assert_eq!(bucket.take(4, 0), Ok(()));
        }
        // Empty: one attempt refills in 250 ms.
        assert_eq!(bucket.take(4, 0), Err(250));
        assert_eq!(bucket.take(4, 249), Err(1));
        assert_eq!(bucket.take(4, 250), Ok(()));
        // Refilling stops at the burst.
        let mut bucket = Bucket::full(2, 0);
        assert_eq!(bucket.take(2, 1_000_000), Ok(()));
        assert_eq!(bucket.take(2, 1_000_000), Ok(()));
        assert!(bucket.take(2, 1_000_000).is_err());
    }

    #[test]
    fn the_wait_rounds_up() {
        let mut bucket = Bucket::full(3, 0);
        for _ in 0..3 {
            bucket.take(3, 0).unwrap();
        }
        // 1000 milli-attempts at 3 per ms: 334 ms, not 333.
        assert_eq!(bucket.take(3, 0), Err(334));
    }

    #[test]
    fn holders_have_buckets_of_their_own_and_zero_is_no_limit() {
        let buckets = HolderBuckets::default();
        assert_eq!(buckets.take("a", 1, 0), Ok(()));
        assert_eq!(buckets.take("a", 1, 0), Err(1000));
        assert_eq!(buckets.take("b", 1, 0), Ok(()));
        for _ in 0..10 {
            assert_eq!(buckets.take("c", 0, 0), Ok(()));
        }
    }
}
