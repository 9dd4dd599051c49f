//! Cluster mode: several members, one primary at a time elected through
//! etcd, the lease state in etcd ([`journal`]).
//!
//! A member's life is a sequence of etcd sessions. Each session grants an
//! etcd lease, registers the member under `{prefix}members/{name}` with it,
//! and campaigns: a transaction creates `{prefix}primary` (attached to the
//! same lease) only if it does not exist. The winner loads every lease from
//! the snapshot and log under the prefix, builds a fresh lease store and
//! app on it (unreleased terms held for a full TTL from takeover, later
//! terms' writes held back until the previous primary's writes have
//! settled), and serves. It keeps
//! its etcd lease alive; each confirmed keepalive moves its [`Primacy`]
//! deadline to the keepalive's send time plus the TTL etcd granted, minus a
//! margin, on the proxy's clock, so the deadline passes before etcd can let
//! the election key go. That deadline is only as good as the member's clock,
//! so each member also checks its clock against etcd's ([`ClockProbe`]):
//! it campaigns only once the two agreed over half a TTL. Past the
//! deadline, or when etcd says the lease is gone, or when a write of lease
//! state fails, or when its clock is found slow, the member steps down: its
//! primacy is revoked (nothing more reaches the backend), its app is
//! dropped, and a new session starts from what etcd holds. Losers poll the
//! election key and campaign again when it is gone.
//!
//! [`Member`] is the service every member runs: the primary's app while
//! primacy is live, standby answers otherwise.

pub mod journal;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response};
use serde::{Deserialize, Serialize};
use tower::{Service, ServiceExt};

use crate::body::{self, Body};
use crate::clock::Clock;
use crate::error::Problem;
use crate::etcd::{Compare, EtcdClient, EtcdError, Op};
use crate::journal::{Journal, LeaseRecord};
use crate::lease::{Primacy, RestartRule};
use fencegate_core::cluster::{primacy_deadline, ClockProbe, ClockVerdict};
use journal::{Election, EtcdJournal, Limits};

/// How a member takes part in a cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// This member's unique name.
    pub name: String,
    /// The URL clients reach this member at.
    pub advertise: String,
    /// The etcd key prefix of this cluster's state.
    pub prefix: String,
    /// TTL of a member's etcd lease: how long a primary that stopped
    /// renewing keeps the election key.
    pub ttl_ms: u64,
    /// How much earlier than its etcd lease could expire a primary stops
    /// admitting.
    pub margin_ms: u64,
    /// How long after a takeover writes the previous primary sent may still
    /// reach the backend: the upstream deadline plus the settle time.
    pub unsettled_ms: u64,
    /// Test-only: off, a primary whose deadline passed goes on admitting
    /// until etcd tells it the lease is gone.
    pub self_fencing: bool,
    /// How far behind etcd's this member's clock may fall (beyond etcd's
    /// whole seconds) before it steps down and stops campaigning (see
    /// [`ClockProbe`]).
    pub clock_tolerance_ms: u64,
}

/// What a member gets when it wins: the lease state to serve from.
pub struct Takeover {
    /// Every lease etcd held, ids as digests.
    pub leases: Vec<LeaseRecord>,
    /// Where grants, renewals and releases go.
    pub journal: Arc<dyn Journal>,
    /// This term of primacy.
    pub primacy: Arc<Primacy>,
    /// How the store restores `leases`.
    pub rule: RestartRule,
}

/// Builds the primary's app for one term of primacy.
pub type MakeApp<S> = Arc<dyn Fn(Takeover) -> Result<S, String> + Send + Sync>;

/// A member as others see it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub url: String,
}

struct View<S> {
    /// The app and its primacy while this member is primary.
    serving: Option<(S, Arc<Primacy>)>,
    primary: Option<Peer>,
    members: Vec<Peer>,
}

impl<S> View<S> {
    /// The app, while this member's primacy is live.
    fn live_app(&self) -> Option<&S> {
        self.serving
            .as_ref()
            .filter(|(_, primacy)| primacy.is_live())
            .map(|(app, _)| app)
    }
}

struct Shared<S> {
    me: Peer,
    view: RwLock<View<S>>,
    /// Set when the process stops: the member steps down and leaves.
    stopping: tokio::sync::watch::Sender<bool>,
    /// Set once the member has left (its etcd lease handed back).
    left: tokio::sync::watch::Sender<bool>,
}

/// The service a cluster member runs.
pub struct Member<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for Member<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<S> Member<S> {
    fn view(&self) -> std::sync::RwLockReadGuard<'_, View<S>> {
        self.shared.view.read().unwrap_or_else(|p| p.into_inner())
    }

    fn view_mut(&self) -> std::sync::RwLockWriteGuard<'_, View<S>> {
        self.shared.view.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Leaves the cluster (the process is stopping): a primary steps down
    /// at once and hands its etcd lease back, so a standby takes over
    /// without waiting for the TTL; a standby stops campaigning.
    pub fn stop(&self) {
        self.shared.stopping.send_replace(true);
    }

    /// Completes once the member has left after [`Member::stop`].
    pub async fn left(&self) {
        let mut rx = self.shared.left.subscribe();
        let _ = rx.wait_for(|left| *left).await;
    }

    /// Completes once [`Member::stop`] was called.
    async fn stopped(&self) {
        let mut rx = self.shared.stopping.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    fn is_stopping(&self) -> bool {
        *self.shared.stopping.borrow()
    }

    fn cluster_json(&self) -> Response<Body> {
        let view = self.view();
        let primary = view.live_app().is_some();
        let doc = serde_json::json!({
            "role": if primary { "primary" } else { "standby" },
            "name": self.shared.me.name,
            "url": self.shared.me.url,
            "primary": view.primary,
            "members": view.members,
        });
        let mut res = Response::new(body::full(Bytes::from(doc.to_string())));
        res.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        res
    }

    /// What a member that is not serving as primary answers.
    fn standby_answer(&self, path: &str) -> Response<Body> {
        if path == "/_fence/livez" {
            let mut res = Response::new(body::full(Bytes::from_static(b"{\"status\":\"live\"}")));
            res.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return res;
        }
        let view = self.view();
        let primary = view
            .primary
            .as_ref()
            .filter(|p| p.name != self.shared.me.name)
            .map(|p| p.url.as_str());
        let detail = match primary {
            Some(_) => "this member is a standby; send requests to the primary",
            None => "no primary is known right now; retry shortly",
        };
        Problem::not_primary(detail, primary).into_response()
    }
}

type BoxResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl<S, B> Service<Request<B>> for Member<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let path = req.uri().path();
        if path == "/_fence/cluster" && matches!(*req.method(), Method::GET | Method::HEAD) {
            return Box::pin(std::future::ready(Ok(self.cluster_json())));
        }
        let app = self.view().live_app().cloned();
        match app {
            Some(app) => Box::pin(app.oneshot(req)),
            None => {
                let res = self.standby_answer(path);
                Box::pin(std::future::ready(Ok(res)))
            }
        }
    }
}

/// Starts a member: its service, and the task that campaigns and serves
/// terms of primacy through `client`.
pub fn start<S>(
    client: EtcdClient,
    options: ClusterOptions,
    clock: Clock,
    make_app: MakeApp<S>,
) -> Member<S>
where
    S: Send + Sync + 'static,
{
    let member = Member {
        shared: Arc::new(Shared {
            me: Peer {
                name: options.name.clone(),
                url: options.advertise.clone(),
            },
            view: RwLock::new(View {
                serving: None,
                primary: None,
                members: Vec::new(),
            }),
            stopping: tokio::sync::watch::channel(false).0,
            left: tokio::sync::watch::channel(false).0,
        }),
    };
    let elector = Elector {
        client,
        options,
        clock,
        make_app,
        member: member.clone(),
    };
    tokio::spawn(elector.run());
    member
}

struct Elector<S> {
    client: EtcdClient,
    options: ClusterOptions,
    clock: Clock,
    make_app: MakeApp<S>,
    member: Member<S>,
}

/// An etcd lease as this member last confirmed it.
#[derive(Clone, Copy, Debug)]
struct Session {
    id: i64,
    /// When the last confirmed grant or keepalive was sent (proxy clock).
    sent_ms: u64,
    /// The TTL etcd granted then, in seconds.
    ttl_s: i64,
}

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

impl<S: Send + Sync + 'static> Elector<S> {
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
    ) -> Result<T, String> {
        match tokio::time::timeout(self.beat(), call).await {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {:?}", self.beat())),
        }
    }

    /// Says (once a streak) that the clock could not be checked: a member
    /// that never could would never campaign, silently.
    fn probe_failed(&self, check: &mut ClockCheck, error: &str) {
        if !check.failing {
            tracing::warn!(name = %self.options.name, %error, "cannot check this member's clock against etcd's (lease grant or time-to-live failed); not campaigning until it can");
            check.failing = true;
        }
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}{rest}", self.options.prefix).into_bytes()
    }

    /// How often a primary renews its etcd lease (a standby too).
    fn beat(&self) -> Duration {
        Duration::from_millis((self.options.ttl_ms / 3).clamp(100, 1000))
    }

    /// How often a standby looks for the primary: a dead primary's key is
    /// gone at most a TTL after its last renewal, and is seen gone within
    /// this much more.
    fn poll(&self) -> Duration {
        Duration::from_millis((self.options.ttl_ms / 10).clamp(100, 500))
    }

    /// The deadline a confirmation sent at `sent_ms` with `ttl_s` gives.
    fn deadline(&self, sent_ms: u64, ttl_s: i64) -> u64 {
        primacy_deadline(sent_ms, ttl_s, self.options.margin_ms)
    }

    async fn run(self) {
        let mut check = ClockCheck::default();
        while !self.member.is_stopping() {
            if let Err(error) = self.session(&mut check).await {
                tracing::warn!(%error, "cluster session ended; starting a new one");
            }
            tokio::select! {
                () = tokio::time::sleep(self.beat()) => {}
                () = self.member.stopped() => {}
            }
        }
        self.member.shared.left.send_replace(true);
    }

    /// One etcd session: register, campaign until won or the session is
    /// lost, serve while primary.
    async fn session(&self, check: &mut ClockCheck) -> Result<(), String> {
        let ttl_s = i64::try_from(self.options.ttl_ms.div_ceil(1000)).unwrap_or(i64::MAX);
        let sent_ms = self.clock.now_ms();
        let (id, ttl_s) = self.client.grant(ttl_s).await.map_err(|e| e.to_string())?;
        let mut session = Session { id, sent_ms, ttl_s };
        let me = serde_json::to_vec(&self.member.shared.me).unwrap_or_default();
        let result = async {
            self.client
                .put(
                    &self.key(&format!("members/{}", self.options.name)),
                    &me,
                    id,
                )
                .await
                .map_err(|e| e.to_string())?;
            loop {
                if self.member.is_stopping() {
                    return Ok(());
                }
                let primary_key = self.key("primary");
                // The election key as this poll saw it (`None`: not seen).
                let seen = if check.trusted {
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
                        .await
                        .map_err(|e| e.to_string())?;
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
                        return self.lead(session, election, check).await;
                    }
                    Some(holder.cloned())
                } else {
                    // No campaign before this member's clock agreed with
                    // etcd's; it still tells clients who the primary is.
                    if check.probe.is_none() {
                        self.check_clock(check).await;
                    }
                    self.client.get(&primary_key).await.ok()
                };
                if let Some(holder) = seen {
                    let primary =
                        holder.and_then(|kv| serde_json::from_slice::<Peer>(&kv.value).ok());
                    self.member.view_mut().primary = primary;
                }
                tokio::select! {
                    () = tokio::time::sleep(self.poll()) => {}
                    () = self.member.stopped() => {}
                }
                if self.clock.now_ms().saturating_sub(session.sent_ms)
                    >= self.beat().as_millis() as u64
                {
                    self.check_clock(check).await;
                    session = self
                        .keep_alive(session)
                        .await
                        .map_err(|e| e.to_string())?
                        .ok_or("this member's etcd lease expired")?;
                    self.refresh_members().await;
                }
            }
        }
        .await;
        // Best effort: the keys go at once instead of at the TTL's end.
        let _ = tokio::time::timeout(self.beat(), self.client.revoke(id)).await;
        result
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

    async fn refresh_members(&self) {
        if let Ok((kvs, _)) = self.client.get_prefix(&self.key("members/")).await {
            let members = kvs
                .iter()
                .filter_map(|kv| serde_json::from_slice::<Peer>(&kv.value).ok())
                .collect();
            self.member.view_mut().members = members;
        }
    }

    /// Renews this member's etcd lease once and, if the election key is
    /// still this election's, moves the primacy deadline on, then checks
    /// the clock; why to step down otherwise (the clock found slow among
    /// them). Bounded by the etcd client's timeout per endpoint; the
    /// deadline passes by itself meanwhile.
    async fn confirm(
        &self,
        session: &mut Session,
        election: &Election,
        primacy: &Primacy,
        check: &mut ClockCheck,
    ) -> Result<(), String> {
        match self.keep_alive(*session).await {
            Ok(None) => return Err("this member's etcd lease expired".to_owned()),
            Ok(Some(renewed)) => {
                // The key must still be this election's: deleted or
                // replaced by hand, another member may have won.
                match self.client.get(&election.key).await {
                    Ok(Some(kv)) if kv.create_revision == election.revision => {
                        *session = renewed;
                        primacy.confirm_until(self.deadline(session.sent_ms, session.ttl_s));
                    }
                    Ok(_) => return Err("the election key is no longer this member's".to_owned()),
                    Err(_) => {}
                }
            }
            Err(_) => {}
        }
        if self.options.self_fencing && !primacy.is_live() {
            return Err("primacy could not be confirmed in time".to_owned());
        }
        // After the keepalive, each call bounded by a beat, so a slow answer
        // here delays the next one by little.
        self.check_clock(check).await;
        if let Some(why) = &check.slow {
            return Err(why.clone());
        }
        Ok(())
    }

    /// Serves as primary until primacy is lost.
    async fn lead(
        &self,
        mut session: Session,
        election: Election,
        check: &mut ClockCheck,
    ) -> Result<(), String> {
        let until_ms = self.deadline(session.sent_ms, session.ttl_s);
        let primacy = Arc::new(Primacy::new(
            self.clock.clone(),
            until_ms,
            self.options.self_fencing,
        ));
        // The session is kept alive while the lease state loads: a load
        // longer than the TTL must not lose the election it serves.
        let load = journal::load(&self.client, self.options.prefix.as_bytes());
        tokio::pin!(load);
        let loaded = loop {
            tokio::select! {
                loaded = &mut load => break loaded?,
                () = tokio::time::sleep(self.beat()) => {
                    self.confirm(&mut session, &election, &primacy, check).await?;
                }
            }
        };
        let leases = loaded.records();
        let forgotten_above = loaded.forgotten_above();
        let journal = Arc::new(EtcdJournal::start(
            self.client.clone(),
            self.options.prefix.clone().into_bytes(),
            election.clone(),
            loaded,
            Limits::default(),
        ));
        let failure = journal.failure();
        let loaded = leases.len();
        let app = (self.make_app)(Takeover {
            leases,
            journal: journal.clone(),
            primacy: primacy.clone(),
            rule: RestartRule {
                unsettled_ms: self.options.unsettled_ms,
                hashed_ids: true,
                forgotten_above,
                ..RestartRule::default()
            },
        })?;
        {
            let mut view = self.member.view_mut();
            view.serving = Some((app, primacy.clone()));
            view.primary = Some(self.member.shared.me.clone());
        }
        tracing::info!(name = %self.options.name, leases = loaded, "this member is the primary");
        self.refresh_members().await;
        let why = loop {
            tokio::select! {
                () = tokio::time::sleep(self.beat()) => {}
                () = failure.wait() => break "a write of lease state failed".to_owned(),
                () = self.member.stopped() => break "the process is stopping".to_owned(),
            }
            if let Err(why) = self.confirm(&mut session, &election, &primacy, check).await {
                break why;
            }
            self.refresh_members().await;
        };
        primacy.revoke();
        failure.stop();
        {
            let mut view = self.member.view_mut();
            view.serving = None;
            view.primary = None;
        }
        tracing::warn!(name = %self.options.name, reason = %why, "this member stepped down");
        Err(why)
    }
}

impl<S> std::fmt::Debug for Member<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("me", &self.shared.me)
            .finish()
    }
}
