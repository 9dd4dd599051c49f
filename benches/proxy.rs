//! fencegate against nginx as a plain reverse proxy, side by side with wrk.
//!
//!     cargo bench --bench proxy                  # 3 rounds of 10 s per target
//!     cargo bench --bench proxy -- --quick       # smoke run (CI)
//!     cargo bench --bench proxy -- --rounds 5 --duration 20 --connections 64
//!     cargo bench --bench proxy -- --two-cores   # both proxies on both cores
//!
//! Needs `wrk` and `nginx` (Debian packages of those names); pins with
//! `taskset` when it exists: the backend and the proxy under test share CPU 0,
//! wrk runs on CPU 1. So a proxy's throughput measures the CPU it spends per
//! request: with the core saturated, `1e6/proxied − 1e6/direct` is the proxy's
//! microseconds of CPU per request.
//!
//! Targets, one process each, started once and measured round-robin so that
//! machine noise hits them alike (the medians of the rounds are reported):
//! - `direct`: the minimal hyper key-value backend (this binary, re-run with
//!   `--kv-backend`) with nothing in front;
//! - `nginx`: one worker, a keepalive upstream pool, access log off;
//! - `fencegate fenced`: `PUT /kv/bench/1` with a valid token and lease id;
//! - `fencegate unfenced`: the same write on a path no route guards
//!   (`fence.allow_unrouted_writes`), so the difference to the fenced row is
//!   the fencing decision end to end;
//! - `fencegate renew`: `POST /_fence/leases/…/renew` (no backend involved);
//! - `renew, pipelined x16`: the same, each connection sending 16 renewals
//!   at once (HTTP/1.1 pipelining);
//! - `renew, batches of 100`: `POST /_fence/renew` naming the lease 100
//!   times (its req/s are requests: each renews 100 times);
//! - `fenced, pooled upstream` and `fenced, 2 worker threads`: the fenced
//!   row again on two more fencegates, one with `proxy.upstream_connections =
//!   "pooled"`, one with `runtime.worker_threads = 2` (tokio's multi-thread
//!   scheduler; the default on one CPU is the current-thread one), so the
//!   defaults are chosen by measurement in the same run.
//!
//! With `--two-cores` nothing is pinned: nginx runs `worker_processes 2`,
//! fencegate two threads, once as two current-thread runtimes accepting
//! from one listening socket (`runtime.scheduler = "per-thread"`) and once
//! as tokio's multi-thread scheduler (`"work-stealing"`), wrk two threads,
//! all sharing the machine's cores; the table shows how each proxy scales,
//! as a ratio to nginx in the same run.
//!
//! Every request carries the same 64-byte body and fencing headers; any
//! non-2xx answer fails the run, since its figures would be meaningless.

#![allow(clippy::disallowed_methods)] // a benchmark measures wall time

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

const BODY_BYTES: usize = 64;

struct Options {
    rounds: usize,
    duration_s: u64,
    connections: usize,
    two_cores: bool,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut o = Options {
        rounds: 3,
        duration_s: 10,
        connections: 64,
        two_cores: false,
    };
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).and_then(|v| v.parse().ok());
        match args[i].as_str() {
            "--quick" => {
                o.rounds = 1;
                o.duration_s = 1;
            }
            "--rounds" => o.rounds = value().expect("--rounds N"),
            "--duration" => o.duration_s = value().expect("--duration SECONDS") as u64,
            "--connections" => o.connections = value().expect("--connections N"),
            "--two-cores" => o.two_cores = true,
            _ => {} // cargo passes --bench
        }
        i += 1;
    }
    o
}

// ---------------------------------------------------------------------------
// The minimal key-value backend: what a storage server costs at the least.

fn kv_backend() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap());
        std::io::stdout().flush().unwrap();
        let store: Arc<Mutex<HashMap<String, Bytes>>> = Arc::default();
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let _ = stream.set_nodelay(true);
            let store = store.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let store = store.clone();
                    async move { Ok::<_, Infallible>(kv(store, req).await) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}

async fn kv(
    store: Arc<Mutex<HashMap<String, Bytes>>>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let key = req.uri().path().to_owned();
    let reply = |status: StatusCode, body: Bytes| {
        let mut res = Response::new(Full::new(body));
        *res.status_mut() = status;
        res
    };
    match *req.method() {
        Method::GET => match store.lock().unwrap().get(&key) {
            Some(v) => reply(StatusCode::OK, v.clone()),
            None => reply(StatusCode::NOT_FOUND, Bytes::new()),
        },
        Method::PUT => match req.into_body().collect().await {
            Ok(body) => {
                store.lock().unwrap().insert(key, body.to_bytes());
                reply(StatusCode::NO_CONTENT, Bytes::new())
            }
            Err(_) => reply(StatusCode::BAD_REQUEST, Bytes::new()),
        },
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::new()),
    }
}

// ---------------------------------------------------------------------------
// Processes.

/// A child process killed (by its own pid) when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM first: an nginx master stops its workers on it (killed
        // outright, it would leave them serving).
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the pid of our own child, which is not reaped yet.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM);
        }
        for _ in 0..200 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn need(name: &str) -> PathBuf {
    find(name).unwrap_or_else(|| {
        eprintln!("{name} is not installed: apt-get install {name}");
        std::process::exit(1);
    })
}

/// `program args…`, pinned to `cpu` when taskset exists.
fn pinned(cpu: Option<&str>, program: &Path) -> Command {
    match (cpu, find("taskset")) {
        (Some(cpu), Some(taskset)) => {
            let mut cmd = Command::new(taskset);
            cmd.arg("-c").arg(cpu).arg(program);
            cmd
        }
        _ => Command::new(program),
    }
}

/// Starts `cmd` and returns the last word of its first stdout line.
fn start_announced(mut cmd: Command, what: &str) -> (Server, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap_or_default();
    let addr = addr.trim_start_matches("http://").to_owned();
    assert!(!addr.is_empty(), "{what} did not announce an address");
    (Server(child), addr)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_nginx(
    dir: &Path,
    cpu: Option<&str>,
    backend: &str,
    connections: usize,
    workers: usize,
) -> (Server, String) {
    let port = free_port();
    let d = dir.display();
    // One worker runs without a master; more need the master to fork them.
    let master = if workers > 1 { "on" } else { "off" };
    let conf = dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            r#"daemon off;
master_process {master};
worker_processes {workers};
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream backend {{
        server {backend};
        keepalive {connections};
    }}
    server {{
        listen 127.0.0.1:{port} reuseport;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"#
        ),
    )
    .unwrap();
    let mut cmd = pinned(cpu, &need("nginx"));
    cmd.arg("-p").arg(dir).arg("-c").arg(&conf);
    let server = Server(
        cmd.stdin(Stdio::null())
            .spawn()
            .expect("cannot start nginx"),
    );
    let addr = format!("127.0.0.1:{port}");
    for _ in 0..500 {
        if TcpStream::connect(&addr).is_ok() {
            return (server, addr);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "nginx did not start: {}",
        std::fs::read_to_string(dir.join("nginx-error.log")).unwrap_or_default()
    );
}

/// One HTTP/1.1 exchange on a fresh connection; returns status and body.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_owned())
}

// ---------------------------------------------------------------------------
// wrk.

struct Target {
    name: &'static str,
    url: String,
    script: PathBuf,
}

#[derive(Clone, Copy, Default)]
struct Sample {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
}

/// A copy of `script` whose connections each send `depth` requests at once
/// (HTTP/1.1 pipelining; wrk counts every response).
fn pipelined_script(script: &Path, depth: usize) -> PathBuf {
    let path = script.with_extension(format!("pipelined-{depth}.lua"));
    let base = std::fs::read_to_string(script).unwrap();
    std::fs::write(
        &path,
        format!(
            "{base}init = function(args)\n\
             \x20 local r = {{}}\n\
             \x20 for i = 1, {depth} do r[i] = wrk.format() end\n\
             \x20 req = table.concat(r)\n\
             end\n\
             request = function() return req end\n"
        ),
    )
    .unwrap();
    path
}

fn wrk_script(
    dir: &Path,
    name: &str,
    method: &str,
    body: bool,
    token: &str,
    lease_id: &str,
) -> PathBuf {
    let path = dir.join(format!("{name}.lua"));
    let body = if body {
        format!("wrk.body = string.rep(\"x\", {BODY_BYTES})\n")
    } else {
        String::new()
    };
    std::fs::write(
        &path,
        format!(
            "wrk.method = \"{method}\"\n{body}\
             wrk.headers[\"Fencing-Token\"] = \"{token}\"\n\
             wrk.headers[\"Fencing-Lease-Id\"] = \"{lease_id}\"\n"
        ),
    )
    .unwrap();
    path
}

fn to_us(v: &str) -> f64 {
    let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    let (n, unit) = v.split_at(split);
    let n: f64 = n.parse().unwrap_or(f64::NAN);
    match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        _ => f64::NAN,
    }
}

fn run_wrk(target: &Target, o: &Options) -> Sample {
    let (cpu, threads) = if o.two_cores {
        (None, "-t2")
    } else {
        (Some("1"), "-t1")
    };
    let mut cmd = pinned(cpu, &need("wrk"));
    cmd.args([threads, &format!("-c{}", o.connections)])
        .arg(format!("-d{}s", o.duration_s))
        .arg("--latency")
        .arg("-s")
        .arg(&target.script)
        .arg(&target.url);
    let out = cmd.output().expect("cannot run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk failed on {}:\n{text}",
        target.name
    );
    if let Some(line) = text
        .lines()
        .find(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
    {
        panic!("{}: {line}\n{text}", target.name);
    }
    let mut s = Sample::default();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", v] => s.rps = v.parse().unwrap_or(f64::NAN),
            ["50%", v] => s.p50_us = to_us(v),
            ["99%", v] => s.p99_us = to_us(v),
            _ => {}
        }
    }
    assert!(
        s.rps > 0.0,
        "no throughput parsed for {}:\n{text}",
        target.name
    );
    s
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Starts a fencegate in front of `backend` with `env` on top of the
/// defaults, acquires the lease `bench`, and writes the wrk scripts of a
/// fenced PUT and a renew under it.
fn start_fencegate(
    dir: &Path,
    pin: Option<&str>,
    backend: &str,
    name: &str,
    env: &[(&str, &str)],
) -> (Server, String, PathBuf, PathBuf) {
    let mut fg = pinned(pin, Path::new(env!("CARGO_BIN_EXE_fencegate")));
    fg.args(["serve", "--listen", "127.0.0.1:0", "--upstream"])
        .arg(format!("http://{backend}"))
        .arg("--data-dir")
        .arg(dir.join(format!("data-{name}")))
        .env("FENCEGATE_LOG", "warn")
        .env("FENCEGATE_FENCE__ALLOW_UNROUTED_WRITES", "true")
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(dir.join(format!("fencegate-{name}.log"))).unwrap());
    let (server, addr) = start_announced(fg, "fencegate");
    let (status, grant) = http(
        &addr,
        "POST",
        "/_fence/leases/bench",
        &[],
        r#"{"holder":"bench","ttl_ms":3600000}"#,
    );
    assert_eq!(status, 201, "{grant}");
    let grant: serde_json::Value = serde_json::from_str(&grant).unwrap();
    let token = grant["token"].to_string();
    let lease_id = grant["lease_id"].as_str().unwrap().to_owned();
    let put = wrk_script(dir, &format!("put-{name}"), "PUT", true, &token, &lease_id);
    let renew = wrk_script(
        dir,
        &format!("renew-{name}"),
        "POST",
        false,
        &token,
        &lease_id,
    );
    // POST /_fence/renew naming the lease BATCH times.
    let item = format!(r#"{{"lease":"bench","token":{token},"lease_id":"{lease_id}"}}"#);
    let items = vec![item; BATCH].join(",");
    std::fs::write(
        batch_script(dir, name),
        format!(
            "wrk.method = \"POST\"\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\n\
             wrk.body = '{{\"leases\":[{items}]}}'\n"
        ),
    )
    .unwrap();
    (server, addr, put, renew)
}

/// Leases one request of the batch-renewal target renews.
const BATCH: usize = 100;

/// The wrk script of `start_fencegate`'s batch renewal for `name`.
fn batch_script(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("batch-{name}.lua"))
}

fn main() {
    if std::env::args().any(|a| a == "--kv-backend") {
        kv_backend();
        return;
    }
    let o = options();
    let dir = std::env::temp_dir().join(format!("fencegate-bench-proxy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pin = find("taskset").filter(|_| !o.two_cores).map(|_| "0");
    need("wrk");

    let mut backend_cmd = pinned(pin, &std::env::current_exe().unwrap());
    backend_cmd.arg("--kv-backend");
    let (_backend, backend) = start_announced(backend_cmd, "the backend");

    if o.two_cores {
        two_cores(&dir, &backend, &o);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let (_nginx, nginx) = start_nginx(&dir, pin, &backend, o.connections, 1);

    // The configuration under test, and two variants measured beside it.
    let variants: [(&str, &[(&str, &str)]); 3] = [
        ("default", &[]),
        (
            "pooled",
            &[("FENCEGATE_PROXY__UPSTREAM_CONNECTIONS", "pooled")],
        ),
        (
            "multi-thread",
            &[
                ("FENCEGATE_RUNTIME__WORKER_THREADS", "2"),
                ("FENCEGATE_RUNTIME__SCHEDULER", "work-stealing"),
            ],
        ),
    ];
    let mut servers = Vec::new();
    let mut instances = Vec::new();
    for (name, env) in variants {
        let (server, addr, put, renew) = start_fencegate(&dir, pin, &backend, name, env);
        servers.push(server);
        instances.push((addr, put, renew));
    }
    let (fencegate, put, renew) = &instances[0];
    let pipelined = pipelined_script(renew, 16);
    let target = |name, addr: &str, path: &str, script: &PathBuf| Target {
        name,
        url: format!("http://{addr}{path}"),
        script: script.clone(),
    };
    let targets = [
        target("direct backend", &backend, "/kv/bench/1", put),
        target("nginx -> backend", &nginx, "/kv/bench/1", put),
        target("fencegate fenced", fencegate, "/kv/bench/1", put),
        target("fencegate unfenced", fencegate, "/raw/bench/1", put),
        target(
            "fencegate renew",
            fencegate,
            "/_fence/leases/bench/renew",
            renew,
        ),
        target(
            "renew, pipelined x16",
            fencegate,
            "/_fence/leases/bench/renew",
            &pipelined,
        ),
        target(
            "renew, batches of 100",
            fencegate,
            "/_fence/renew",
            &batch_script(&dir, "default"),
        ),
        target(
            "fenced, pooled upstream",
            &instances[1].0,
            "/kv/bench/1",
            &instances[1].1,
        ),
        target(
            "fenced, 2 worker threads",
            &instances[2].0,
            "/kv/bench/1",
            &instances[2].1,
        ),
    ];

    println!(
        "wrk -t1 -c{} -d{}s, {BODY_BYTES} B PUT bodies, {} round(s), medians; {}",
        o.connections,
        o.duration_s,
        o.rounds,
        if pin.is_some() {
            "servers on CPU 0, wrk on CPU 1"
        } else {
            "unpinned (no taskset)"
        }
    );
    let med = measure(&targets, &o);
    let (direct, nginx) = (med[0], med[1]);
    println!(
        "\n| target | req/s | p50 µs | p99 µs | × direct | × nginx | proxy CPU µs/req |\n\
         |---|---:|---:|---:|---:|---:|---:|"
    );
    for (t, s) in targets.iter().zip(&med) {
        let cpu = if t.name.contains("renew") || t.name.starts_with("direct") {
            "".to_owned()
        } else {
            format!("{:.1}", 1e6 / s.rps - 1e6 / direct.rps)
        };
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {cpu} |",
            t.name,
            s.rps,
            s.p50_us,
            s.p99_us,
            s.rps / direct.rps,
            s.rps / nginx.rps,
        );
    }
    println!(
        "\nfencing decision end to end: {:.2} µs of CPU per write (fenced − unfenced)",
        1e6 / med[2].rps - 1e6 / med[3].rps
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs every target once per round, round-robin so that the machine's
/// drift hits them alike; the medians of the rounds.
fn measure(targets: &[Target], o: &Options) -> Vec<Sample> {
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); targets.len()];
    for round in 0..o.rounds {
        for (i, t) in targets.iter().enumerate() {
            let s = run_wrk(t, o);
            eprintln!(
                "round {}: {:<22} {:>9.0} req/s  p50 {:>7.0} us  p99 {:>7.0} us",
                round + 1,
                t.name,
                s.rps,
                s.p50_us,
                s.p99_us
            );
            samples[i].push(s);
        }
    }
    samples
        .iter()
        .map(|v| Sample {
            rps: median(v.iter().map(|s| s.rps).collect()),
            p50_us: median(v.iter().map(|s| s.p50_us).collect()),
            p99_us: median(v.iter().map(|s| s.p99_us).collect()),
        })
        .collect()
}

/// nginx with two workers beside fencegate with two worker threads, nothing
/// pinned.
fn two_cores(dir: &Path, backend: &str, o: &Options) {
    let (_nginx, nginx) = start_nginx(dir, None, backend, o.connections, 2);
    let (_per_thread, per_thread, put, _) = start_fencegate(
        dir,
        None,
        backend,
        "two-cores",
        &[
            ("FENCEGATE_RUNTIME__WORKER_THREADS", "2"),
            ("FENCEGATE_RUNTIME__SCHEDULER", "per-thread"),
        ],
    );
    let (_stealing, stealing, put_stealing, _) = start_fencegate(
        dir,
        None,
        backend,
        "two-cores-stealing",
        &[
            ("FENCEGATE_RUNTIME__WORKER_THREADS", "2"),
            ("FENCEGATE_RUNTIME__SCHEDULER", "work-stealing"),
        ],
    );
    let target = |name, addr: &str, script: &PathBuf| Target {
        name,
        url: format!("http://{addr}/kv/bench/1"),
        script: script.clone(),
    };
    let targets = [
        target("nginx, 2 workers", &nginx, &put),
        target("fencegate, 2 per-thread runtimes", &per_thread, &put),
        target(
            "fencegate, 2 threads work-stealing",
            &stealing,
            &put_stealing,
        ),
    ];
    println!(
        "wrk -t2 -c{} -d{}s, {BODY_BYTES} B PUT bodies, {} round(s), medians; nothing pinned",
        o.connections, o.duration_s, o.rounds
    );
    let med = measure(&targets, o);
    println!("\n| target | req/s | p50 µs | p99 µs | × nginx |\n|---|---:|---:|---:|---:|");
    for (t, s) in targets.iter().zip(&med) {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.2} |",
            t.name,
            s.rps,
            s.p50_us,
            s.p99_us,
            s.rps / med[0].rps
        );
    }
}
