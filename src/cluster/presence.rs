//! A member's presence: the number of shards checked against etcd's, the
//! member's registration under `{prefix}members/{name}` (on an etcd lease
//! of its own), the list of members, and the clock check every campaign
//! waits for.

use std::future::Future;
use std::time::Duration;

use crate::clock::Clock;
use crate::etcd::{Compare, EtcdClient, EtcdError, Op};
use fencegate_core::cluster::{ClockProbe, ClockVerdict};

use super::{
    in_session, renew_session, ClusterError, ClusterOptions, Member, Registration, SessionError,
};

/// The state of this member's clock check, kept across its sessions.
#[derive(Debug, Default)]
struct ClockCheck {
    probe: Option<ClockProbe>,
    /// The clock agreed with etcd's over at least half a TTL (a whole
    /// probe's half TTL once it was ever found slow) and has not been found
    /// slow since: the member may campaign.
    trusted: bool,
    /// Why the clock is not trusted, while it is found slow.
    slow: Option<String>,
    /// Found slow at least once: trusted again only over a longer span, so
    /// a clock a little slow does not win, step down and win again.
    ever_slow: bool,
    /// A fast clock was said once.
    said_fast: bool,
    /// The last probe call failed (said once a streak).
    failing: bool,
}

/// What etcd's number of shards for the prefix says.
enum ShardCount {
    Agrees,
    /// Another number, or state this member must not ignore: why.
    Refused(String),
}

pub(super) struct Presence<S> {
    client: EtcdClient,
    options: ClusterOptions,
    clock: Clock,
    member: Member<S>,
}

impl<S: Send + Sync + 'static> Presence<S> {
    pub(super) fn new(
        client: EtcdClient,
        options: ClusterOptions,
        clock: Clock,
        member: Member<S>,
    ) -> Self {
        Self {
            client,
            options,
            clock,
            member,
        }
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}{rest}", self.options.prefix).into_bytes()
    }

    pub(super) async fn run(self) {
        if self.settle_shard_count().await {
            let mut check = ClockCheck::default();
            while !self.member.is_stopping() {
                if let Err(error) = self.session(&mut check).await {
                    tracing::warn!(%error, "cluster presence session ended; starting a new one");
                }
                tokio::select! {
                    () = tokio::time::sleep(self.options.beat()) => {}
                    () = self.member.stopped() => {}
                }
            }
        }
        self.member.task_left();
    }

    /// Checks the number of shards against etcd's until it agrees (then
    /// campaigns may start) or etcd refuses it (the member fails: false).
    async fn settle_shard_count(&self) -> bool {
        let mut said = false;
        while !self.member.is_stopping() {
            let checked = match check_shard_count(&self.client, &self.options).await {
                Ok(ShardCount::Agrees) => {
                    member_key(&self.client, &self.options).await.map(|key| {
                        let _ = self.member.shared.member_key.set(key);
                        ShardCount::Agrees
                    })
                }
                other => other,
            };
            match checked {
                Ok(ShardCount::Agrees) => {
                    self.member.view_mut().shards_checked = true;
                    self.member.shared.checked.send_replace(Some(Ok(())));
                    return true;
                }
                Ok(ShardCount::Refused(why)) => {
                    tracing::error!(reason = %why, "this member cannot join the cluster");
                    self.member
                        .shared
                        .checked
                        .send_replace(Some(Err(ClusterError::Refused(why))));
                    return false;
                }
                Err(error) => {
                    if !said {
                        tracing::warn!(%error, "cannot check cluster.shards against etcd yet; not campaigning until it can");
                        said = true;
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.options.beat()) => {}
                () = self.member.stopped() => {}
            }
        }
        false
    }

    /// One etcd session: register, then keep the registration alive, the
    /// clock checked and the member list fresh, a beat at a time.
    async fn session(&self, check: &mut ClockCheck) -> Result<(), SessionError> {
        in_session(&self.client, &self.options, |id, _| async move {
            let mut registered = None;
            loop {
                if self.member.is_stopping() {
                    return Ok(());
                }
                self.check_clock(check).await;
                {
                    let mut view = self.member.view_mut();
                    view.clock_trusted = check.trusted;
                    view.clock_slow.clone_from(&check.slow);
                }
                let me = Registration {
                    name: self.options.name.clone(),
                    url: self.options.advertise.clone(),
                    ready: check.trusted,
                };
                if registered.as_ref() != Some(&me) {
                    let value = serde_json::to_vec(&me).unwrap_or_default();
                    self.client
                        .put(&self.key(&format!("members/{}", me.name)), &value, id)
                        .await?;
                    registered = Some(me);
                }
                // The member list every poll between keepalives: a member
                // gone is seen within a poll of its key's expiry, and its
                // shards are campaigned for then.
                let beat = self.clock.now_ms() + self.options.beat().as_millis() as u64;
                loop {
                    self.refresh_members().await;
                    let left_ms = beat.saturating_sub(self.clock.now_ms());
                    if left_ms == 0 {
                        break;
                    }
                    let nap = self.options.poll().min(Duration::from_millis(left_ms));
                    tokio::select! {
                        () = tokio::time::sleep(nap) => {}
                        () = self.member.stopped() => return Ok(()),
                    }
                }
                renew_session(&self.client, id).await?;
            }
        })
        .await
    }

    async fn refresh_members(&self) {
        if let Ok((kvs, _)) = self.client.get_prefix(&self.key("members/")).await {
            let members = kvs
                .iter()
                .filter_map(|kv| serde_json::from_slice::<Registration>(&kv.value).ok())
                .collect();
            self.member
                .view_mut()
                .set_members(self.options.shards, members);
        }
    }

    /// The probe's TTL: long, so its span (and the check's precision) grows
    /// well past etcd's whole seconds; at least six TTLs.
    fn probe_ttl_s(&self) -> i64 {
        i64::try_from((self.options.ttl_ms / 1000).saturating_mul(6).max(60)).unwrap_or(60)
    }

    /// Checks this member's clock against etcd's once (see [`ClockCheck`]).
    /// An etcd that does not answer says nothing here (keepalives fail
    /// closed on their own). A probe past half its TTL is replaced by a new
    /// one, which starts a new span.
    async fn check_clock(&self, check: &mut ClockCheck) {
        let Some(probe) = check.probe else {
            let sent_ms = self.clock.now_ms();
            match self
                .within_beat(self.client.grant(self.probe_ttl_s()))
                .await
            {
                Ok((id, ttl_s)) => {
                    check.probe = Some(ClockProbe {
                        id,
                        ttl_s,
                        sent_ms,
                        answered_ms: self.clock.now_ms(),
                    });
                    check.failing = false;
                }
                Err(e) => self.probe_failed(check, &e),
            }
            return;
        };
        let asked_ms = self.clock.now_ms();
        let left_s = match self.within_beat(self.client.time_to_live(probe.id)).await {
            Ok(Some(left_s)) => left_s,
            // Gone before its time: a new probe next time.
            Ok(None) => {
                check.probe = None;
                return;
            }
            Err(e) => {
                self.probe_failed(check, &e);
                return;
            }
        };
        check.failing = false;
        let answered_ms = self.clock.now_ms();
        let tolerance_ms = self.options.clock_tolerance_ms;
        match probe.judge(left_s, asked_ms, answered_ms, tolerance_ms) {
            ClockVerdict::Slow { behind_ms } => {
                let why = format!(
                    "this member's clock runs slow against etcd's: {behind_ms} ms behind over {} ms \
                     (tolerance {tolerance_ms} ms)",
                    answered_ms.saturating_sub(probe.sent_ms),
                );
                if check.slow.is_none() {
                    tracing::error!(name = %self.options.name, reason = %why, "clock check failed: not primary until this member's clock agrees with etcd's again");
                }
                check.slow = Some(why);
                check.trusted = false;
                check.ever_slow = true;
                // Trusted again only by a probe granted after this, with no
                // slow verdict over its whole span: etcd's whole seconds
                // make a clock a little slow look right now and then.
                let _ = self.within_beat(self.client.revoke(probe.id)).await;
                check.probe = None;
                return;
            }
            ClockVerdict::Fast { ahead_ms } => {
                if !check.said_fast {
                    tracing::warn!(name = %self.options.name, ahead_ms, "this member's clock runs fast against etcd's (safe: it stops early)");
                    check.said_fast = true;
                }
            }
            ClockVerdict::Agrees { span_ms } => {
                // Once ever slow: about the probe's whole span (it is
                // replaced at half its TTL, give or take etcd's seconds).
                let needed_ms = if check.ever_slow {
                    u64::try_from(probe.ttl_s)
                        .unwrap_or(0)
                        .saturating_mul(500)
                        .saturating_sub(2000)
                } else {
                    self.options.ttl_ms / 2
                };
                if span_ms >= needed_ms && !check.trusted {
                    if check.slow.take().is_some() {
                        tracing::warn!(name = %self.options.name, "this member's clock agrees with etcd's again");
                    }
                    check.trusted = true;
                }
            }
        }
        if left_s < probe.ttl_s / 2 {
            let _ = self.within_beat(self.client.revoke(probe.id)).await;
            check.probe = None;
        }
    }

    /// `call`, bounded by a beat: the clock check must not hold up the
    /// keepalive after it.
    async fn within_beat<T>(
        &self,
        call: impl Future<Output = Result<T, EtcdError>>,
    ) -> Result<T, SessionError> {
        match tokio::time::timeout(self.options.beat(), call).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(SessionError::NoAnswer(self.options.beat())),
        }
    }

    /// Says (once a streak) that the clock could not be checked: a member
    /// that never could would never campaign, silently.
    fn probe_failed(&self, check: &mut ClockCheck, error: &SessionError) {
        if !check.failing {
            tracing::warn!(name = %self.options.name, %error, "cannot check this member's clock against etcd's (lease grant or time-to-live failed); not campaigning until it can");
            check.failing = true;
        }
    }
}

/// Puts `value` at `key` unless etcd holds one there already, in one
/// transaction: whether it was put, and the value etcd holds now (ours, or
/// the one another member put first).
async fn put_if_absent(
    client: &EtcdClient,
    key: &[u8],
    value: Vec<u8>,
) -> Result<(bool, Vec<u8>), EtcdError> {
    let created = client
        .txn(
            &[Compare::CreateRevision(key.to_vec(), 0)],
            &[Op::Put {
                key: key.to_vec(),
                value: value.clone(),
                lease: 0,
            }],
            &[Op::Get { key: key.to_vec() }],
        )
        .await?;
    if created.succeeded {
        return Ok((true, value));
    }
    let theirs = created
        .reads
        .first()
        .and_then(|kvs| kvs.first())
        .map(|kv| kv.value.clone())
        .unwrap_or_default();
    Ok((false, theirs))
}

/// The cluster's member key, kept in etcd at `{prefix}member-key`: made
/// (32 random bytes from the OS, in hex) by the first member that finds
/// none, read by every other. Whoever can read the cluster's prefix in etcd
/// is a member.
async fn member_key(
    client: &EtcdClient,
    options: &ClusterOptions,
) -> Result<http::HeaderValue, EtcdError> {
    let key = format!("{}member-key", options.prefix).into_bytes();
    let value = match client.get(&key).await? {
        Some(kv) => kv.value,
        None => {
            let mut raw = [0u8; 32];
            if getrandom::fill(&mut raw).is_err() {
                return Err(EtcdError::Refused(
                    "the OS gave no random bytes for the member key".into(),
                ));
            }
            put_if_absent(client, &key, crate::hex::encode(&raw).into_bytes())
                .await?
                .1
        }
    };
    http::HeaderValue::from_bytes(&value)
        .ok()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| EtcdError::Refused("the member key in etcd is not a header value".into()))
}

/// Whether etcd keeps `options.shards` for the prefix, recording it if
/// no number is kept yet. A prefix that already holds a one-shard
/// cluster's lease state (from before the number was kept) is not taken
/// over by several shards: their state would start empty, and tokens over.
async fn check_shard_count(
    client: &EtcdClient,
    options: &ClusterOptions,
) -> Result<ShardCount, EtcdError> {
    let key = format!("{}shard-count", options.prefix).into_bytes();
    let shown = String::from_utf8_lossy(&key).into_owned();
    let kept = client.get(&key).await?;
    if kept.is_none() && options.shards > 1 {
        let prefix = options.prefix.as_bytes();
        let snapshot = client.get(&[prefix, b"snapshot"].concat()).await?;
        let (log, _) = client
            .get_range(&[prefix, b"log/"].concat(), &[prefix, b"log0"].concat(), 1)
            .await?;
        // The one-key-per-lease layout of earlier builds.
        let (keys, _) = client
            .get_range(
                &[prefix, b"leases/"].concat(),
                &[prefix, b"leases0"].concat(),
                1,
            )
            .await?;
        if snapshot.is_some() || !log.is_empty() || !keys.is_empty() {
            return Ok(ShardCount::Refused(format!(
                "cluster.shards is {} but prefix {} holds the lease state of a cluster with one \
                 shard (and no {shown}); start the members with shards = 1, or use another prefix",
                options.shards, options.prefix
            )));
        }
    }
    let value = match kept {
        Some(kv) => kv.value,
        None => {
            let n = options.shards.to_string().into_bytes();
            match put_if_absent(client, &key, n).await? {
                (true, _) => return Ok(ShardCount::Agrees),
                (false, theirs) => theirs,
            }
        }
    };
    let theirs = String::from_utf8_lossy(&value);
    if theirs.trim() == options.shards.to_string() {
        Ok(ShardCount::Agrees)
    } else {
        Ok(ShardCount::Refused(format!(
            "cluster.shards is {} but the cluster at prefix {} has {} shards (kept in etcd at \
             {shown}); start every member with shards = {}, or use another prefix",
            options.shards,
            options.prefix,
            theirs.trim(),
            theirs.trim()
        )))
    }
}
