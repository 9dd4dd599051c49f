//! A cluster of real fencegate members on a real three-member etcd
//! cluster, in front of a recording backend, for the cluster and shard
//! tests; and the loadtest run beside them.

use std::time::Duration;

use fencegate::clock::Stopwatch;
use serde_json::json;

use super::proc::{Proc, TempDir};
use super::servers::{free_port, EtcdCluster};
use super::{
    handover_violations, held_from, metric, Event, Held, HoldingBackend, HttpClient, Req, Resp,
};

/// The members' etcd lease TTL: a dead primary is replaced within about
/// this long (etcd's own minimum is about 1.5 s).
pub const TTL_MS: u64 = 3_000;

/// How many clusters (three etcd members and their fencegates each) the
/// tests run at once: on a small machine more would starve etcd, and a
/// primary whose keepalive answers come late fences itself.
pub static CLUSTERS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(3);

/// A cluster of fencegate members in front of one recording backend.
pub struct Members {
    pub etcd: EtcdCluster,
    pub backend: Proc,
    pub members: Vec<Option<Proc>>,
    /// The storage the members front.
    pub upstream: String,
    /// Each member's port: a restarted member keeps its URL.
    pub ports: Vec<u16>,
    pub dir: TempDir,
    pub env: Vec<(String, String)>,
    /// Dropped last (fields drop in order): the slot frees once every
    /// process above has been stopped.
    _slot: tokio::sync::SemaphorePermit<'static>,
}

impl Members {
    pub async fn start(n: usize, env: &[(&str, &str)]) -> Self {
        Self::start_on(n, env, None).await
    }

    /// [`Members::start`] in front of `upstream` instead of the recording
    /// backend.
    pub async fn start_on(n: usize, env: &[(&str, &str)], upstream: Option<String>) -> Self {
        let slot = CLUSTERS.acquire().await.unwrap();
        let etcd = EtcdCluster::start(3).await;
        let dir = TempDir::new("cluster");
        let backend = Proc::start(
            &["backend", "--listen", "127.0.0.1:0", "--record"],
            &dir.path().join("backend.log"),
            &[],
        );
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for (k, v) in [
            ("FENCEGATE_CLUSTER__TTL_MS", TTL_MS.to_string()),
            ("FENCEGATE_CLUSTER__MARGIN_MS", "500".to_owned()),
            ("FENCEGATE_LOG", "info".to_owned()),
        ] {
            if !env.iter().any(|(key, _)| key == k) {
                env.push((k.to_owned(), v));
            }
        }
        let upstream = upstream.unwrap_or_else(|| backend.url.clone());
        let mut members = Members {
            _slot: slot,
            etcd,
            backend,
            upstream,
            members: Vec::new(),
            ports: (0..n.max(3)).map(|_| free_port()).collect(),
            dir,
            env,
        };
        for i in 0..n {
            let member = members.spawn(i);
            members.members.push(Some(member));
        }
        members
    }

    pub fn spawn(&self, i: usize) -> Proc {
        self.spawn_with(i, &self.etcd.endpoints())
    }

    /// Member `i`, reaching etcd at `etcd` (comma-separated URLs).
    pub fn spawn_with(&self, i: usize, etcd: &str) -> Proc {
        self.spawn_env(i, etcd, &[])
    }

    /// Member `i` whose every clock runs at `rate` of real time
    /// (libfaketime preloaded: monotonic, boot time and wall clock alike).
    pub fn spawn_slowed(&self, i: usize, rate: &str) -> Proc {
        let lib = super::tools::program("libfaketimeMT.so.1");
        let lib = lib.to_string_lossy().into_owned();
        let rate = format!("+0 x{rate}");
        let env = [("LD_PRELOAD", lib.as_str()), ("FAKETIME", rate.as_str())];
        self.spawn_env(i, &self.etcd.endpoints(), &env)
    }

    pub fn spawn_env(&self, i: usize, etcd: &str, extra: &[(&str, &str)]) -> Proc {
        let name = format!("m{i}");
        let listen = format!("127.0.0.1:{}", self.ports[i]);
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(extra.iter().copied())
            .collect();
        Proc::start(
            &[
                "serve",
                "--listen",
                &listen,
                "--upstream",
                &self.upstream,
                "--etcd",
                etcd,
                "--name",
                &name,
            ],
            &self.dir.path().join(format!("{name}.log")),
            &env,
        )
    }

    /// A client of the cluster's etcd, to look at (or meddle with) the
    /// members' keys.
    pub fn etcd_client(&self) -> fencegate::etcd::EtcdClient {
        let options = fencegate::etcd::EtcdOptions {
            timeout_ms: 2000,
            ..Default::default()
        };
        fencegate::etcd::EtcdClient::new(&self.etcd.urls(), &options).unwrap()
    }

    pub fn url(&self, i: usize) -> String {
        self.members[i]
            .as_ref()
            .expect("member running")
            .url
            .clone()
    }

    pub fn client(&self, i: usize) -> HttpClient {
        HttpClient::new(&self.url(i))
    }

    /// The index of the member that serves as primary, waiting up to
    /// `within` (real time: an etcd lease running out, then a campaign).
    pub async fn primary(&self, within: Duration) -> usize {
        let start = Stopwatch::start();
        loop {
            for (i, m) in self.members.iter().enumerate() {
                let Some(m) = m else { continue };
                // A paused member never answers: ask briefly.
                let c = HttpClient::new(&m.url);
                let asked = c.try_send(Req::new("GET", "/_fence/cluster"));
                if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_millis(500), asked).await {
                    if r.status == 200 && r.json()["role"] == "primary" {
                        return i;
                    }
                }
            }
            assert!(
                start.elapsed_ms() < within.as_millis() as u64,
                "no primary within {within:?}; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (bounded, real time: an etcd lease running out, then a
    /// campaign) until member `i` serves as primary.
    pub async fn becomes_primary(&self, i: usize, within: Duration) {
        let c = self.client(i);
        let start = Stopwatch::start();
        loop {
            let view = c.send(Req::new("GET", "/_fence/cluster")).await.json();
            if view["role"] == "primary" {
                return;
            }
            assert!(
                start.elapsed_ms() < within.as_millis() as u64,
                "member {i} never became primary: {view}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (bounded, real time: a standby polls etcd about every second)
    /// until member `i` names member `primary` as the primary and lists
    /// every running member.
    pub async fn knows_primary(&self, i: usize, primary: usize) -> serde_json::Value {
        let c = self.client(i);
        let url = self.url(primary);
        let start = Stopwatch::start();
        loop {
            let view = c.send(Req::new("GET", "/_fence/cluster")).await.json();
            let running = self.members.iter().flatten().count();
            if view["primary"]["url"] == url.as_str()
                && view["members"].as_array().map(Vec::len) == Some(running)
            {
                return view;
            }
            assert!(start.elapsed_ms() < 10_000, "{view}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Two members settled: (the primary, the standby that knows it).
    pub async fn pair(&self) -> (usize, usize) {
        let p = self.primary(Duration::from_secs(20)).await;
        let s = 1 - p;
        self.knows_primary(s, p).await;
        (p, s)
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(p) = self.members[i].take() {
            p.kill9();
        }
    }

    /// The backend's apply log: (lease path, token) in apply order.
    pub async fn applied(&self) -> Vec<(String, u64)> {
        let r = HttpClient::new(&self.backend.url)
            .send(Req::new("GET", "/_fence/backend/history"))
            .await;
        r.json()["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["key"].as_str().unwrap_or_default().to_owned(),
                    e["token"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    }

    pub fn logs(&self) -> String {
        self.members
            .iter()
            .flatten()
            .map(|p| format!("--- {}\n{}", p.url, p.log_text()))
            .collect()
    }
}

pub fn acquire(lease: &str, holder: &str) -> Req {
    Req::new("POST", &format!("/_fence/leases/{lease}"))
        .json(json!({"holder": holder, "ttl_ms": 20_000}))
}

pub fn put(lease: &str, held: &Held, body: &str) -> Req {
    Req::new("PUT", &format!("/kv/{lease}"))
        .held(held)
        .body(body.to_owned())
}

/// Writes `x` with a term newer than those the primary found at takeover:
/// held back until the previous primary's writes have settled (the upstream
/// deadline plus the settle time from takeover), so retried as told.
pub async fn put_after_takeover(c: &HttpClient, held: &Held, body: &str) {
    put_after_takeover_of(c, "x", held, body).await;
}

/// [`put_after_takeover`] for lease `lease`.
pub async fn put_after_takeover_of(c: &HttpClient, lease: &str, held: &Held, body: &str) {
    for _ in 0..20 {
        let r = c.send(put(lease, held, body)).await;
        if r.status.is_success() {
            return;
        }
        assert_eq!(r.reason(), "upstream-timeout", "{}", r.text());
        let secs: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }
    panic!("the newer term never got to write");
}

/// Through the new primary `c`: the holder of term `a` of `x` renews and
/// releases it, and another holder's newer term writes.
pub async fn hand_over(c: &HttpClient, a: &Held) {
    let r = c
        .send(Req::new("POST", "/_fence/leases/x/renew").held(a))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = c.send(Req::new("DELETE", "/_fence/leases/x").held(a)).await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = c.send(acquire("x", "b")).await;
    let b = held_from(&r);
    assert!(b.token > a.token);
    put_after_takeover(c, &b, "b1").await;
}

/// `fencegate loadtest` through `targets`, checked against the members'
/// recording backend (lease TTL 1 s), running beside the test.
pub struct Load {
    child: std::process::Child,
    report: std::path::PathBuf,
    output: std::path::PathBuf,
}

impl Load {
    pub fn start(m: &Members, targets: &str, args: &[&str]) -> Self {
        let report = m.dir.path().join("report.json");
        let output = m.dir.path().join("loadtest.out");
        let out = std::fs::File::create(&output).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(["loadtest", "--target", targets, "--history", &m.backend.url])
            // --keep: members may still be down when the run ends.
            .args(["--ttl", "1s", "--keep"])
            .args(args)
            .arg("--json")
            .arg(&report)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Self {
            child,
            report,
            output,
        }
    }

    /// Sends `sig` (`-STOP`, `-CONT`) to the load tester.
    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new(super::tools::program("kill"))
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill {sig} failed");
    }

    /// Waits for the run's end: its exit status and its JSON report.
    pub fn finish(mut self) -> (std::process::ExitStatus, serde_json::Value) {
        let status = self.child.wait().unwrap();
        match std::fs::read_to_string(&self.report) {
            Ok(text) => (status, serde_json::from_str(&text).unwrap()),
            Err(_) => panic!(
                "the loadtest wrote no report ({status}): {}",
                std::fs::read_to_string(&self.output).unwrap_or_default()
            ),
        }
    }
}

/// Every lease's tokens never go down in the apply log.
pub fn assert_tokens_never_go_back(applied: &[(String, u64)]) {
    let mut newest = std::collections::HashMap::new();
    for (key, token) in applied {
        let last = newest.entry(key.clone()).or_insert(0);
        assert!(
            token >= last,
            "{key}: token {token} applied after {last}: {applied:?}"
        );
        *last = *token;
    }
}

/// The URL of the member serving as primary now.
pub async fn targets_primary(m: &Members) -> String {
    m.url(m.primary(Duration::from_secs(20)).await)
}

/// The end of a test with term 1's write held at a [`HoldingBackend`]
/// ("slow", its request `slow`) while term 2's write `newer` goes through
/// the member `metrics`: waits (bounded) until `newer` reached the backend,
/// waits at that member's barrier (counted in its metrics) or finished;
/// then lets the slow write finish and waits (bounded) until the backend
/// applied it. Term 2's answer, and how many writes of an older term the
/// backend finished after one of a newer term.
pub async fn let_the_slow_write_finish<T>(
    backend: &HoldingBackend,
    metrics: &HttpClient,
    newer: tokio::task::JoinHandle<Resp>,
    slow: tokio::task::JoinHandle<T>,
) -> (Resp, usize) {
    for _ in 0..500 {
        let text = metrics
            .send(Req::new("GET", "/_fence/metrics"))
            .await
            .text();
        let held = metric(&text, "fencegate_barrier_waits_total").is_some_and(|v| v != "0");
        if held || backend.arrived("b1") || newer.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    backend.open("slow");
    let r = newer.await.unwrap();
    let _ = slow.await;
    // The backend applies term 1's write once opened, sender gone or not.
    for _ in 0..200 {
        let finished = backend
            .events()
            .iter()
            .any(|e| matches!(e, Event::Finish { id, .. } if id == "slow"));
        if finished {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (r, handover_violations(&backend.events()))
}
