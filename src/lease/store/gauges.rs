//! The store's gauges, kept up to date on each change so reading them costs
//! the same at one lease and at a million (a metrics scrape must not walk
//! every lease on a worker that serves requests).
//!
//! - [`LiveTerms`]: how many terms are live now. A term ends by time alone,
//!   so live terms are counted by the bucket of time their deadline falls
//!   in, on a ring as long as the longest TTL: a count is the sum of the
//!   buckets from now on.
//! - [`InflightCount`]: writes in flight, in a few cache-line-padded cells
//!   so writes of different leases rarely touch the same one.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// The most buckets the ring of [`LiveTerms`] has: a scrape sums at most
/// this many atomics, and longer TTLs get coarser buckets.
const MAX_BUCKETS: u64 = 16_384;

/// The finest bucket: a term counts as live until the end of the 100 ms in
/// which its deadline falls.
const MIN_BUCKET_MS: u64 = 100;

/// Live terms by the bucket of their deadline.
///
/// Each slot packs a bucket number (high 32 bits) and how many live terms'
/// deadlines fall in it (low 32 bits). A slot is taken over by a newer
/// bucket only once its own bucket is past (the ring is longer than the
/// longest TTL by two buckets), so every live term's bucket still holds it;
/// a term ended after its bucket was taken over is not subtracted from the
/// newer one.
#[derive(Debug)]
pub(super) struct LiveTerms {
    bucket_ms: u64,
    slots: Box<[AtomicU64]>,
}

impl LiveTerms {
    /// A ring for terms of at most `max_ttl_ms` from the moment they are
    /// counted.
    pub(super) fn new(max_ttl_ms: u64) -> Self {
        let bucket_ms = max_ttl_ms.div_ceil(MAX_BUCKETS).max(MIN_BUCKET_MS);
        let len = max_ttl_ms / bucket_ms + 3;
        Self {
            bucket_ms,
            slots: (0..len).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The precision of [`LiveTerms::count`]: a term counts as live until
    /// the end of the bucket its deadline falls in.
    pub(super) fn bucket_ms(&self) -> u64 {
        self.bucket_ms
    }

    fn slot(&self, deadline_ms: u64) -> (&AtomicU64, u32) {
        let bucket = deadline_ms / self.bucket_ms;
        let slot = &self.slots[(bucket % self.slots.len() as u64) as usize];
        // Bucket numbers wrap after 2^32 buckets (13 years at 100 ms); the
        // ring is far shorter, so the low bits tell buckets apart.
        (slot, bucket as u32)
    }

    /// A term whose deadline is `deadline_ms` became live.
    pub(super) fn add(&self, deadline_ms: u64) {
        let (slot, tag) = self.slot(deadline_ms);
        let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            let held = (v >> 32) as u32;
            let count = match held.wrapping_sub(tag) as i32 {
                0 => v as u32,
                // The slot holds a newer bucket: this deadline is long
                // past (a term put back after a refused grant), and counts
                // nowhere.
                newer if newer > 0 => return None,
                _ => 0,
            };
            Some(u64::from(tag) << 32 | u64::from(count.saturating_add(1)))
        });
    }

    /// A term whose deadline was `deadline_ms` ended (or moved).
    pub(super) fn remove(&self, deadline_ms: u64) {
        let (slot, tag) = self.slot(deadline_ms);
        let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            // Taken over by a newer bucket: the term was counted there no
            // longer.
            ((v >> 32) as u32 == tag)
                .then(|| v & !0xffff_ffff | u64::from((v as u32).saturating_sub(1)))
        });
    }

    /// A term's deadline moved from `before` to `after` (`None`: no live
    /// term).
    pub(super) fn track(&self, before: Option<u64>, after: Option<u64>) {
        if before == after {
            return;
        }
        if let Some(b) = before {
            self.remove(b);
        }
        if let Some(a) = after {
            self.add(a);
        }
    }

    /// Terms live at `now_ms` (counting those whose deadline falls in the
    /// current bucket).
    pub(super) fn count(&self, now_ms: u64) -> u64 {
        let now = (now_ms / self.bucket_ms) as u32;
        let len = self.slots.len() as u32;
        self.slots
            .iter()
            .map(|s| s.load(Ordering::Acquire))
            .filter(|v| ((v >> 32) as u32).wrapping_sub(now) < len)
            .map(|v| u64::from(v as u32))
            .sum()
    }
}

/// A counter on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Padded(AtomicI64);

/// Writes in flight, in cells chosen by the lease, summed when read.
#[derive(Debug, Default)]
pub(super) struct InflightCount {
    cells: [Padded; 8],
}

impl InflightCount {
    /// The cell of a lease whose write cell lives at `key` (its address).
    fn cell(&self, key: usize) -> &AtomicI64 {
        // Allocations are 16-byte aligned at least; mix in higher bits.
        &self.cells[(key >> 6 ^ key >> 12) % self.cells.len()].0
    }

    /// Sequentially consistent, as [`InflightCount::count`] and the
    /// primacy's revocation and check: a write admitted while a primary
    /// hands its shard over either sees the primacy revoked (and is
    /// refused) or is seen in flight by the handover's wait for it (the
    /// same instruction as a relaxed add on x86).
    pub(super) fn add(&self, key: usize) {
        self.cell(key).fetch_add(1, Ordering::SeqCst);
    }

    /// Release: what the finishing write stored before (when it settles)
    /// is seen by whoever sees it gone from the count.
    pub(super) fn remove(&self, key: usize) {
        self.cell(key).fetch_sub(1, Ordering::Release);
    }

    pub(super) fn count(&self) -> u64 {
        let sum: i64 = self.cells.iter().map(|c| c.0.load(Ordering::SeqCst)).sum();
        u64::try_from(sum).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_count_until_their_bucket_ends() {
        let t = LiveTerms::new(1_000);
        assert_eq!(t.bucket_ms(), 100);
        t.add(1_050);
        t.add(1_950);
        assert_eq!(t.count(1_000), 2);
        assert_eq!(t.count(1_099), 2);
        assert_eq!(t.count(1_100), 1);
        assert_eq!(t.count(1_999), 1);
        assert_eq!(t.count(2_000), 0);
        // A renewal moves a term; a release removes it.
        t.track(Some(1_950), Some(2_900));
        assert_eq!(t.count(2_000), 1);
        t.track(Some(2_900), None);
        assert_eq!(t.count(2_000), 0);
    }

    #[test]
    fn a_slot_taken_over_by_a_newer_bucket_forgets_the_old_one() {
        let t = LiveTerms::new(1_000); // 13 slots of 100 ms
        t.add(1_050); // bucket 10, slot 10
                      // Long after: bucket 23 takes over slot 10.
        t.add(2_350);
        assert_eq!(t.count(2_000), 1);
        // The old term ends late: the newer bucket keeps its count.
        t.remove(1_050);
        assert_eq!(t.count(2_000), 1);
        // Nothing below zero.
        t.remove(2_350);
        t.remove(2_350);
        assert_eq!(t.count(2_000), 0);
    }

    /// Seen failing before: a term long expired, put back after a refused
    /// grant, took over the slot of a newer bucket and wiped its count.
    #[test]
    fn a_long_past_deadline_never_takes_over_a_newer_bucket() {
        let t = LiveTerms::new(1_000); // 13 slots of 100 ms
        t.add(2_350); // bucket 23, slot 10
        t.add(1_050); // bucket 10, slot 10: long past
        assert_eq!(t.count(2_000), 1);
        t.remove(1_050);
        assert_eq!(t.count(2_000), 1);
    }

    #[test]
    fn long_ttls_get_coarser_buckets_not_longer_rings() {
        let t = LiveTerms::new(3_600_000);
        assert_eq!(t.bucket_ms(), 220);
        assert!(t.slots.len() as u64 <= MAX_BUCKETS + 3);
        t.add(3_600_000);
        assert_eq!(t.count(0), 1);
    }

    #[test]
    fn writes_in_flight_are_summed_over_cells() {
        let c = InflightCount::default();
        for key in [0usize, 64, 4096, 12_345_678] {
            c.add(key);
        }
        c.remove(64);
        assert_eq!(c.count(), 3);
    }
}
