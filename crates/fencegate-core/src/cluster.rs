//! Cluster mode's rules, on the member's clock: how long a primary may
//! admit after etcd last confirmed its primacy (self-fencing), when a
//! member campaigns for a shard, when a handover may be recorded as clean
//! and when a takeover may trust it, and
//! what a member's check of its clock against etcd's concludes. The
//! member's shell (`fencegate::cluster`) talks to etcd and calls these.

use crate::lease::restart::RestartRule;
use crate::mutant::{planted, Mutant};

/// Until when a primary may admit, after etcd confirmed its election lease
/// by a grant or keepalive sent at `sent_ms` (the member's clock) with a
/// TTL of `ttl_s` seconds: the TTL from the send (etcd counts from when it
/// received it, later), less `margin_ms` for the member's clock running
/// slower than etcd's within the clock check's tolerance. So the deadline
/// passes before etcd can let the election key go and another member win.
pub fn primacy_deadline(sent_ms: u64, ttl_s: i64, margin_ms: u64) -> u64 {
    let ttl_ms = u64::try_from(ttl_s).unwrap_or(0).saturating_mul(1000);
    let margin_ms = if planted(Mutant::SelfFencingMarginZero) {
        0
    } else {
        margin_ms
    };
    sent_ms.saturating_add(ttl_ms).saturating_sub(margin_ms)
}

/// The deadline after etcd confirmed primacy until `confirmed_ms`
/// ([`primacy_deadline`]) while it was held until `until_ms`: the later
/// one. Confirmations may come back out of order, and an older one must
/// not cut the term of primacy short (moving back would be safe, only less
/// available).
pub fn primacy_confirmed(until_ms: u64, confirmed_ms: u64) -> u64 {
    until_ms.max(confirmed_ms)
}

/// Whether a primary handing a shard over (or stopping), its primacy
/// revoked, may record the handover as clean at `now_ms`: only once none
/// of its admitted writes is unfinished (`in_flight`: awaiting or
/// streaming its answer), none whose outcome became unknown is still
/// settling (until `settling_until_ms`: the storage may still apply it),
/// and its own takeover window is over (`window_until_ms`: a write of the
/// primary before it may still be on its way). The next primary then
/// admits newer terms at once instead of waiting out a takeover window of
/// its own.
pub fn handover_drained(
    in_flight: u64,
    now_ms: u64,
    settling_until_ms: u64,
    window_until_ms: u64,
) -> bool {
    let settled = now_ms >= settling_until_ms || planted(Mutant::HandoverIgnoresSettling);
    (in_flight == 0 && settled && now_ms >= window_until_ms) || planted(Mutant::HandoverUndrained)
}

/// How often a member with etcd leases of `ttl_ms` renews them and checks
/// its clock: three times a TTL, within 100 ms to 1 s.
pub fn beat_ms(ttl_ms: u64) -> u64 {
    (ttl_ms / 3).clamp(100, 1000)
}

/// How often a member looks at a shard's election key it does not hold: a
/// dead primary's key is gone at most a TTL after its last renewal, and is
/// seen gone within this much more (a tenth of the TTL, within 100 to
/// 500 ms).
pub fn poll_ms(ttl_ms: u64) -> u64 {
    (ttl_ms / 10).clamp(100, 500)
}

/// What a member knows of one shard when it decides whether to campaign
/// for it ([`may_campaign`]).
#[derive(Clone, Copy, Debug)]
pub struct CampaignView<'a> {
    /// Its clock agreed with etcd's (the clock check).
    pub clock_trusted: bool,
    /// etcd keeps the member's number of shards for the prefix.
    pub shards_checked: bool,
    pub shards: u32,
    /// The member's own name.
    pub me: &'a str,
    /// The member the balanced assignment gives the shard to, among the
    /// members whose clocks are trusted.
    pub assigned: Option<&'a str>,
    /// Since when (the member's clock) the shard has had no primary, while
    /// it has none.
    pub vacant_since_ms: Option<u64>,
    /// The last member seen leading the shard.
    pub last_primary: Option<&'a str>,
    pub now_ms: u64,
    pub ttl_ms: u64,
    /// How many shards the member leads, and the most one member should.
    pub led: usize,
    pub share: usize,
}

/// Whether a member campaigns for a shard now: its clock trusted, the
/// number of shards agreed with etcd, and (with several shards) the shard
/// assigned to it; or assigned to it among the others once the member the
/// shard is assigned to lost it (it was the last seen leading it: dead, or
/// stepped down), so a dead member's shards move as soon as its keys are
/// gone; or without a primary for a TTL while the member leads fewer than
/// its share. `assigned_without(owner)`: the member the assignment gives
/// the shard to without `owner` (asked only then).
pub fn may_campaign(
    view: &CampaignView<'_>,
    assigned_without: impl FnOnce(&str) -> Option<String>,
) -> bool {
    if !view.clock_trusted || !view.shards_checked {
        return false;
    }
    if view.shards == 1 || view.assigned == Some(view.me) {
        return true;
    }
    let Some(since) = view.vacant_since_ms else {
        return false;
    };
    if let Some(owner) = view.assigned.filter(|o| view.last_primary == Some(*o)) {
        if assigned_without(owner).as_deref() == Some(view.me) {
            return true;
        }
    }
    view.now_ms.saturating_sub(since) >= view.ttl_ms && view.led < view.share
}

/// At takeover: whether the previous primary handed the shard over
/// cleanly, so that no write of its can still reach the storage. It did
/// if it recorded, while it still held the election, that its writes had
/// all finished (`handed_over`, from [`handover_drained`]) for the very
/// election recorded when it won (`elected`): a record left by an earlier
/// primary says nothing of the last one.
pub fn takeover_clean(elected: Option<&[u8]>, handed_over: Option<&[u8]>) -> bool {
    match (elected, handed_over) {
        (Some(e), Some(h)) => e == h || planted(Mutant::HandoverAssumedClean),
        _ => false,
    }
}

/// The restart rule a new primary serves under: lease ids as their
/// digests (etcd keeps no id), tokens of leases it does not load above
/// `forgotten_above` (the etcd journal's mark), and a takeover window of
/// `unsettled_ms` (the time an unfinished write of the previous primary may
/// still take to reach the storage: the upstream timeout and the settle
/// time), none after a clean handover ([`takeover_clean`]).
pub fn takeover_rule(clean: bool, unsettled_ms: u64, forgotten_above: u64) -> RestartRule {
    RestartRule {
        unsettled_ms: if clean { 0 } else { unsettled_ms },
        hashed_ids: true,
        forgotten_above,
        ..RestartRule::default()
    }
}

/// Whether a primary confirmed until `until_ms` may admit at `now_ms`:
/// never once its primacy was revoked, and (with self-fencing, `enforce`)
/// only before the deadline.
pub fn primacy_admits(now_ms: u64, until_ms: u64, revoked: bool, enforce: bool) -> bool {
    !revoked && (!enforce || now_ms < until_ms)
}

/// A second etcd lease, never renewed, against whose countdown the member
/// checks its own clock: self-fencing trusts that clock, and etcd's is the
/// one that expires the election key (a primary whose clock runs slow
/// would go on admitting after another member won).
#[derive(Clone, Copy, Debug)]
pub struct ClockProbe {
    /// The etcd lease id.
    pub id: i64,
    /// The TTL etcd granted, in seconds.
    pub ttl_s: i64,
    /// When its grant was sent and answered (the member's clock).
    pub sent_ms: u64,
    pub answered_ms: u64,
}

/// What one look at a [`ClockProbe`] says of this member's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockVerdict {
    /// Within the tolerance, over a span of at least `span_ms`.
    Agrees { span_ms: u64 },
    /// etcd counted at least `behind_ms` more than this clock did.
    Slow { behind_ms: u64 },
    /// This clock counted at least `ahead_ms` more than etcd did (safe: the
    /// member only stops early; said, not acted on).
    Fast { ahead_ms: u64 },
}

impl ClockProbe {
    /// Judges the clock from etcd's answer that the probe has `left_s`
    /// whole seconds left, asked at `asked_ms` and answered at
    /// `answered_ms`. etcd counted between its grant and its answer
    /// somewhere in `(ttl - left - 1 s, ttl - left]`; a right clock counted
    /// between `asked - grant answered` and `answered - grant sent`. Only a
    /// gap beyond both bounds and `tolerance_ms` is a verdict, so slow
    /// networks never make one.
    pub fn judge(
        &self,
        left_s: i64,
        asked_ms: u64,
        answered_ms: u64,
        tolerance_ms: u64,
    ) -> ClockVerdict {
        let counted_s = u64::try_from(self.ttl_s.saturating_sub(left_s)).unwrap_or(0);
        let etcd_max_ms = counted_s.saturating_mul(1000);
        let etcd_min_ms = etcd_max_ms.saturating_sub(1000);
        let local_min_ms = asked_ms.saturating_sub(self.answered_ms);
        let local_max_ms = answered_ms.saturating_sub(self.sent_ms);
        if etcd_min_ms > local_max_ms.saturating_add(tolerance_ms) {
            ClockVerdict::Slow {
                behind_ms: etcd_min_ms - local_max_ms,
            }
        } else if local_min_ms > etcd_max_ms.saturating_add(tolerance_ms) {
            ClockVerdict::Fast {
                ahead_ms: local_min_ms - etcd_max_ms,
            }
        } else {
            ClockVerdict::Agrees {
                span_ms: local_min_ms,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard_of_b(me: &str) -> CampaignView<'_> {
        CampaignView {
            clock_trusted: true,
            shards_checked: true,
            shards: 4,
            me,
            assigned: Some("b"),
            vacant_since_ms: None,
            last_primary: Some("b"),
            now_ms: 10_000,
            ttl_ms: 3_000,
            led: 1,
            share: 2,
        }
    }

    #[test]
    fn a_member_campaigns_for_its_own_shards_and_for_those_a_lost_member_leaves() {
        let never = |_: &str| -> Option<String> { panic!("not asked") };
        // Its own shard; with one shard, every member campaigns.
        assert!(may_campaign(&shard_of_b("b"), never));
        let one = CampaignView {
            shards: 1,
            assigned: None,
            ..shard_of_b("a")
        };
        assert!(may_campaign(&one, never));
        // Never before its clock and the number of shards are checked.
        for view in [
            CampaignView {
                clock_trusted: false,
                ..one
            },
            CampaignView {
                shards_checked: false,
                ..shard_of_b("b")
            },
        ] {
            assert!(!may_campaign(&view, never));
        }
        // Another member's shard, led: not while it has a primary.
        assert!(!may_campaign(&shard_of_b("a"), never));
        // Vacant, and its owner was the last to lead it: the member the
        // assignment gives it to without the owner takes it at once.
        let vacant = CampaignView {
            vacant_since_ms: Some(9_000),
            ..shard_of_b("a")
        };
        assert!(may_campaign(&vacant, |owner| {
            assert_eq!(owner, "b");
            Some("a".into())
        }));
        assert!(!may_campaign(&vacant, |_| Some("c".into())));
        // Vacant for a TTL: any member below its share.
        let long = CampaignView {
            vacant_since_ms: Some(7_000),
            last_primary: Some("c"),
            ..shard_of_b("a")
        };
        assert!(may_campaign(&long, never));
        assert!(!may_campaign(&CampaignView { led: 2, ..long }, never));
        assert!(!may_campaign(
            &CampaignView {
                vacant_since_ms: Some(7_001),
                ..long
            },
            never
        ));
    }

    #[test]
    fn the_deadline_is_the_ttl_from_the_send_less_the_margin() {
        assert_eq!(primacy_deadline(1_000, 3, 500), 3_500);
        assert_eq!(primacy_deadline(0, 0, 500), 0);
        assert!(primacy_admits(3_499, 3_500, false, true));
        assert!(!primacy_admits(3_500, 3_500, false, true));
        assert!(primacy_admits(9_999, 3_500, false, false));
        assert!(!primacy_admits(0, 3_500, true, false));
    }

    #[test]
    fn a_handover_is_clean_only_with_nothing_unfinished_or_settling() {
        assert!(handover_drained(0, 10, 10, 10));
        assert!(!handover_drained(1, 10, 0, 0), "a write in flight");
        assert!(
            !handover_drained(0, 10, 11, 0),
            "a write of unknown outcome settling"
        );
        assert!(!handover_drained(0, 10, 0, 11), "the takeover window open");
    }

    #[test]
    fn a_takeover_trusts_only_its_predecessors_record() {
        assert!(takeover_clean(Some(b"7"), Some(b"7")));
        assert!(!takeover_clean(Some(b"8"), Some(b"7")), "an older record");
        assert!(!takeover_clean(Some(b"7"), None));
        assert!(!takeover_clean(None, None), "the first election");
        assert_eq!(takeover_rule(true, 31_000, 9).unsettled_ms, 0);
        let rule = takeover_rule(false, 31_000, 9);
        assert_eq!((rule.unsettled_ms, rule.forgotten_above), (31_000, 9));
        assert!(rule.hashed_ids && !rule.lost_records);
    }

    /// A probe of 60 s granted between 0 and 10 ms on this member's clock.
    const PROBE: ClockProbe = ClockProbe {
        id: 1,
        ttl_s: 60,
        sent_ms: 0,
        answered_ms: 10,
    };

    #[test]
    fn a_clock_that_keeps_etcds_time_agrees() {
        // 10 s later by both clocks: etcd has 50 s left (rounded down).
        assert_eq!(
            PROBE.judge(50, 10_000, 10_010, 500),
            ClockVerdict::Agrees { span_ms: 9_990 }
        );
        // Slow answers widen the bounds, never make a verdict.
        assert!(matches!(
            PROBE.judge(45, 10_000, 15_000, 500),
            ClockVerdict::Agrees { .. }
        ));
        // etcd's whole seconds: 49 s left (10 to 11 s counted) after 10 s
        // here is within them; 48 s left is a second behind.
        assert!(matches!(
            PROBE.judge(49, 10_000, 10_010, 500),
            ClockVerdict::Agrees { .. }
        ));
        assert_eq!(
            PROBE.judge(48, 10_000, 10_010, 500),
            ClockVerdict::Slow { behind_ms: 990 }
        );
    }

    /// The trial's clock at 0.4 of etcd's rate: 2.5 s of etcd's time
    /// while 1 s passed here is seen; 10 s of etcd's against 4 s here is
    /// 5 s behind at least.
    #[test]
    fn a_slow_clock_is_caught() {
        assert_eq!(
            PROBE.judge(50, 4_000, 4_010, 500),
            ClockVerdict::Slow { behind_ms: 4_990 }
        );
        assert_eq!(
            PROBE.judge(57, 1_000, 1_010, 500),
            ClockVerdict::Slow { behind_ms: 990 }
        );
        assert!(matches!(
            PROBE.judge(57, 1_000, 1_010, 1_000),
            ClockVerdict::Agrees { .. }
        ));
    }

    #[test]
    fn a_fast_clock_is_told_apart() {
        assert_eq!(
            PROBE.judge(50, 20_000, 20_010, 500),
            ClockVerdict::Fast { ahead_ms: 9_990 }
        );
    }
}
