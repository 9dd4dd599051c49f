//! `fencegate loadtest` end to end with the real binaries: a recording
//! backend, fencegate in front of it, and the same workload through the proxy
//! and straight to the backend.

mod support;

use std::process::Command;

use support::proc::{proxy_to, recording_backend, serve_args, Proc, TempDir};

fn loadtest(args: &[&str], json: &std::path::Path) -> (i32, serde_json::Value, String) {
    loadtest_writes(args, "2000", json)
}

fn loadtest_writes(
    args: &[&str],
    writes: &str,
    json: &std::path::Path,
) -> (i32, serde_json::Value, String) {
    loadtest_env(args, writes, json, &[])
}

fn loadtest_env(
    args: &[&str],
    writes: &str,
    json: &std::path::Path,
    env: &[(&str, &str)],
) -> (i32, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .envs(env.iter().copied())
        .arg("loadtest")
        .args(args)
        .args([
            "--writers",
            "8",
            "--leases",
            "4",
            "--writes",
            writes,
            "--ttl",
            "300ms",
        ])
        .args(["--pause-prob", "0.1", "--seed", "42", "--json"])
        .arg(json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let report = std::fs::read_to_string(json).unwrap_or_else(|_| {
        panic!(
            "no report: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_str(&report).unwrap(),
        stdout,
    )
}

/// The same workload through the proxy and straight to the recording
/// backend, each checked by both checkers: the apply log and reading back
/// every key (the backend serves reads). They agree: nothing stale lands
/// through the proxy; straight to the backend, both see stale writes.
#[test]
fn through_the_proxy_nothing_stale_lands_and_straight_to_the_backend_it_does() {
    let dir = TempDir::new("loadtest");
    let backend = recording_backend(&dir);
    let proxy = proxy_to(&dir, &backend.url, &[]);

    let both = ["--verify", "both"];
    let (code, r, stdout) = loadtest(
        &[
            &["--target", &proxy.url, "--history", &backend.url],
            &both[..],
        ]
        .concat(),
        &dir.path().join("proxy.json"),
    );
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(r["verify"], serde_json::json!(["history", "read-back"]));
    for checker in ["history", "read-back"] {
        let f = &r["by_checker"][checker];
        assert_eq!(f["stale_writes_applied"], 0, "{checker}: {stdout}");
        assert_eq!(f["acknowledged_missing"], 0, "{checker}: {stdout}");
        assert_eq!(f["rejected_present"], 0, "{checker}: {stdout}");
    }
    let f = &r["findings"];
    assert!(
        f["stale_attempts_rejected"].as_u64().unwrap() >= 200,
        "{stdout}"
    );
    assert_eq!(
        f["stale_attempts_rejected"], f["stale_attempts"],
        "{stdout}"
    );
    assert_eq!(f["writes_attempted"], 2000);
    assert_eq!(f["shared_key_regressions"], 0, "{stdout}");
    assert!(f["shared_keys_checked"].as_u64().unwrap() > 50, "{stdout}");
    assert_eq!(f["reads_failed"], 0, "{stdout}");
    assert!(stdout.contains("SAFE: no stale write reached the storage"));
    // Every key the run wrote is gone again.
    assert_eq!(r["cleanup"]["failed"], 0, "{stdout}");
    assert!(r["cleanup"]["deleted"].as_u64().unwrap() > 500, "{stdout}");

    // The same workload without fencing: stale writes land, both checkers
    // see them, and the run fails.
    let (code, r, stdout) = loadtest(
        &[
            &["--target", &proxy.url, "--direct", &backend.url],
            &both[..],
        ]
        .concat(),
        &dir.path().join("direct.json"),
    );
    assert_eq!(code, 1, "{stdout}");
    for checker in ["history", "read-back"] {
        let applied = r["by_checker"][checker]["stale_writes_applied"].as_u64();
        assert!(applied.unwrap() > 0, "{checker}: {stdout}");
    }
    assert_eq!(r["safe"], false);
    assert!(stdout.contains("UNSAFE"));
}

#[test]
fn a_run_that_never_exercised_the_fault_does_not_pass() {
    let dir = TempDir::new("loadtest-quiet");
    let log = dir.path().join("servers.log");
    let data = dir.path().join("data");
    // The embedded backend records when told to by config.
    let proxy = Proc::start(
        &serve_args(&data, false),
        &log,
        &[("FENCEGATE_EMBEDDED__RECORD", "true")],
    );
    let json = dir.path().join("quiet.json");
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args([
            "loadtest",
            "--target",
            &proxy.url,
            "--writes",
            "50",
            "--pause-prob",
            "0",
            "--ttl",
            "2s",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("INCONCLUSIVE"), "{stdout}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["findings"]["stale_writes_applied"], 0);
    assert_eq!(r["findings"]["acknowledged"], 50);
}

/// Seen failing before: an unreachable target was retried every 10 ms,
/// forever, with no output. Now the run fails once the lease API has not
/// answered for a few seconds. (Real time: the loadtest's own limit; the
/// margin is wide.)
#[test]
fn an_unreachable_target_fails_the_run_instead_of_hanging() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["loadtest", "--target", &format!("http://127.0.0.1:{port}")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = fencegate::clock::Stopwatch::start();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed_ms() > 60_000 {
            let _ = child.kill();
            panic!("the load test hung on an unreachable target");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot reach"), "{stderr}");

    // An unreachable apply log fails the run before it starts, too.
    let dir = TempDir::new("loadtest-no-history");
    let proxy = Proc::start(
        &serve_args(&dir.path().join("data"), false),
        &dir.path().join("fencegate.log"),
        &[],
    );
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["loadtest", "--target", &proxy.url])
        .args(["--history", &format!("http://127.0.0.1:{port}")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot read the apply log"), "{stderr}");
    assert!(out.stdout.is_empty(), "the run started");
}

/// What the relay does to one request.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Pass it on, and the answer back.
    None,
    /// Pass it on, then drop the connection instead of answering (a service
    /// error makes hyper close it unanswered).
    DropAnswer,
    /// Hold it this many milliseconds before passing it on (a slow storage
    /// that applies it late).
    Delay(u64),
}

/// A relay in front of `backend_url` on a loopback port: every request is
/// passed on, with the fault `fault(request)` says.
async fn relay(
    backend_url: String,
    fault: impl Fn(&http::request::Parts) -> Fault + Clone + Send + Sync + 'static,
) -> String {
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let client: Client<_, fencegate::body::Body> =
        Client::builder(TokioExecutor::new()).build_http();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let relay = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let (client, backend_url, fault) = (client.clone(), backend_url.clone(), fault.clone());
        async move {
            let (mut parts, body) = req.into_parts();
            let fault = fault(&parts);
            if let Fault::Delay(ms) = fault {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            let pq = parts
                .uri
                .path_and_query()
                .map_or("/", |pq| pq.as_str())
                .to_owned();
            parts.uri = format!("{backend_url}{pq}").parse().unwrap();
            let res = client
                .request(http::Request::from_parts(
                    parts,
                    fencegate::body::boxed(body),
                ))
                .await
                .map_err(std::io::Error::other)?;
            let (parts, body) = res.into_parts();
            let body = body
                .collect()
                .await
                .map_err(std::io::Error::other)?
                .to_bytes();
            if fault == Fault::DropAnswer {
                return Err(std::io::Error::other(
                    "connection dropped after the backend applied the write",
                ));
            }
            Ok::<_, std::io::Error>(http::Response::from_parts(
                parts,
                fencegate::body::full(body),
            ))
        }
    });
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let relay = relay.clone();
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, relay)
                    .await;
            });
        }
    });
    url
}

/// A backend fault: a relay between fencegate and the recording backend
/// drops the connection after the backend applied every 25th write, so
/// fencegate answers `502 upstream-error` for writes that did land. Both
/// checkers (the apply log, and reading every key back) count them as
/// outcome unknown, and the run passes.
///
/// Seen failing when every answer with a reason counted as rejected: the
/// same run said "rejected but applied" and UNSAFE, with no stale write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_faults_are_outcome_unknown_not_violations() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    let dir = TempDir::new("loadtest-faults");
    let backend = recording_backend(&dir);
    let puts = Arc::new(AtomicU64::new(0));
    let relay_url = relay(backend.url.clone(), move |req| {
        if req.method == http::Method::PUT && puts.fetch_add(1, Ordering::Relaxed) % 25 == 24 {
            Fault::DropAnswer
        } else {
            Fault::None
        }
    })
    .await;
    let proxy = proxy_to(&dir, &relay_url, &[]);
    let json = dir.path().join("faults.json");
    let args = [
        "--target",
        &proxy.url,
        "--history",
        &backend.url,
        "--verify",
        "both",
    ]
    .map(str::to_owned);
    let (code, r, stdout) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        loadtest_writes(&args, "600", &json)
    })
    .await
    .unwrap();
    let f = &r["findings"];
    for checker in ["history", "read-back"] {
        let f = &r["by_checker"][checker];
        assert_eq!(f["rejected_present"], 0, "{checker}: {stdout}");
        assert_eq!(f["acknowledged_missing"], 0, "{checker}: {stdout}");
        assert_eq!(f["stale_writes_applied"], 0, "{checker}: {stdout}");
    }
    assert_eq!(f["shared_key_regressions"], 0, "{stdout}");
    assert_eq!(code, 0, "{stdout}");
    assert!(f["outcome_unknown"].as_u64().unwrap() >= 10, "{stdout}");
    assert!(stdout.contains("SAFE"), "{stdout}");
    assert!(stdout.contains("outcome unknown"), "{stdout}");
}

/// `--direct` sends the writes to the storage itself: never with the lease
/// id, a live credential for fencegate that the storage has no use for.
/// Seen failing before: every direct write carried `Fencing-Lease-Id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_run_never_sends_the_lease_id_to_the_storage() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    let dir = TempDir::new("loadtest-direct-id");
    let backend = recording_backend(&dir);
    let proxy = proxy_to(&dir, &backend.url, &[]);
    let (writes, with_id) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let counts = (writes.clone(), with_id.clone());
    let relay_url = relay(backend.url.clone(), move |req| {
        if req.method == http::Method::PUT {
            counts.0.fetch_add(1, Ordering::Relaxed);
            if req.headers.contains_key("fencing-lease-id") {
                counts.1.fetch_add(1, Ordering::Relaxed);
            }
        }
        Fault::None
    })
    .await;
    let json = dir.path().join("direct.json");
    let args = ["--target", &proxy.url, "--direct", &relay_url].map(str::to_owned);
    let (_, _, stdout) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        loadtest_writes(&args, "200", &json)
    })
    .await
    .unwrap();
    assert_eq!(writes.load(Ordering::Relaxed), 200, "{stdout}");
    assert_eq!(with_id.load(Ordering::Relaxed), 0, "{stdout}");
}

/// The proxy killed (SIGKILL) and restarted on the same port and data
/// directory over and over during a run: the load test keeps going (each
/// restart is short), and no token is issued twice. (Real time: the
/// restarts; the margins are wide.)
#[test]
fn a_run_goes_on_through_many_crashes_and_sees_no_token_twice() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let dir = TempDir::new("loadtest-crashes");
    let backend = recording_backend(&dir);
    let port = support::servers::free_port();
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().join("data");
    let args: Vec<String> = [
        "serve",
        "--listen",
        &listen,
        "--upstream",
        &backend.url,
        "--data-dir",
        data.to_str().unwrap(),
    ]
    .map(str::to_owned)
    .to_vec();
    let env = [
        ("FENCEGATE_PROXY__TIMEOUT_MS", "1000"),
        ("FENCEGATE_FENCE__SETTLE_MS", "100"),
    ];
    let log = dir.path().join("proxy.log");
    let done = Arc::new(AtomicBool::new(false));
    let killer = std::thread::spawn({
        let (done, args, log) = (done.clone(), args.clone(), log.clone());
        move || {
            let mut proxy = Proc::start(&args, &log, &env);
            let mut kills = 0;
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(400));
                proxy.kill9();
                kills += 1;
                proxy = Proc::start(&args, &log, &env);
            }
            drop(proxy);
            kills
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let json = dir.path().join("crashes.json");
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args([
            "loadtest",
            "--target",
            &format!("http://{listen}"),
            "--history",
            &backend.url,
        ])
        .args([
            "--writers",
            "4",
            "--leases",
            "4",
            "--duration",
            "8s",
            "--ttl",
            "500ms",
        ])
        // --keep: the proxy is killed until the load test exits, so a
        // cleanup through it would spend its time waiting out restarts.
        .args([
            "--pause-prob",
            "0.1",
            "--seed",
            "7",
            "--min-stale",
            "0",
            "--keep",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    done.store(true, Ordering::Relaxed);
    let kills = killer.join().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(kills >= 10, "only {kills} kills");
    assert!(!stderr.contains("cannot reach"), "{stderr}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let f = &r["findings"];
    assert_eq!(f["tokens_issued_twice"], 0, "{stdout}");
    assert_eq!(f["stale_writes_applied"], 0, "{stdout}");
    assert!(f["acknowledged"].as_u64().unwrap() > 0, "{stdout}");
}

/// The run over `upstream` (a recording backend behind a relay that holds
/// every sixth write 800 ms before the backend applies it, past the 300 ms
/// TTL), checked by both checkers, with the takeover barrier on or off.
async fn slow_writes_across_handovers(barrier: bool) -> (i32, serde_json::Value, String) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    let dir = TempDir::new("loadtest-barrier");
    let backend = recording_backend(&dir);
    let puts = Arc::new(AtomicU64::new(0));
    let relay_url = relay(backend.url.clone(), move |req| {
        if req.method == http::Method::PUT && puts.fetch_add(1, Ordering::Relaxed) % 6 == 5 {
            Fault::Delay(800)
        } else {
            Fault::None
        }
    })
    .await;
    let barrier = if barrier { "true" } else { "false" };
    let env = [
        ("FENCEGATE_FENCE__DRAIN_BARRIER", barrier),
        ("FENCEGATE_ALLOW_UNSAFE_SETTINGS", "true"),
    ];
    let proxy = proxy_to(&dir, &relay_url, &env);
    let json = dir.path().join("barrier.json");
    let args = [
        "--target",
        &proxy.url,
        "--history",
        &backend.url,
        "--verify",
        "both",
    ]
    .map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        loadtest_writes(&args, "800", &json)
    })
    .await
    .unwrap()
}

/// With the barrier, a new term's writes wait for the old term's slow
/// write: both checkers find nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_writes_across_handovers_land_in_term_order() {
    let (code, r, stdout) = slow_writes_across_handovers(true).await;
    assert_eq!(code, 0, "{stdout}");
    for checker in ["history", "read-back"] {
        let f = &r["by_checker"][checker];
        assert_eq!(f["stale_writes_applied"], 0, "{checker}: {stdout}");
        assert_eq!(f["shared_key_regressions"], 0, "{checker}: {stdout}");
    }
}

/// A planted bug: the barrier switched off (`fence.drain_barrier = false`).
/// A new term's writes overtake the old term's slow ones at the storage;
/// the apply log shows it, and so does reading back the keys consecutive
/// terms share, whose final values come from the older term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_barrier_both_checkers_see_an_older_term_land_last() {
    let (code, r, stdout) = slow_writes_across_handovers(false).await;
    assert_eq!(code, 1, "{stdout}");
    let history = &r["by_checker"]["history"];
    assert!(
        history["stale_writes_applied"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    let read_back = &r["by_checker"]["read-back"];
    assert!(
        read_back["shared_key_regressions"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    assert!(stdout.contains("UNSAFE"), "{stdout}");
}

/// `fencegate serve` in front of `upstream` with these route patterns
/// (and `extra` config lines), on a free loopback port.
fn serve_routes(dir: &TempDir, upstream: &str, routes: &[&str], extra: &str) -> Proc {
    let config = dir.path().join("fencegate.toml");
    let mut text = extra.to_owned();
    for pattern in routes {
        text.push_str(&format!("\n[[fence.routes]]\npattern = \"{pattern}\"\n"));
    }
    std::fs::write(&config, text).unwrap();
    let data = dir.path().join("data");
    Proc::start(
        &[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.path().join("servers.log"),
        &[],
    )
}

/// The same workload (pauses and skew) through fencegate at `target` and
/// straight to `storage`, with `layout` (`--path` and friends), checked
/// by reading back every key: the fenced run is SAFE with every stale
/// attempt refused, the direct one UNSAFE with stale writes applied.
async fn fenced_and_direct(
    dir: &TempDir,
    target: &str,
    storage: &str,
    layout: &[&str],
    env: &[(&'static str, &'static str)],
) {
    let run = |args: Vec<String>, name: &str| {
        let json = dir.path().join(name);
        let env = env.to_vec();
        async move {
            tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                loadtest_env(&args, "600", &json, &env)
            })
            .await
            .unwrap()
        }
    };
    let mut fenced: Vec<String> = ["--target", target, "--skew", "100ms"]
        .into_iter()
        .chain(layout.iter().copied())
        .map(str::to_owned)
        .collect();
    let mut direct = fenced.clone();
    direct.extend(["--direct".to_owned(), storage.to_owned()]);
    fenced.push("--html".to_owned());
    fenced.push(dir.path().join("fenced.html").display().to_string());

    let (code, r, stdout) = run(fenced, "fenced.json").await;
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(r["verify"], serde_json::json!(["read-back"]), "{stdout}");
    let f = &r["findings"];
    assert_eq!(f["writes_attempted"], 600, "{stdout}");
    assert!(f["stale_attempts"].as_u64().unwrap() > 0, "{stdout}");
    assert_eq!(
        f["stale_attempts_rejected"], f["stale_attempts"],
        "{stdout}"
    );
    assert_eq!(f["reads_failed"], 0, "{stdout}");
    assert!(f["shared_keys_checked"].as_u64().unwrap() > 10, "{stdout}");
    assert_eq!(r["cleanup"]["failed"], 0, "{stdout}");
    assert!(
        stdout.contains("checked by reading back every key"),
        "{stdout}"
    );
    assert!(stdout.contains("SAFE: no stale write reached the storage"));
    let page = std::fs::read_to_string(dir.path().join("fenced.html")).unwrap();
    assert!(page.contains("checked by reading back every key"));

    let (code, r, stdout) = run(direct, "direct.json").await;
    assert_eq!(code, 1, "{stdout}");
    let f = &r["findings"];
    assert!(f["stale_writes_applied"].as_u64().unwrap() > 0, "{stdout}");
    assert_eq!(f["acknowledged_missing"], 0, "{stdout}");
    assert!(stdout.contains("UNSAFE"), "{stdout}");
}

/// Every regular file under `dir`.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(files_under(&path));
        } else {
            found.push(path);
        }
    }
    found
}

/// In front of nginx's WebDAV, over HTTPS end to end (a private CA):
/// fenced SAFE, direct UNSAFE, and the run's files deleted afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_back_in_front_of_nginx_webdav_over_https() {
    let dir = TempDir::new("loadtest-nginx");
    let support::servers::TestCa { ca, cert, key } = support::servers::TestCa::new(dir.path());
    let nginx = support::servers::nginx_tls(&cert, &key).await;
    let tls = format!(
        "[tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n[proxy]\nupstream_ca_file = {ca:?}\n"
    );
    let proxy = serve_routes(&dir, &nginx.url, &["/dav/{lease}"], &tls);
    assert!(proxy.url.starts_with("https://"), "{}", proxy.url);
    let ca = ca.display().to_string();
    let layout = ["--path", "/dav/{lease}/{key}", "--cacert", &ca];
    fenced_and_direct(&dir, &proxy.url, &nginx.url, &layout, &[]).await;
    // The fenced run cleaned up after itself; the direct one too.
    assert_eq!(
        files_under(&nginx.root.join("dav")),
        Vec::<std::path::PathBuf>::new()
    );
}

/// In front of etcd's v2 keys API: a form body, etcd's JSON answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_back_in_front_of_etcd_v2() {
    let dir = TempDir::new("loadtest-etcd");
    let etcd = support::servers::etcd().await;
    let proxy = serve_routes(&dir, &etcd.url, &["/v2/keys/{lease}"], "");
    let layout = [
        "--path",
        "/v2/keys/{lease}/{key}",
        "--body",
        "value={value}",
        "--content-type",
        "application/x-www-form-urlencoded",
    ];
    fenced_and_direct(&dir, &proxy.url, &etcd.url, &layout, &[]).await;
    // Nothing of the runs is left under the leases' directories.
    let c = support::HttpClient::new(&etcd.url);
    for lease in 0..4 {
        let r = c
            .send(support::Req::new("GET", &format!("/v2/keys/lt-{lease}")))
            .await;
        let nodes = r.json()["node"]["nodes"].as_array().map_or(0, Vec::len);
        assert_eq!(nodes, 0, "{}", r.text());
    }
}

/// In front of S3 (Garage, one node), with the repo's S3 example
/// configuration (`config/examples/s3.toml`: Host passed on unchanged, so
/// the signature holds): every storage request signed with AWS Signature
/// V4 (`--s3-region`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_back_in_front_of_s3() {
    let dir = TempDir::new("loadtest-s3");
    let garage = support::servers::garage().await;
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/s3.toml");
    let data = dir.path().join("data");
    let proxy = Proc::start(
        &[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &garage.server.url,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.path().join("servers.log"),
        &[],
    );
    let (key_id, secret) = support::servers::GARAGE_KEY;
    let env = [
        ("AWS_ACCESS_KEY_ID", key_id),
        ("AWS_SECRET_ACCESS_KEY", secret),
    ];
    let layout = [
        "--path",
        "/orders-bucket/{lease}/{key}",
        "--s3-region",
        garage.region,
    ];
    fenced_and_direct(&dir, &proxy.url, &garage.server.url, &layout, &env).await;
}

/// `fencegate serve` with a route whose preconditions are `preconditions`
/// in front of `upstream`, on a free port, with a settle time of 300 ms.
fn proxy_with_route(
    dir: &TempDir,
    name: &str,
    upstream: &str,
    route: &str,
    preconditions: &str,
    extra: &str,
) -> Proc {
    let config = format!(
        "{extra}\n[fence]\nsettle_ms = 300\n[[fence.routes]]\npattern = \"{route}\"\n\
         preconditions = \"{preconditions}\"\n"
    );
    support::proc::serve_config(dir, name, &config, upstream, None)
}

/// A load test whose writes sometimes reach `storage` late, through the
/// load tester's relay on `relay_port` (the proxy's upstream).
fn late_loadtest(
    target: &str,
    storage: &str,
    relay_port: u16,
    extra: &[&str],
    json: &std::path::Path,
    env: &[(&str, &str)],
) -> (i32, serde_json::Value, String) {
    let relay = format!("127.0.0.1:{relay_port}");
    let args = [
        &[
            "--target",
            target,
            "--late-writes",
            "0.3",
            // Longer than the proxy's settle time (300 ms), and than the
            // term (300 ms): the next holder writes the key meanwhile.
            "--late-by",
            "900ms",
            "--relay-to",
            storage,
            "--relay-listen",
            &relay,
        ][..],
        extra,
    ]
    .concat();
    loadtest_env(&args, "1500", json, env)
}

/// A `--late-writes` run in which late writes of old terms landed: it
/// failed, the report counts them, and the verdict says `why`.
fn assert_late_writes_landed(code: i32, r: &serde_json::Value, stdout: &str, why: &str) {
    assert_eq!(code, 1, "{stdout}");
    let applied = r["late_writes"]["relay"]["late_stale_applied"].as_u64();
    assert!(applied.unwrap() > 0, "{stdout}");
    assert!(stdout.contains("UNSAFE:"), "{stdout}");
    assert!(stdout.contains(why), "{stdout}");
}

/// `--late-writes` in front of the embedded store (`fencegate backend`,
/// entity tags that change on every write): with the route's preconditions
/// on, every write reaches the storage with one, the storage refuses the
/// late writes of old terms, and the run is SAFE; with them off, the same
/// run finds late stale writes applied and fails (seen failing: the test's
/// second half).
#[test]
fn late_writes_are_refused_by_the_storage_with_preconditions_on() {
    let dir = TempDir::new("loadtest-late");
    let backend = Proc::start(
        &["backend", "--listen", "127.0.0.1:0"],
        &dir.path().join("backend.log"),
        &[],
    );
    let port = support::servers::free_port();
    let relay = format!("http://127.0.0.1:{port}");
    let on = proxy_with_route(&dir, "on", &relay, "/kv/{lease}", "etag", "");
    let (code, r, stdout) = late_loadtest(
        &on.url,
        &backend.url,
        port,
        &[],
        &dir.path().join("on.json"),
        &[],
    );
    let late = &r["late_writes"];
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(late["relay"]["late_stale_applied"], 0, "{stdout}");
    assert!(
        late["relay"]["late_stale_refused"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    assert_eq!(late["relay"]["writes_without_precondition"], 0, "{stdout}");
    assert_eq!(late["storage_evaluates_if_match"], true, "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("SAFE:")), "{stdout}");
    drop(on);

    let off = proxy_with_route(&dir, "off", &relay, "/kv/{lease}", "off", "");
    let (code, r, stdout) = late_loadtest(
        &off.url,
        &backend.url,
        port,
        &[],
        &dir.path().join("off.json"),
        &[],
    );
    assert_late_writes_landed(code, &r, &stdout, "without a precondition");
}

/// In front of Garage, which applies a write whose If-Match is false: the
/// report says the storage ignores preconditions and does not call the run
/// safe, though every write carried one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storage_that_ignores_preconditions_is_named() {
    let dir = TempDir::new("loadtest-late-garage");
    let garage = support::servers::garage().await;
    let port = support::servers::free_port();
    let relay = format!("http://127.0.0.1:{port}");
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/s3.toml");
    let data = dir.path().join("data");
    let proxy = Proc::start(
        &[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &relay,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.path().join("servers.log"),
        &[("FENCEGATE_FENCE__SETTLE_MS", "300")],
    );
    let (key_id, secret) = support::servers::GARAGE_KEY;
    let env = [
        ("AWS_ACCESS_KEY_ID", key_id),
        ("AWS_SECRET_ACCESS_KEY", secret),
    ];
    let layout = [
        "--path",
        "/orders-bucket/{lease}/{key}",
        "--s3-region",
        garage.region,
    ];
    let (code, r, stdout) = tokio::task::spawn_blocking({
        let (url, storage, json) = (
            proxy.url.clone(),
            garage.server.url.clone(),
            dir.path().join("garage.json"),
        );
        move || late_loadtest(&url, &storage, port, &layout, &json, &env)
    })
    .await
    .unwrap();
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(
        r["late_writes"]["storage_evaluates_if_match"], false,
        "{stdout}"
    );
    assert_eq!(r["safe"], false, "{stdout}");
    assert!(stdout.contains("ignores preconditions"), "{stdout}");
    assert!(!stdout.lines().any(|l| l.starts_with("SAFE")), "{stdout}");
}

/// In front of moto's S3 server, which evaluates If-Match on PutObject:
/// the late writes of old terms are refused, and the run is SAFE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_writes_in_front_of_moto_are_refused() {
    let dir = TempDir::new("loadtest-late-moto");
    let moto = support::servers::moto().await;
    let r = support::HttpClient::new(&moto.url)
        .send(support::Req::new("PUT", "/orders-bucket"))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let port = support::servers::free_port();
    let relay = format!("http://127.0.0.1:{port}");
    let proxy = proxy_with_route(
        &dir,
        "moto",
        &relay,
        "/orders-bucket/{lease}",
        "etag",
        "[proxy]\npreserve_host = true\n",
    );
    // moto takes conditional writes only signed; it does not check the
    // signature itself.
    let env = [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
    ];
    let layout = [
        "--path",
        "/orders-bucket/{lease}/{key}",
        "--s3-region",
        "us-east-1",
    ];
    let (code, r, stdout) = tokio::task::spawn_blocking({
        let (url, storage, json) = (
            proxy.url.clone(),
            moto.url.clone(),
            dir.path().join("moto.json"),
        );
        move || late_loadtest(&url, &storage, port, &layout, &json, &env)
    })
    .await
    .unwrap();
    let late = &r["late_writes"];
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(late["storage_evaluates_if_match"], true, "{stdout}");
    assert!(
        late["relay"]["late_stale_refused"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    assert_eq!(late["relay"]["late_stale_applied"], 0, "{stdout}");
}

/// `fencegate serve` with an etcd-v3 route `/lt/{lease}` in front of
/// `upstream`, a settle time of 300 ms, and `mutant` planted.
fn etcd_proxy(dir: &TempDir, name: &str, upstream: &str, mutant: Option<&str>) -> Proc {
    support::proc::serve_config(
        dir,
        name,
        "[fence]\nsettle_ms = 300\n[[fence.routes]]\nkind = \"etcd-v3\"\npattern = \"/lt/{lease}\"\n",
        upstream,
        mutant,
    )
}

/// `--store etcd-v3` in front of etcd's v3 JSON gateway: etcd itself
/// refuses every late write of an old term (the lease's fence key), and
/// the run is SAFE; with the comparison dropped (the etcd-compare-dropped
/// mutant planted in fencegate), late writes of old terms land and the run
/// is UNSAFE (the test's second half).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_writes_in_front_of_etcd_v3_are_refused_by_etcd() {
    let dir = TempDir::new("loadtest-late-etcd");
    let etcd = support::servers::etcd_v3(None).await;
    let port = support::servers::free_port();
    let relay = format!("http://127.0.0.1:{port}");
    let layout = ["--store", "etcd-v3", "--path", "/lt/{lease}/{key}"];
    let run = |proxy: &Proc, name: &str| {
        let (url, storage, json) = (
            proxy.url.clone(),
            etcd.url.clone(),
            dir.path().join(format!("{name}.json")),
        );
        tokio::task::spawn_blocking(move || {
            late_loadtest(&url, &storage, port, &layout, &json, &[])
        })
    };
    let on = etcd_proxy(&dir, "on", &relay, None);
    let (code, r, stdout) = run(&on, "on").await.unwrap();
    let late = &r["late_writes"];
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(late["store"], "etcd-v3", "{stdout}");
    assert_eq!(late["relay"]["late_stale_applied"], 0, "{stdout}");
    assert!(
        late["relay"]["late_stale_refused"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    assert_eq!(late["relay"]["writes_without_precondition"], 0, "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("SAFE:")), "{stdout}");
    drop(on);

    let off = etcd_proxy(&dir, "off", &relay, Some("etcd-compare-dropped"));
    let (code, r, stdout) = run(&off, "off").await.unwrap();
    assert_late_writes_landed(code, &r, &stdout, "without the comparison");
}

/// `--store dynamodb` in front of moto's DynamoDB: every write carries its
/// term's token in the item and the condition on it, DynamoDB refuses
/// every late write of an old term, and the run is SAFE; with the writes
/// sent without the condition and fencegate's check of it switched off
/// (the dynamo-condition-unchecked mutant), late writes of old terms land
/// and the run is UNSAFE (the test's second half).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_writes_in_front_of_dynamodb_are_refused_by_dynamodb() {
    let dir = TempDir::new("loadtest-late-dynamodb");
    let moto = support::servers::moto().await;
    support::dynamodb::create_table(&support::HttpClient::new(&moto.url), "jobs").await;
    let port = support::servers::free_port();
    let relay = format!("http://127.0.0.1:{port}");
    let proxy = |name: &str, mutant: Option<&str>| {
        support::proc::serve_config(
            &dir,
            name,
            "[proxy]\npreserve_host = true\n[fence]\nsettle_ms = 300\n[[fence.routes]]\n\
             kind = \"dynamodb\"\npattern = \"/jobs/{lease}\"\npartition_key = \"pk\"\n",
            &relay,
            mutant,
        )
    };
    // Signed as for AWS: moto reads the region from the signature and
    // checks nothing else of it.
    let env = [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
    ];
    let run = |proxy: &Proc, name: &str, extra: &'static [&'static str]| {
        let (url, storage, json) = (
            proxy.url.clone(),
            moto.url.clone(),
            dir.path().join(format!("{name}.json")),
        );
        tokio::task::spawn_blocking(move || {
            let layout = [
                &[
                    "--store",
                    "dynamodb",
                    "--path",
                    "/jobs/{lease}/{key}",
                    "--aws-region",
                    "us-east-1",
                ][..],
                extra,
            ]
            .concat();
            late_loadtest(&url, &storage, port, &layout, &json, &env)
        })
    };
    let on = proxy("on", None);
    let (code, r, stdout) = run(&on, "on", &[]).await.unwrap();
    let late = &r["late_writes"];
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(late["store"], "dynamodb", "{stdout}");
    assert_eq!(late["relay"]["late_stale_applied"], 0, "{stdout}");
    assert!(
        late["relay"]["late_stale_refused"].as_u64().unwrap() > 0,
        "{stdout}"
    );
    assert_eq!(late["relay"]["writes_without_precondition"], 0, "{stdout}");
    assert_eq!(r["findings"]["reads_failed"], 0, "{stdout}");
    assert!(r["findings"]["keys_read"].as_u64().unwrap() > 0, "{stdout}");
    assert_eq!(r["cleanup"], serde_json::Value::Null, "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("SAFE:")), "{stdout}");
    drop(on);

    let off = proxy("off", Some("dynamo-condition-unchecked"));
    let (code, r, stdout) = run(&off, "off", &["--dynamodb-without-condition"])
        .await
        .unwrap();
    assert_late_writes_landed(code, &r, &stdout, "without the condition");
}

/// `fencegate loadtest` with `args` (and `--json json`), killed if it has
/// not ended within `limit`: (exit code, stdout, stderr). Real time: a run
/// bounded by its own deadlines ends well within it.
fn loadtest_within(
    args: &[&str],
    json: &std::path::Path,
    limit: std::time::Duration,
) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .arg("loadtest")
        .args(args)
        .arg("--json")
        .arg(json)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = fencegate::clock::Stopwatch::start();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (
                status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if started.elapsed_ms() > limit.as_millis() as u64 {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the load test did not end within {limit:?}:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Serves `answer` to every request on a free loopback port, on a thread
/// of its own: its URL.
fn serve_on_a_thread<F, Fut>(answer: F) -> String
where
    F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Send + Sync + Copy + 'static,
    Fut: std::future::Future<Output = http::Response<fencegate::body::Body>> + Send + 'static,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| async move {
                        Ok::<_, std::convert::Infallible>(answer(req).await)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(sock), service)
                        .await;
                });
            }
        });
    });
    url
}

/// A storage that takes every write but trickles its answers to reads (a
/// byte a second, never ending): the load test's read-back gives up on
/// each read at `--request-timeout` and the run ends INCONCLUSIVE, saying
/// what timed out (seen failing: it waited on the first read until killed).
#[test]
fn a_storage_that_trickles_its_reads_makes_the_run_inconclusive() {
    let dir = TempDir::new("loadtest-trickle");
    let storage = serve_on_a_thread(|req| async move {
        if req.method() != http::Method::GET {
            let mut res = http::Response::new(fencegate::body::empty());
            *res.status_mut() = http::StatusCode::NO_CONTENT;
            return res;
        }
        let (tx, body) =
            http_body_util::channel::Channel::<bytes::Bytes, std::convert::Infallible>::new(1);
        tokio::spawn(async move {
            let mut tx = tx;
            loop {
                if tx.send_data(bytes::Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
        http::Response::new(fencegate::body::boxed(body))
    });
    let proxy = proxy_to(&dir, &storage, &[]);
    let (code, stdout, stderr) = loadtest_within(
        &[
            "--target",
            &proxy.url,
            "--writes",
            "40",
            "--writers",
            "4",
            "--request-timeout",
            "2s",
            "--keep",
        ],
        &dir.path().join("trickle.json"),
        std::time::Duration::from_secs(120),
    );
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("INCONCLUSIVE") && stdout.contains("--request-timeout"),
        "{stdout}\n{stderr}"
    );
}

/// A storage that trickles every answer (writes, reads and deletes alike:
/// the head at once, then a byte every 300 ms, never ending), with
/// `--request-timeout 1s`: once the first request got no answer the run
/// can no longer pass, so the writers stop, the read-back and the cleanup
/// each get one more timeout, and the run ends INCONCLUSIVE, counting the
/// keys it did not read.
///
/// Seen failing on the old code: it did not end within 30 s (left to
/// itself against the same kind of storage with the same flags, it ended
/// after 161 s: 17 s of writes, then every key read three times at the full
/// timeout and deleted twice, one key of a lease after the other). Now it
/// ends in about 4 s. The 30 s bound is wide on purpose: the suite runs
/// beside other work on two cores, and the run's own bound (docs/
/// loadtest.md: five more timeouts once a request went unanswered for one)
/// is far inside it.
#[test]
fn a_storage_that_trickles_every_answer_ends_the_run_within_a_few_timeouts() {
    let dir = TempDir::new("loadtest-trickle-all");
    let storage = serve_on_a_thread(|_req| async move {
        let (tx, body) =
            http_body_util::channel::Channel::<bytes::Bytes, std::convert::Infallible>::new(1);
        tokio::spawn(async move {
            let mut tx = tx;
            loop {
                if tx.send_data(bytes::Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
        });
        http::Response::new(fencegate::body::boxed(body))
    });
    let proxy = proxy_to(&dir, &storage, &[]);
    let json = dir.path().join("trickle-all.json");
    let started = fencegate::clock::Stopwatch::start();
    // Two reads at a time: the run has at least four keys (four leases are
    // granted at once, and each holder's first write goes out before any
    // request times out), so some are never read whichever way the race
    // at the read-back's end goes between a read's own timeout (failed)
    // and the read-back's (not read).
    let (code, stdout, stderr) = loadtest_within(
        &[
            "--target",
            &proxy.url,
            "--writes",
            "200",
            "--request-timeout",
            "1s",
            "--read-concurrency",
            "2",
        ],
        &json,
        std::time::Duration::from_secs(30),
    );
    eprintln!("the run took {} ms", started.elapsed_ms());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["safe"], false, "{stdout}");
    assert!(
        stdout.contains("\nINCONCLUSIVE: ") && stdout.contains("--request-timeout"),
        "{stdout}\n{stderr}"
    );
    // Every key the run wrote is counted: none was read, each could not be
    // read or was not; the cleanup tried (or gave up on) every one.
    let f = &r["findings"];
    let count = |v: &serde_json::Value| v.as_u64().unwrap();
    let cleanup = &r["cleanup"];
    let keys = count(&cleanup["deleted"]) + count(&cleanup["failed"]);
    assert_eq!(count(&f["keys_read"]), 0, "{stdout}");
    assert_eq!(
        count(&f["reads_failed"]) + count(&f["keys_not_read"]),
        keys,
        "{stdout}"
    );
    assert!(count(&f["keys_not_read"]) > 0, "{stdout}\n{stderr}");
    assert!(
        stdout.contains(" not read: stopped once a request got no answer)"),
        "{stdout}\n{stderr}"
    );
}

/// A target that answers every request `503 not-primary` (no member
/// serves): the writers stop once no term was granted for
/// `--unreachable-limit`, and the run says why it stopped (seen failing: it
/// retried for ever).
#[test]
fn a_target_that_only_answers_not_primary_stops_the_run() {
    let dir = TempDir::new("loadtest-not-primary");
    let target = serve_on_a_thread(|_req| async move {
        let body = serde_json::json!({
            "type": "urn:fencegate:problem:not-primary",
            "title": "Not primary",
            "status": 503,
            "detail": "no primary",
            "reason": "not-primary",
            "primary": null,
        });
        let mut res = http::Response::new(fencegate::body::full(body.to_string()));
        *res.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        res.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/problem+json"),
        );
        res
    });
    let (code, stdout, stderr) = loadtest_within(
        &[
            "--target",
            &target,
            "--writes",
            "10",
            "--unreachable-limit",
            "3s",
        ],
        &dir.path().join("np.json"),
        std::time::Duration::from_secs(120),
    );
    assert_ne!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("no term granted") && stderr.contains("not-primary"),
        "{stdout}\n{stderr}"
    );
}

/// `--verify history` reads the storage's apply log a page at a time: a
/// log far longer than one answer may hold (20,000 entries of other
/// writers before the run's own) is read whole (seen failing: "length
/// limit exceeded" past about 8,000 entries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_apply_log_is_read_a_page_at_a_time() {
    let dir = TempDir::new("loadtest-long-log");
    let backend = recording_backend(&dir);
    let c = support::HttpClient::new(&backend.url);
    let writes: Vec<_> = (0..16)
        .map(|t| {
            let c = c.clone();
            tokio::spawn(async move {
                for i in 0..1_250 {
                    let r = c
                        .send(
                            support::Req::new("PUT", &format!("/kv/other/{t}-{i}"))
                                .header("x-fencegate-writer", "someone-else")
                                .body("x"),
                        )
                        .await;
                    assert!(r.status.is_success());
                }
            })
        })
        .collect();
    for w in writes {
        w.await.unwrap();
    }
    let proxy = proxy_to(&dir, &backend.url, &[]);
    let (code, r, stdout) = tokio::task::spawn_blocking({
        let (url, history, json) = (
            proxy.url.clone(),
            backend.url.clone(),
            dir.path().join("long.json"),
        );
        move || loadtest_writes(&["--target", &url, "--history", &history], "300", &json)
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(r["verify"], serde_json::json!(["history"]));
    assert_eq!(r["findings"]["unknown_in_log"], 0, "{stdout}");
}
