//! The acquire rate limit: a token bucket per client. The bucket is pure
//! arithmetic on the proxy's milliseconds; [`ClientBuckets`] keeps one per
//! client, within a bound.
//!
//! The client is the authenticated caller when authentication is on, else
//! the address the request came from (an IPv6 address by its /64, what one
//! host usually has): a name the client picks, such as the holder's, would
//! give any rate to a client that varies it.

use std::net::IpAddr;

use compact_str::CompactString;
use dashmap::DashMap;

/// Most clients whose buckets are remembered; past it they all start full
/// again (a bound on memory, at the price of a burst).
const MAX_BUCKETS: usize = 100_000;

/// Whom an acquire counts against.
#[derive(Clone, Copy, Debug)]
pub enum Requester<'a> {
    /// An authenticated caller, by name.
    Caller(&'a str),
    /// A client by the address it connected from.
    Address(IpAddr),
    /// The holder named in the acquire: for callers inside the process
    /// (tests, tools), which have neither.
    Holder(&'a str),
}

/// A client's bucket key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum ClientKey {
    Name(CompactString),
    Ip(IpAddr),
}

impl ClientKey {
    fn of(requester: Requester<'_>) -> Self {
        match requester {
            Requester::Caller(name) | Requester::Holder(name) => Self::Name(name.into()),
            Requester::Address(IpAddr::V4(ip)) => Self::Ip(IpAddr::V4(ip)),
            Requester::Address(IpAddr::V6(ip)) => {
                // An IPv4 client seen on a dual-stack socket is itself.
                if let Some(v4) = ip.to_ipv4_mapped() {
                    return Self::Ip(IpAddr::V4(v4));
                }
                let net = u128::from(ip) & !((1u128 << 64) - 1);
                Self::Ip(IpAddr::V6(net.into()))
            }
        }
    }
}

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

    /// Whether the bucket is full again at `now_ms`: no different from a
    /// new one.
    fn is_full(&self, rate: u64, now_ms: u64) -> bool {
        let refill = now_ms.saturating_sub(self.at_ms).saturating_mul(rate);
        self.milli_tokens.saturating_add(refill) >= rate.saturating_mul(1000)
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

/// One bucket per client.
#[derive(Default)]
pub(super) struct ClientBuckets {
    buckets: DashMap<ClientKey, Bucket>,
}

impl ClientBuckets {
    /// Spends one of `requester`'s `rate` attempts per second at `now_ms`,
    /// or says in how many milliseconds one will be there. A `rate` of 0
    /// means no limit.
    pub(super) fn take(&self, requester: Requester<'_>, rate: u32, now_ms: u64) -> Result<(), u64> {
        let rate = u64::from(rate);
        if rate == 0 {
            return Ok(());
        }
        let key = ClientKey::of(requester);
        if self.buckets.len() >= MAX_BUCKETS && !self.buckets.contains_key(&key) {
            // Full buckets are as good as new ones: drop those first, and
            // everything only if every client is busy (a burst, at worst).
            self.buckets.retain(|_, b| !b.is_full(rate, now_ms));
            if self.buckets.len() >= MAX_BUCKETS {
                self.buckets.clear();
            }
        }
        self.buckets
            .entry(key)
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
    fn clients_have_buckets_of_their_own_and_zero_is_no_limit() {
        let buckets = ClientBuckets::default();
        let a = Requester::Caller("a");
        assert_eq!(buckets.take(a, 1, 0), Ok(()));
        assert_eq!(buckets.take(a, 1, 0), Err(1000));
        assert_eq!(buckets.take(Requester::Caller("b"), 1, 0), Ok(()));
        for _ in 0..10 {
            assert_eq!(buckets.take(Requester::Caller("c"), 0, 0), Ok(()));
        }
    }

    #[test]
    fn an_address_is_one_client_and_an_ipv6_host_is_its_64() {
        let buckets = ClientBuckets::default();
        let ip = |s: &str| Requester::Address(s.parse().unwrap());
        assert_eq!(buckets.take(ip("192.0.2.1"), 1, 0), Ok(()));
        assert_eq!(buckets.take(ip("::ffff:192.0.2.1"), 1, 0), Err(1000));
        assert_eq!(buckets.take(ip("192.0.2.2"), 1, 0), Ok(()));
        assert_eq!(buckets.take(ip("2001:db8:1:2::1"), 1, 0), Ok(()));
        assert_eq!(buckets.take(ip("2001:db8:1:2:ffff::9"), 1, 0), Err(1000));
        assert_eq!(buckets.take(ip("2001:db8:1:3::1"), 1, 0), Ok(()));
    }
}
