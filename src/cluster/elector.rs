//! One shard's elector: campaigns for the shard's election key and serves
//! the shard's terms of primacy.
//!
//! Its life is a sequence of etcd sessions. Each session grants an etcd
//! lease and campaigns: a transaction creates the election key (attached
//! to the same lease) only if it does not exist. The winner loads the
//! shard's leases from the snapshot and log under the shard's prefix,
//! builds a fresh lease store and app on them, and serves. It keeps its
//! etcd lease alive; each confirmed keepalive moves its [`Primacy`]
//! deadline to the keepalive's send time plus the TTL etcd granted, minus a
//! margin, on the proxy's clock, so the deadline passes before etcd can let
//! the election key go. Past the deadline, or when etcd says the lease is
//! gone, or when a write of lease state fails, or when the presence task
//! finds the clock slow, the member steps down: its primacy is revoked
//! (nothing more reaches the backend), its app is dropped, and a new
//! session starts from what etcd holds. A primary whose shard the balanced
//! assignment gives to another member hands it over: primacy revoked, its
//! writes in flight given up to 2 s to finish (if they did, none whose
//! outcome is unknown is still settling, and its own takeover window is
//! over, the handover is recorded as clean in etcd),
//! then its etcd lease revoked so the key goes at once. Losers poll the
//! key and campaign again when it is gone.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::etcd::{Compare, EtcdClient, EtcdError, Op};
use crate::lease::{LeaseStore, Primacy};
use fencegate_core::cluster::{
    may_campaign, primacy_deadline, takeover_clean, takeover_rule, CampaignView,
};

use super::journal::{self, Election, EtcdJournal, Limits};
use super::{in_session, ClusterOptions, MakeApp, Member, Peer, SessionError, Takeover};

/// An etcd lease as this member last confirmed it.
#[derive(Clone, Copy, Debug)]
struct Session {
    id: i64,
    /// When the last confirmed grant or keepalive was sent (proxy clock).
    sent_ms: u64,
    /// The TTL etcd granted then, in seconds.
    ttl_s: i64,
}

/// Why a term of primacy ended.
enum Ended {
    /// Handed over to the member the assignment gives the shard to.
    HandedOver(String),
    /// The process is stopping.
    Stopping,
    /// Lost: why.
    Lost(SessionError),
}

/// How long a primary handing a shard over (or stopping) waits for its
/// writes in flight before it lets the shard go anyway: the shard has no
/// primary meanwhile, and the next one's takeover window holds back only
/// the leases such a write may be of, so it is kept short (and within the
/// 5 s the process gives its members to leave).
const DRAIN_MS: u64 = 2_000;

pub(super) struct Elector<S> {
    client: EtcdClient,
    options: ClusterOptions,
    clock: Clock,
    make_app: MakeApp<S>,
    member: Member<S>,
    shard: u32,
    /// The shard's etcd prefix.
    prefix: String,
}

impl<S: Send + Sync + 'static> Elector<S> {
    pub(super) fn new(
        client: EtcdClient,
        options: ClusterOptions,
        clock: Clock,
        make_app: MakeApp<S>,
        member: Member<S>,
        shard: u32,
    ) -> Self {
        let prefix = options.shard_prefix(shard);
        Self {
            client,
            options,
            clock,
            make_app,
            member,
            shard,
            prefix,
        }
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}{rest}", self.prefix).into_bytes()
    }

    /// The deadline a confirmation sent at `sent_ms` with `ttl_s` gives.
    fn deadline(&self, sent_ms: u64, ttl_s: i64) -> u64 {
        primacy_deadline(sent_ms, ttl_s, self.options.margin_ms)
    }

    pub(super) async fn run(self) {
        while !self.member.is_stopping() {
            if let Err(error) = self.session().await {
                tracing::warn!(shard = self.shard, %error, "cluster session ended; starting a new one");
            }
            tokio::select! {
                () = tokio::time::sleep(self.options.beat()) => {}
                () = self.member.stopped() => {}
            }
        }
        self.member.task_left();
    }

    /// Whether this member campaigns for the shard now (the core's
    /// [`may_campaign`], on this member's view).
    fn may_campaign(&self) -> bool {
        let view = self.member.view();
        let shards = self.options.shards;
        let slot = &view.shards[self.shard as usize];
        let campaign = CampaignView {
            clock_trusted: view.clock_trusted,
            shards_checked: view.shards_checked,
            shards,
            me: &self.options.name,
            assigned: view.assigned(self.shard),
            vacant_since_ms: slot.vacant_since_ms,
            last_primary: slot.last_primary.as_deref(),
            now_ms: self.clock.now_ms(),
            ttl_ms: self.options.ttl_ms,
            led: view.led(),
            share: view.share(shards),
        };
        may_campaign(&campaign, |owner| {
            view.assigned_without(shards, self.shard, owner)
        })
    }

    /// The member the shard should be handed over to, if another.
    fn hand_over_to(&self) -> Option<String> {
        if self.options.shards == 1 {
            return None;
        }
        let view = self.member.view();
        let owner = view.assigned(self.shard)?;
        (owner != self.options.name).then(|| owner.to_owned())
    }

    /// Records who holds the election key, as a poll saw it.
    fn saw(&self, holder: Option<Peer>) {
        let now_ms = self.clock.now_ms();
        let mut view = self.member.view_mut();
        let slot = &mut view.shards[self.shard as usize];
        slot.vacant_since_ms = match (&holder, slot.vacant_since_ms) {
            (Some(_), _) => None,
            (None, Some(since)) => Some(since),
            (None, None) => Some(now_ms),
        };
        if let Some(peer) = &holder {
            slot.last_primary = Some(peer.name.clone());
        }
        slot.primary = holder;
    }

    /// One etcd session: campaign until won or the session is lost, serve
    /// while primary.
    async fn session(&self) -> Result<(), SessionError> {
        let sent_ms = self.clock.now_ms();
        in_session(&self.client, &self.options, |id, ttl_s| async move {
            let mut session = Session { id, sent_ms, ttl_s };
            let me = serde_json::to_vec(&self.member.shared.me).unwrap_or_default();
            loop {
                if self.member.is_stopping() {
                    return Ok(());
                }
                let primary_key = self.key("primary");
                // The election key as this poll saw it (`None`: not seen).
                let seen = if self.may_campaign() {
                    let campaign = self
                        .client
                        .txn(
                            &[Compare::CreateRevision(primary_key.clone(), 0)],
                            &[Op::Put {
                                key: primary_key.clone(),
                                value: me.clone(),
                                lease: id,
                            }],
                            &[Op::Get {
                                key: primary_key.clone(),
                            }],
                        )
                        .await?;
                    let holder = campaign.reads.first().and_then(|kvs| kvs.first());
                    // The key on this member's own etcd lease: an earlier
                    // campaign of this session won, its answer was lost.
                    let won = match holder {
                        _ if campaign.succeeded => Some(campaign.revision),
                        Some(kv) if kv.lease == id => Some(kv.create_revision),
                        _ => None,
                    };
                    if let Some(revision) = won {
                        let election = Election {
                            key: primary_key,
                            revision,
                        };
                        return self.lead(session, election).await;
                    }
                    Some(holder.cloned())
                } else {
                    // Not campaigning (the clock not yet trusted, or the
                    // shard another member's); it still tells clients who
                    // the primary is.
                    self.client.get(&primary_key).await.ok()
                };
                if let Some(holder) = seen {
                    self.saw(holder.and_then(|kv| serde_json::from_slice::<Peer>(&kv.value).ok()));
                }
                tokio::select! {
                    () = tokio::time::sleep(self.options.poll()) => {}
                    () = self.member.stopped() => {}
                }
                if self.clock.now_ms().saturating_sub(session.sent_ms)
                    >= self.options.beat().as_millis() as u64
                {
                    session = self
                        .keep_alive(session)
                        .await?
                        .ok_or(SessionError::Expired)?;
                }
            }
        })
        .await
    }

    /// Renews the session's etcd lease once: the renewed session, or
    /// `Ok(None)` if etcd says the lease is gone.
    async fn keep_alive(&self, session: Session) -> Result<Option<Session>, EtcdError> {
        let sent_ms = self.clock.now_ms();
        let renewed = self.client.keep_alive(session.id).await?;
        Ok(renewed.map(|ttl_s| Session {
            sent_ms,
            ttl_s,
            ..session
        }))
    }

    /// Renews this member's etcd lease once and, if the election key is
    /// still this election's, moves the primacy deadline on; why to step
    /// down otherwise (the clock found slow among them). Bounded by the
    /// etcd client's timeout per endpoint; the deadline passes by itself
    /// meanwhile.
    async fn confirm(
        &self,
        session: &mut Session,
        election: &Election,
        primacy: &Primacy,
    ) -> Result<(), SessionError> {
        match self.keep_alive(*session).await {
            Ok(None) => return Err(SessionError::Expired),
            Ok(Some(renewed)) => {
                // The key must still be this election's: deleted or
                // replaced by hand, another member may have won.
                match self.client.get(&election.key).await {
                    Ok(Some(kv)) if kv.create_revision == election.revision => {
                        *session = renewed;
                        primacy.confirm_until(self.deadline(session.sent_ms, session.ttl_s));
                    }
                    Ok(_) => return Err(SessionError::NotElected),
                    Err(_) => {}
                }
            }
            Err(_) => {}
        }
        if self.options.self_fencing && !primacy.is_live() {
            return Err(SessionError::Unconfirmed);
        }
        if let Some(why) = self.member.view().clock_slow.clone() {
            return Err(SessionError::ClockSlow(why));
        }
        Ok(())
    }

    /// Serves as the shard's primary until primacy is lost or handed over.
    async fn lead(&self, mut session: Session, election: Election) -> Result<(), SessionError> {
        let until_ms = self.deadline(session.sent_ms, session.ttl_s);
        let primacy = Arc::new(Primacy::new(
            self.clock.clone(),
            until_ms,
            self.options.self_fencing,
        ));
        // The session is kept alive while the lease state loads: a load
        // longer than the TTL must not lose the election it serves.
        let load = journal::load(&self.client, self.prefix.as_bytes());
        tokio::pin!(load);
        let loaded = loop {
            tokio::select! {
                loaded = &mut load => break loaded.map_err(SessionError::State)?,
                () = tokio::time::sleep(self.options.beat()) => {
                    self.confirm(&mut session, &election, &primacy).await?;
                }
            }
        };
        let clean = self.record_election(&election).await?;
        let leases = loaded.records();
        let forgotten_above = loaded.forgotten_above();
        let journal = Arc::new(EtcdJournal::start_with(
            self.client.clone(),
            self.prefix.clone().into_bytes(),
            election.clone(),
            loaded,
            Limits::default(),
            self.member.shared.committer.clone(),
        ));
        let failure = journal.failure();
        let loaded = leases.len();
        let (app, store) = (self.make_app)(Takeover {
            shard: self.shard,
            leases,
            journal: journal.clone(),
            primacy: primacy.clone(),
            rule: takeover_rule(clean, self.options.unsettled_ms, forgotten_above),
        })
        .map_err(SessionError::Serve)?;
        {
            let mut view = self.member.view_mut();
            let slot = &mut view.shards[self.shard as usize];
            slot.serving = Some((app, primacy.clone()));
            slot.primary = Some(self.member.shared.me.clone());
            slot.vacant_since_ms = None;
            slot.last_primary = Some(self.options.name.clone());
        }
        let stats = &self.member.shared.stats;
        stats.takeovers.fetch_add(1, Relaxed);
        stats.led.fetch_add(1, Relaxed);
        if self.options.shards == 1 {
            tracing::info!(name = %self.options.name, leases = loaded, clean, "this member is the primary");
        } else {
            tracing::info!(name = %self.options.name, shard = self.shard, leases = loaded, clean, "this member leads the shard");
        }
        let ended = loop {
            tokio::select! {
                () = tokio::time::sleep(self.options.beat()) => {}
                () = failure.wait() => break Ended::Lost(SessionError::WriteFailed),
                () = self.member.stopped() => break Ended::Stopping,
            }
            if let Err(why) = self.confirm(&mut session, &election, &primacy).await {
                break Ended::Lost(why);
            }
            if let Some(to) = self.hand_over_to() {
                break Ended::HandedOver(to);
            }
        };
        primacy.revoke();
        if !matches!(ended, Ended::Lost(_)) && self.drain(&store, DRAIN_MS).await {
            self.record_handover(&election).await;
        }
        failure.stop();
        {
            let mut view = self.member.view_mut();
            let slot = &mut view.shards[self.shard as usize];
            slot.serving = None;
            slot.primary = None;
        }
        stats.led.fetch_sub(1, Relaxed);
        match ended {
            Ended::HandedOver(to) => {
                stats.handovers_out.fetch_add(1, Relaxed);
                tracing::info!(name = %self.options.name, shard = self.shard, to = %to, "handing the shard over");
                Ok(())
            }
            Ended::Stopping => {
                tracing::warn!(name = %self.options.name, shard = self.shard, "this member stepped down: the process is stopping");
                Ok(())
            }
            Ended::Lost(why) => {
                tracing::warn!(name = %self.options.name, shard = self.shard, reason = %why, "this member stepped down");
                Err(why)
            }
        }
    }

    /// Waits, after primacy was revoked, until the shard's admitted writes
    /// have finished at the backend, none whose outcome is unknown is still
    /// settling, and its own takeover window is over, for at most
    /// `bound_ms`; whether all three happened.
    async fn drain(&self, store: &LeaseStore, bound_ms: u64) -> bool {
        let bound = self.clock.now_ms() + bound_ms;
        loop {
            if store.handover_drained() {
                return true;
            }
            if self.clock.now_ms() >= bound {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// At takeover: whether the previous primary handed the shard over
    /// cleanly (it recorded, while it still held the election key, that
    /// its writes had all finished: `handed-over` equals the `elected` it
    /// wrote when it won), so no write of its can still reach the backend
    /// and no takeover window is needed. Then records this election for
    /// the next primary to compare with.
    async fn record_election(&self, election: &Election) -> Result<bool, SessionError> {
        let read = |key| async move {
            self.client
                .get(&self.key(key))
                .await
                .map_err(|error| SessionError::Key {
                    write: false,
                    key,
                    error,
                })
        };
        let elected = read("elected").await?;
        let handed_over = read("handed-over").await?;
        let clean = takeover_clean(
            elected.as_ref().map(|kv| kv.value.as_slice()),
            handed_over.as_ref().map(|kv| kv.value.as_slice()),
        );
        self.put_if_elected(election, "elected").await?;
        Ok(clean)
    }

    /// After a drain that saw every write finish: says so for the next
    /// primary (best effort; without it, the next primary waits out the
    /// takeover window).
    async fn record_handover(&self, election: &Election) {
        if let Err(error) = self.put_if_elected(election, "handed-over").await {
            tracing::warn!(shard = self.shard, %error, "could not record the clean handover; the next primary waits out the takeover window");
        }
    }

    /// Writes this election's revision at `key`, if the election key is
    /// still this election's.
    async fn put_if_elected(
        &self,
        election: &Election,
        key: &'static str,
    ) -> Result<(), SessionError> {
        let done = self
            .client
            .txn(
                &[Compare::CreateRevision(
                    election.key.clone(),
                    election.revision,
                )],
                &[Op::Put {
                    key: self.key(key),
                    value: election.revision.to_string().into_bytes(),
                    lease: 0,
                }],
                &[],
            )
            .await
            .map_err(|error| SessionError::Key {
                write: true,
                key,
                error,
            })?;
        if done.succeeded {
            Ok(())
        } else {
            Err(SessionError::NotElected)
        }
    }
}
