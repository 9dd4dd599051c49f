//! Planted bugs: each one a known way to break fencing, kept switchable so
//! the tests can prove they catch it (the simulator in `fencegate-sim`, the
//! power-cut and shard tests of the real binary).
//!
//! Without the `mutants` feature [`planted`] is a constant `false` and the
//! compiler removes every check. With it, one mutant at a time is planted
//! for the whole process ([`plant`]): a test binary that plants one runs
//! its tests one after another.

/// A planted bug and where it sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// The handover barrier admits a newer term's write while an older
    /// term's is still unfinished ([`crate::lease::admission::barrier`]).
    BarrierOff,
    /// A later term's writes are admitted during the restart window
    /// ([`crate::lease::restart::restart_holds_back`]).
    RestartWindowSkipped,
    /// The journal's header (its durable length) goes to the disk with the
    /// batch it describes, in one sync ([`crate::journal::append`]): a
    /// power cut can keep the header and lose the batch.
    HeaderBeforeSync,
    /// A start trusts a log whose valid records end before its durable
    /// length ([`crate::journal::recovery::intact`]).
    TornTailTrusted,
    /// A start after lost records keeps the recovered terms alive
    /// ([`crate::journal::recovery::after_loss`]).
    LostRecordsKeepTerms,
    /// Recovered leases ignore the token floor
    /// ([`crate::lease::restart::restore`]).
    TokenFloorIgnored,
    /// Replay skips release records ([`crate::journal::record::Record::apply`]),
    /// and the etcd journal's state ignores releases
    /// ([`crate::journal::stored::StoredLease::release`]).
    ReplayDropsReleases,
    /// A term is still live at its deadline
    /// ([`crate::lease::machine::LeaseState::check`]).
    ExpiryInclusive,
    /// A recovered term is held for no time at all after a restart
    /// ([`crate::lease::restart::restore`]): the restart rule off.
    RestartRuleOff,
    /// A primary admits until its etcd lease's TTL has passed on its own
    /// clock, with no margin for that clock running slow
    /// ([`crate::cluster::primacy_deadline`]).
    SelfFencingMarginZero,
    /// Renewals never refresh the journal's wall-clock hint
    /// ([`crate::lease::restart::wall_hint_due`]): a start ends a renewed,
    /// live term by its grant's hint.
    HintsNeverDue,
    /// A primary handing a shard over records it as clean without waiting
    /// for its writes in flight ([`crate::cluster::handover_drained`]): the
    /// next primary skips its takeover window while they are unfinished.
    HandoverUndrained,
    /// A write on a precondition route whose key's state is known goes
    /// without the precondition that names it
    /// ([`crate::precondition::KeyStates::plan_write`]).
    PreconditionDropped,
    /// A write the storage refused is taken as applied: a refused `DELETE`
    /// teaches that the key is absent, a refused write the tag its answer
    /// carries ([`crate::precondition::KeyStates::learn`]).
    RefusedWriteTeaches,
    /// A member that takes over keeps the key states it learned in an
    /// earlier primacy ([`crate::precondition::KeyStates::take_over`]).
    StatesKeptAcrossTakeover,
    /// A batch whose grant or release someone waits for is not synced
    /// before they are answered ([`crate::journal::writer::batch_syncs`]):
    /// a power cut takes an acknowledged term or release.
    AwaitedNotSynced,
    /// A change of identity gives the log its new identity before the meta
    /// file names it ([`crate::journal::writer::change_identity`]): a crash
    /// between the two leaves a log the meta file does not name, which a
    /// start must take for one that lost records.
    IdentityNamedLate,
    /// A primary handing over records it as clean while a write whose
    /// outcome is unknown is still settling
    /// ([`crate::cluster::handover_drained`]): the storage applies it after
    /// the next primary's newer term wrote.
    HandoverIgnoresSettling,
    /// A new primary takes any handover record for a clean handover, even
    /// one left by an earlier primary than the last
    /// ([`crate::cluster::takeover_clean`]).
    HandoverAssumedClean,
    /// A lease is forgotten while a write of it is in flight or of unknown
    /// outcome still settling ([`crate::lease::retention::Sweep::may_forget`]):
    /// its next term starts with nothing holding it back.
    ForgottenWhileSettling,
    /// A write abandoned with its outcome unknown holds nothing back
    /// ([`crate::lease::inflight::WriteLife::abandon`]): the next term
    /// writes while the storage may still apply it.
    AbandonedWriteSettled,
    /// A forgotten lease's state leaves the loaded state without raising
    /// the mark above its tokens ([`crate::journal::stored::StoredState::apply`]):
    /// after a takeover its tokens start again from nothing.
    ForgottenMarkDropped,
    /// A release is recorded as quiet while writes of its own term are
    /// still unfinished ([`crate::lease::admission::quiet`]): after a
    /// restart the next term does not wait for them.
    ReleaseQuietOverOwnWrites,
    /// Forgetting a lease leaves the mark one below its last token
    /// ([`crate::lease::retention::forgotten_mark`]): its next term
    /// reissues a token.
    ForgetMarkBelowLastToken,
    /// A grant's answer promises its whole TTL, though the time spent
    /// persisting it has passed on the term
    /// ([`crate::lease::machine::Grant::expires_in_ms`]).
    PersistTimePromised,
    /// Nobody waits for a release's record
    /// ([`crate::journal::record::awaited`]): the release is answered at
    /// once, its batch not synced, and a power cut brings the released term
    /// back.
    ReleaseLazy,
    /// Forgetting a lease (in the store, in a replay, in etcd's state) sets
    /// the mark every lease not kept continues above to that lease's own,
    /// lowering it ([`crate::journal::record::forgotten_above`]): a lease
    /// forgotten before reissues tokens.
    ForgottenAboveLowered,
    /// A DELETE of a key seen absent goes with `If-None-Match: *`, which
    /// S3's DeleteObject does not evaluate
    /// ([`crate::precondition::KeyStates::plan_write`]): a late one removes
    /// what a later term wrote.
    DeleteOfAbsentConditioned,
    /// A write is sorted as one that changes no key by its query's
    /// parameter names, whatever its method
    /// ([`crate::precondition::Operation::of`]): `PUT ?uploads` and `DELETE
    /// ?acl`, which the storage executes as PutObject and DeleteObject, go
    /// with no precondition.
    AsideByName,
    /// A client's own precondition is passed on whatever it names
    /// ([`crate::precondition::Own::protects`]): `If-None-Match: "x"` on a
    /// PUT or `If-Match: *` on a DELETE, which protect nothing.
    OwnPreconditionTrusted,
    /// A read teaches the key's state whatever its query
    /// ([`crate::precondition::reads_the_key`]): a read of a missing version
    /// (`?versionId=…`, or `?version%49d=…`) teaches that the key is absent.
    ReadParamsIgnored,
    /// An etcd v3 write goes in a transaction that sets the lease's fence
    /// key without comparing it first
    /// ([`crate::body_keys::etcd::fenced`]): a late write of an old term
    /// lands after a later term's.
    EtcdCompareDropped,
    /// A DynamoDB write is taken without the token in its item and the
    /// condition on it ([`crate::body_keys::dynamodb::check`]): a late
    /// write of an old term lands after a later term's.
    DynamoConditionUnchecked,
    /// A grant is recorded as quiet without looking at the lease's writes
    /// in flight ([`crate::lease::slot::Slot::grant`]): after a restart
    /// the new term's writes do not wait for the older term's.
    GrantQuietOverOlderWrites,
    /// A renewal keeps its wall-clock hint before the journal took its
    /// record ([`crate::lease::slot::Slot::renew`]): a record dropped by a
    /// full queue is not due again, and a start ends the live term by the
    /// older hint.
    HintKeptUntaken,
    /// The sweep takes a term for ended one sweep
    /// ([`crate::lease::retention::SWEEP_EVERY_MS`]) before its deadline
    /// ([`crate::lease::slot::Slot::forget`]): a lease forgotten then is
    /// granted again while its term is live.
    SweepEndsTermEarly,
}

impl Mutant {
    /// Every mutant, in the order the tests try them.
    pub const ALL: [Mutant; 36] = [
        Mutant::BarrierOff,
        Mutant::RestartWindowSkipped,
        Mutant::HeaderBeforeSync,
        Mutant::TornTailTrusted,
        Mutant::LostRecordsKeepTerms,
        Mutant::TokenFloorIgnored,
        Mutant::ReplayDropsReleases,
        Mutant::ExpiryInclusive,
        Mutant::RestartRuleOff,
        Mutant::SelfFencingMarginZero,
        Mutant::HintsNeverDue,
        Mutant::HandoverUndrained,
        Mutant::PreconditionDropped,
        Mutant::RefusedWriteTeaches,
        Mutant::StatesKeptAcrossTakeover,
        Mutant::AwaitedNotSynced,
        Mutant::IdentityNamedLate,
        Mutant::HandoverIgnoresSettling,
        Mutant::HandoverAssumedClean,
        Mutant::ForgottenWhileSettling,
        Mutant::AbandonedWriteSettled,
        Mutant::ForgottenMarkDropped,
        Mutant::ReleaseQuietOverOwnWrites,
        Mutant::ForgetMarkBelowLastToken,
        Mutant::PersistTimePromised,
        Mutant::ReleaseLazy,
        Mutant::ForgottenAboveLowered,
        Mutant::DeleteOfAbsentConditioned,
        Mutant::AsideByName,
        Mutant::OwnPreconditionTrusted,
        Mutant::ReadParamsIgnored,
        Mutant::EtcdCompareDropped,
        Mutant::DynamoConditionUnchecked,
        Mutant::GrantQuietOverOlderWrites,
        Mutant::HintKeptUntaken,
        Mutant::SweepEndsTermEarly,
    ];

    /// The mutant's name on command lines and in `FENCEGATE_TEST_MUTANT`.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::BarrierOff => "barrier-off",
            Mutant::RestartWindowSkipped => "restart-window-skipped",
            Mutant::HeaderBeforeSync => "header-before-sync",
            Mutant::TornTailTrusted => "torn-tail-trusted",
            Mutant::LostRecordsKeepTerms => "lost-records-keep-terms",
            Mutant::TokenFloorIgnored => "token-floor-ignored",
            Mutant::ReplayDropsReleases => "replay-drops-releases",
            Mutant::ExpiryInclusive => "expiry-inclusive",
            Mutant::RestartRuleOff => "restart-rule-off",
            Mutant::SelfFencingMarginZero => "self-fencing-margin-zero",
            Mutant::HintsNeverDue => "hints-never-due",
            Mutant::HandoverUndrained => "handover-undrained",
            Mutant::PreconditionDropped => "precondition-dropped",
            Mutant::RefusedWriteTeaches => "refused-write-teaches",
            Mutant::StatesKeptAcrossTakeover => "states-kept-across-takeover",
            Mutant::AwaitedNotSynced => "awaited-not-synced",
            Mutant::IdentityNamedLate => "identity-named-late",
            Mutant::HandoverIgnoresSettling => "handover-ignores-settling",
            Mutant::HandoverAssumedClean => "handover-assumed-clean",
            Mutant::ForgottenWhileSettling => "forgotten-while-settling",
            Mutant::AbandonedWriteSettled => "abandoned-write-settled",
            Mutant::ForgottenMarkDropped => "forgotten-mark-dropped",
            Mutant::ReleaseQuietOverOwnWrites => "release-quiet-over-own-writes",
            Mutant::ForgetMarkBelowLastToken => "forget-mark-below-last-token",
            Mutant::PersistTimePromised => "persist-time-promised",
            Mutant::ReleaseLazy => "release-lazy",
            Mutant::ForgottenAboveLowered => "forgotten-above-lowered",
            Mutant::DeleteOfAbsentConditioned => "delete-of-absent-conditioned",
            Mutant::AsideByName => "aside-by-name",
            Mutant::OwnPreconditionTrusted => "own-precondition-trusted",
            Mutant::ReadParamsIgnored => "read-params-ignored",
            Mutant::EtcdCompareDropped => "etcd-compare-dropped",
            Mutant::DynamoConditionUnchecked => "dynamo-condition-unchecked",
            Mutant::GrantQuietOverOlderWrites => "grant-quiet-over-older-writes",
            Mutant::HintKeptUntaken => "hint-kept-untaken",
            Mutant::SweepEndsTermEarly => "sweep-ends-term-early",
        }
    }

    /// The mutant of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    #[cfg(feature = "mutants")]
    fn code(self) -> u8 {
        Self::ALL
            .iter()
            .position(|m| *m == self)
            .map_or(0, |i| i as u8 + 1)
    }
}

#[cfg(feature = "mutants")]
static PLANTED: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);

/// Plants `mutant` for the whole process (`None`: the code as written).
#[cfg(feature = "mutants")]
pub fn plant(mutant: Option<Mutant>) {
    PLANTED.store(
        mutant.map_or(0, Mutant::code),
        core::sync::atomic::Ordering::SeqCst,
    );
}

/// Whether `mutant` is planted: always `false` without the `mutants`
/// feature.
#[inline(always)]
pub fn planted(mutant: Mutant) -> bool {
    #[cfg(feature = "mutants")]
    {
        PLANTED.load(core::sync::atomic::Ordering::Relaxed) == mutant.code()
    }
    #[cfg(not(feature = "mutants"))]
    {
        let _ = mutant;
        false
    }
}
