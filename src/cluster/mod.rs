//! Cluster mode: several members, the lease state in etcd ([`journal`]),
//! the leases spread over `cluster.shards` shards, each led by one member
//! at a time, elected through etcd.
//!
//! Every member runs:
//! - a presence task (`presence.rs`): it checks that etcd keeps the same
//!   number of shards for the prefix (a member started with another number
//!   refuses to start), registers the member under `{prefix}members/{name}`
//!   on an etcd lease of its own, and checks the member's clock against
//!   etcd's ([`ClockProbe`](fencegate_core::cluster::ClockProbe)); no
//!   shard is campaigned for before the clock agreed with etcd's over half
//!   a TTL.
//! - an elector per shard (`elector.rs`): a sequence of etcd sessions, each
//!   campaigning for the shard's election key (`{prefix}primary` with one
//!   shard, `{prefix}shards/{k}/primary` with several) and, once won,
//!   loading the shard's lease state from under the same prefix and serving
//!   it until primacy is lost: a fresh lease store and app per term of
//!   primacy, unreleased terms held for a full TTL from takeover, later
//!   terms' writes held back until the previous primary's writes settled,
//!   primacy confirmed by keepalives and given up before etcd can let the
//!   key go (self-fencing).
//!
//! With several shards, members campaign only for the shards the balanced
//! assignment ([`fencegate_core::shard::assign`], over the members whose
//! clocks are trusted) gives them; for a shard its assigned member lost
//! (a dead member's), the member it is assigned to among the others; and
//! for one that stayed without a primary for a TTL, any member leading
//! fewer than its share. A primary whose shard the assignment gives to
//! another member hands it over: it stops admitting, gives its writes in
//! flight up to 2 s to finish (then the handover is recorded as clean, and
//! the next primary needs no takeover window), and lets the election key
//! go. The log entries a member's shards write at the same time share one
//! etcd transaction ([`committer`]). Requests are sent to the shard of
//! their lease (`shards.rs`): served here, forwarded to the member that
//! leads it, or answered `not-primary` naming it.

pub mod committer;
mod elector;
pub mod journal;
mod presence;
mod shards;

use std::convert::Infallible;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response};
use serde::{Deserialize, Serialize};
use tower::{Service, ServiceExt};

use crate::body::{self, Body, BoxError, ResponseFuture};
use crate::clock::Clock;
use crate::error::Problem;
use crate::etcd::{EtcdClient, EtcdError};
use crate::journal::{Journal, LeaseRecord};
use crate::lease::{LeaseStore, Primacy, RestartRule};
use crate::metrics::ClusterStats;

pub use shards::{Classify, Sharding};

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
    /// [`fencegate_core::cluster::ClockProbe`]).
    pub clock_tolerance_ms: u64,
    /// How many shards the leases are spread over (fixed per prefix).
    pub shards: u32,
    /// Whether a request for a shard another member leads is forwarded
    /// there (otherwise answered `not-primary`).
    pub forward: bool,
    /// How long a forwarded request may take to its response head.
    pub forward_timeout_ms: u64,
    /// The most a forwarded answer's connection reads ahead of its client
    /// (`proxy.read_buffer_bytes`): a client reading a forwarded answer
    /// slowly holds no more than one reading the storage's.
    pub forward_read_buffer_bytes: usize,
}

impl ClusterOptions {
    /// The etcd prefix of shard `shard`'s election key and lease state: the
    /// cluster's own prefix with one shard (as before shards existed).
    pub fn shard_prefix(&self, shard: u32) -> String {
        if self.shards == 1 {
            self.prefix.clone()
        } else {
            format!("{}shards/{shard}/", self.prefix)
        }
    }

    /// How often a member renews its etcd leases and checks its clock
    /// (the core's [`beat_ms`](fencegate_core::cluster::beat_ms)).
    fn beat(&self) -> Duration {
        Duration::from_millis(fencegate_core::cluster::beat_ms(self.ttl_ms))
    }

    /// How often a member looks at a shard's election key it does not hold
    /// (the core's [`poll_ms`](fencegate_core::cluster::poll_ms)).
    fn poll(&self) -> Duration {
        Duration::from_millis(fencegate_core::cluster::poll_ms(self.ttl_ms))
    }
}

/// Why a member's etcd session ended (it is logged, and a new session
/// starts), or why a step of its work in etcd failed.
#[derive(Debug)]
enum SessionError {
    /// etcd could not be reached, or refused the call.
    Etcd(EtcdError),
    /// etcd gave no answer within a beat.
    NoAnswer(Duration),
    /// This member's etcd lease expired.
    Expired,
    /// The election key is no longer this member's.
    NotElected,
    /// Its primacy could not be confirmed in time (self-fencing).
    Unconfirmed,
    /// The clock check found this member's clock slow: why.
    ClockSlow(String),
    /// A write of the lease state failed.
    WriteFailed,
    /// A key of the shard could not be read or written.
    Key {
        write: bool,
        key: &'static str,
        error: EtcdError,
    },
    /// The shard's lease state in etcd cannot be used.
    State(journal::StateError),
    /// The app to serve the shard could not be made.
    Serve(BoxError),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Etcd(e) => e.fmt(f),
            Self::NoAnswer(beat) => write!(f, "no answer within {beat:?}"),
            Self::Expired => f.write_str("this member's etcd lease expired"),
            Self::NotElected => f.write_str("the election key is no longer this member's"),
            Self::Unconfirmed => f.write_str("primacy could not be confirmed in time"),
            Self::ClockSlow(why) => f.write_str(why),
            Self::WriteFailed => f.write_str("a write of lease state failed"),
            Self::Key { write, key, error } => {
                let verb = if *write { "write" } else { "read" };
                write!(f, "cannot {verb} {key} of the shard: {error}")
            }
            Self::State(e) => e.fmt(f),
            Self::Serve(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for SessionError {}

impl From<EtcdError> for SessionError {
    fn from(e: EtcdError) -> Self {
        Self::Etcd(e)
    }
}

/// Runs `body` in an etcd session of its own: a fresh etcd lease of the
/// member's TTL (`body` gets its id and the TTL etcd granted), given back
/// when `body` ends, whatever its outcome (best effort, within a beat: the
/// keys on it go at once instead of at the TTL's end).
async fn in_session<T, F>(
    client: &EtcdClient,
    options: &ClusterOptions,
    body: impl FnOnce(i64, i64) -> F,
) -> Result<T, SessionError>
where
    F: std::future::Future<Output = Result<T, SessionError>>,
{
    let ttl_s = i64::try_from(options.ttl_ms.div_ceil(1000)).unwrap_or(i64::MAX);
    let (id, ttl_s) = client.grant(ttl_s).await?;
    let result = body(id, ttl_s).await;
    let _ = tokio::time::timeout(options.beat(), client.revoke(id)).await;
    result
}

/// Renews etcd lease `id` once: the TTL etcd granted, or why the session
/// is over.
async fn renew_session(client: &EtcdClient, id: i64) -> Result<i64, SessionError> {
    client.keep_alive(id).await?.ok_or(SessionError::Expired)
}

/// What a member gets when it wins a shard: the lease state to serve from.
pub struct Takeover {
    /// The shard won.
    pub shard: u32,
    /// Every lease etcd held for the shard, ids as digests.
    pub leases: Vec<LeaseRecord>,
    /// Where grants, renewals and releases go.
    pub journal: Arc<dyn Journal>,
    /// This term of primacy.
    pub primacy: Arc<Primacy>,
    /// How the store restores `leases`.
    pub rule: RestartRule,
}

/// Builds the app of one shard for one term of primacy, and gives its
/// lease store (a handover waits for its writes in flight).
pub type MakeApp<S> = Arc<dyn Fn(Takeover) -> Result<(S, LeaseStore), BoxError> + Send + Sync>;

/// Why a member cannot take part in the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterError {
    /// Its options cannot work: why.
    Options(String),
    /// etcd keeps another number of shards for the prefix: why.
    Refused(String),
}

impl std::fmt::Display for ClusterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterError::Options(why) | ClusterError::Refused(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for ClusterError {}

/// A member as others see it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub url: String,
}

/// A member's registration under `{prefix}members/`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Registration {
    name: String,
    url: String,
    /// Its clock agrees with etcd's: it campaigns, and shards are assigned
    /// to it.
    #[serde(default)]
    ready: bool,
}

impl Registration {
    fn peer(&self) -> Peer {
        Peer {
            name: self.name.clone(),
            url: self.url.clone(),
        }
    }
}

/// One shard as this member sees it.
struct ShardView<S> {
    /// The shard's app and its primacy while this member leads it.
    serving: Option<(S, Arc<Primacy>)>,
    /// Who leads it, as last seen.
    primary: Option<Peer>,
    /// Since when (proxy clock) its election key was seen absent.
    vacant_since_ms: Option<u64>,
    /// The last member seen leading it.
    last_primary: Option<String>,
}

impl<S> ShardView<S> {
    /// The app, while this member's primacy of the shard is live.
    fn live_app(&self) -> Option<&S> {
        self.serving
            .as_ref()
            .filter(|(_, primacy)| primacy.is_live())
            .map(|(app, _)| app)
    }
}

struct View<S> {
    shards: Vec<ShardView<S>>,
    members: Vec<Registration>,
    /// The names of the members whose clocks are trusted, sorted, and the
    /// member the balanced assignment gives each shard to among them:
    /// computed when they change, not at every look.
    ready: Vec<String>,
    assignment: Vec<Option<String>>,
    /// The presence task's clock check: campaigns may start.
    clock_trusted: bool,
    /// Why the clock is not trusted, while it is found slow: every primary
    /// steps down.
    clock_slow: Option<String>,
    /// etcd keeps this member's number of shards for the prefix.
    shards_checked: bool,
}

impl<S> View<S> {
    /// How many shards this member leads now.
    fn led(&self) -> usize {
        self.shards.iter().filter(|s| s.serving.is_some()).count()
    }

    /// Takes in the registered members (and, if the members whose clocks
    /// are trusted changed, the assignment among them).
    fn set_members(&mut self, shards: u32, members: Vec<Registration>) {
        let mut ready: Vec<String> = members
            .iter()
            .filter(|m| m.ready)
            .map(|m| m.name.clone())
            .collect();
        ready.sort_unstable();
        ready.dedup();
        if ready != self.ready || self.assignment.is_empty() {
            self.assignment = assign(shards, &ready, None);
            self.ready = ready;
        }
        self.members = members;
    }

    /// The member the balanced assignment gives `shard` to, among the
    /// members whose clocks are trusted; `None` while none is known.
    fn assigned(&self, shard: u32) -> Option<&str> {
        self.assignment.get(shard as usize)?.as_deref()
    }

    /// [`View::assigned`] among those members but `without` (computed
    /// anew: only for a shard whose assigned member lost it).
    fn assigned_without(&self, shards: u32, shard: u32, without: &str) -> Option<String> {
        assign(shards, &self.ready, Some(without))
            .get(shard as usize)
            .cloned()
            .flatten()
    }

    /// The most shards one member should lead now.
    fn share(&self, shards: u32) -> usize {
        (shards as usize).div_ceil(self.ready.len().max(1))
    }
}

/// The member each shard goes to among `ready` (sorted names) but
/// `without`.
fn assign(shards: u32, ready: &[String], without: Option<&str>) -> Vec<Option<String>> {
    let names: Vec<&str> = ready
        .iter()
        .map(String::as_str)
        .filter(|n| Some(*n) != without)
        .collect();
    fencegate_core::shard::assign(shards, &names)
        .into_iter()
        .map(|owner| owner.map(|i| names[i].to_owned()))
        .collect()
}

struct Shared<S> {
    me: Peer,
    options: ClusterOptions,
    view: RwLock<View<S>>,
    /// Set when the process stops: the member steps down and leaves.
    stopping: tokio::sync::watch::Sender<bool>,
    /// How many of the member's tasks (presence, one elector per shard)
    /// have left.
    left: tokio::sync::watch::Sender<usize>,
    /// What etcd said of the number of shards, once it answered: `Err`
    /// with why the member cannot take part.
    checked: tokio::sync::watch::Sender<Option<Result<(), ClusterError>>>,
    /// The cluster's member key (in etcd at `{prefix}member-key`), once
    /// read: a request forwarded by a member carries it
    /// (`Fencegate-Member-Key`), which proves its `Fencegate-Forwarded`
    /// mark and `Fencegate-Shard` pin came from a member.
    member_key: std::sync::OnceLock<http::HeaderValue>,
    stats: Arc<ClusterStats>,
    /// With several shards: where requests go.
    sharded: Option<shards::Sharded<S>>,
    /// With several shards: the one etcd transaction of the log entries
    /// its shards write at the same time.
    committer: Option<committer::Committer>,
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
    /// at once and hands its etcd leases back, so other members take over
    /// without waiting for the TTL; a standby stops campaigning.
    pub fn stop(&self) {
        self.shared.stopping.send_replace(true);
    }

    /// Completes once the member has left after [`Member::stop`].
    pub async fn left(&self) {
        let tasks = self.shared.options.shards as usize + 1;
        let mut rx = self.shared.left.subscribe();
        let _ = rx.wait_for(|left| *left >= tasks).await;
    }

    /// Completes once etcd answered the check of the number of shards:
    /// `Err` with why if the member cannot take part in the cluster (etcd
    /// keeps another number for its prefix).
    pub async fn checked(&self) -> Result<(), ClusterError> {
        let mut rx = self.shared.checked.subscribe();
        let checked = rx.wait_for(Option::is_some).await.map(|r| r.clone());
        match checked {
            Ok(result) => result.unwrap_or(Ok(())),
            // The sender lives as long as the member: never.
            Err(_) => std::future::pending().await,
        }
    }

    /// Completes, with why, if the member cannot take part in the cluster.
    pub async fn failed(&self) -> ClusterError {
        match self.checked().await {
            Err(why) => why,
            Ok(()) => std::future::pending().await,
        }
    }

    /// The member's cluster counters (forwarded requests, handovers).
    pub fn stats(&self) -> &Arc<ClusterStats> {
        &self.shared.stats
    }

    fn task_left(&self) {
        self.shared.left.send_modify(|n| *n += 1);
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
        let leads = view.shards.iter().any(|s| s.live_app().is_some());
        let mut doc = serde_json::json!({
            "role": if leads { "primary" } else { "standby" },
            "name": self.shared.me.name,
            "url": self.shared.me.url,
            "primary": view.shards[0].primary,
            "members": view.members.iter().map(Registration::peer).collect::<Vec<_>>(),
            "shards": self.shared.options.shards,
        });
        if self.shared.options.shards > 1 {
            // No single primary: each shard has its own.
            doc["primary"] = serde_json::Value::Null;
            doc["leaders"] = view
                .shards
                .iter()
                .enumerate()
                .map(|(k, slot)| serde_json::json!({"shard": k, "primary": slot.primary}))
                .collect();
        }
        let mut res = Response::new(body::full(Bytes::from(doc.to_string())));
        res.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        res
    }

    /// What a member answers for shard `shard` while it does not serve it.
    fn not_primary(&self, shard: u32, path: &str) -> Response<Body> {
        if path == "/_fence/livez" {
            let mut res = Response::new(body::full(Bytes::from_static(b"{\"status\":\"live\"}")));
            res.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return res;
        }
        let view = self.view();
        let primary = view.shards[shard as usize]
            .primary
            .as_ref()
            .filter(|p| p.name != self.shared.me.name)
            .map(|p| p.url.as_str());
        let detail = match (primary, self.shared.options.shards) {
            (Some(_), 1) => "this member is a standby; send requests to the primary",
            (Some(_), _) => "another member leads this lease's shard; send requests to it",
            (None, _) => "no primary is known right now; retry shortly",
        };
        Problem::not_primary(detail, primary).into_response()
    }
}

impl<S, B> Service<Request<B>> for Member<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>
        + Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    <S as Service<Request<B>>>::Future: Send + 'static,
    <S as Service<Request<Body>>>::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let path = req.uri().path();
        if path == "/_fence/cluster" && matches!(*req.method(), Method::GET | Method::HEAD) {
            return Box::pin(std::future::ready(Ok(self.cluster_json())));
        }
        if self.shared.sharded.is_some() {
            let member = self.clone();
            // The client's body: its failures are the client's (a request
            // forwarded to another member tells them apart).
            let req = req.map(|b| body::boxed(body::from_client(b)));
            return Box::pin(async move { Ok(member.dispatch(req).await) });
        }
        let app = self.view().shards[0].live_app().cloned();
        match app {
            Some(app) => Box::pin(app.oneshot(req)),
            None => {
                let res = self.not_primary(0, path);
                Box::pin(std::future::ready(Ok(res)))
            }
        }
    }
}

/// Starts a member: its service, its presence task and an elector per
/// shard, which campaign and serve terms of primacy through `client`.
/// `sharding` is how requests find their shard, for more than one shard.
pub fn start<S>(
    client: EtcdClient,
    options: ClusterOptions,
    clock: Clock,
    make_app: MakeApp<S>,
    sharding: Option<Sharding<S>>,
    stats: Arc<ClusterStats>,
) -> Result<Member<S>, ClusterError>
where
    S: Send + Sync + 'static,
{
    let shards = options.shards;
    let sharded = match sharding {
        Some(sharding) if shards > 1 => {
            Some(shards::Sharded::new(&options, sharding, stats.clone())?)
        }
        None if shards > 1 => {
            return Err(ClusterError::Options(
                "several shards need a way to route requests".into(),
            ))
        }
        _ => None,
    };
    let member = Member {
        shared: Arc::new(Shared {
            me: Peer {
                name: options.name.clone(),
                url: options.advertise.clone(),
            },
            options: options.clone(),
            view: RwLock::new(View {
                shards: (0..shards)
                    .map(|_| ShardView {
                        serving: None,
                        primary: None,
                        vacant_since_ms: None,
                        last_primary: None,
                    })
                    .collect(),
                members: Vec::new(),
                ready: Vec::new(),
                assignment: Vec::new(),
                clock_trusted: false,
                clock_slow: None,
                shards_checked: false,
            }),
            stopping: tokio::sync::watch::channel(false).0,
            left: tokio::sync::watch::channel(0).0,
            checked: tokio::sync::watch::channel(None).0,
            member_key: std::sync::OnceLock::new(),
            stats,
            committer: (shards > 1).then(|| committer::Committer::start(client.clone())),
            sharded,
        }),
    };
    let presence = presence::Presence::new(
        client.clone(),
        options.clone(),
        clock.clone(),
        member.clone(),
    );
    tokio::spawn(presence.run());
    for shard in 0..shards {
        let elector = elector::Elector::new(
            client.clone(),
            options.clone(),
            clock.clone(),
            make_app.clone(),
            member.clone(),
            shard,
        );
        tokio::spawn(elector.run());
    }
    Ok(member)
}

impl<S> std::fmt::Debug for Member<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("me", &self.shared.me)
            .finish()
    }
}
