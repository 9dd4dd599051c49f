//! What clients that stop reading cost fencegate: resident memory while many
//! connections pipeline GETs of a 1 MiB value and never read the answers,
//! and how fast a fresh client's `/_fence/livez` answers meanwhile.
//!
//!     cargo bench --bench slow_readers              # 2,000 slow readers
//!     cargo bench --bench slow_readers -- --quick   # 100 (CI smoke run)
//!     cargo bench --bench slow_readers -- --readers 5000 --pipeline 8
//!
//! Two rows, each a fresh release-build `fencegate serve`: the embedded store
//! holding the value, and `fencegate backend` behind fencegate as its
//! upstream. First as many kept-alive clients that each read one answer
//! and then idle, for what any client connection costs; then the slow
//! readers. Each slow reader opens a connection, sends `--pipeline` GETs of
//! the value at once and never reads; once the proxy's resident size has
//! settled it is read from `/proc`, and 200 fresh clients each ask
//! `/_fence/livez` once, in turn. Targets (issue 25): at 2,000 slow readers
//! at most 256 MiB resident and livez p99 under 50 ms. Last, as many
//! connections each send an unfinished 16 KiB request head and stop: what
//! one costs. Then the kernel's side: what the send queues of as many slow
//! readers hold (summed from `ss -tm` for fencegate's port), with the
//! system's send buffer and with `limits.send_buffer_bytes`, while held and
//! after the send timeout (2 s here) cut them off: reset, not closed, they
//! hold nothing more. No thresholds: the figures are printed.

#![allow(clippy::disallowed_methods)] // a benchmark measures wall time

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const VALUE_BYTES: usize = 1024 * 1024;

struct Options {
    readers: usize,
    pipeline: usize,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut o = Options {
        readers: 2000,
        pipeline: 8,
    };
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).and_then(|v| v.parse().ok());
        match args[i].as_str() {
            "--quick" => o.readers = 100,
            "--readers" => o.readers = value().expect("--readers N"),
            "--pipeline" => o.pipeline = value().expect("--pipeline N"),
            _ => {} // cargo bench passes --bench
        }
        i += 1;
    }
    o
}

/// A child process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `fencegate ARGS…` and returns it with the address it announced.
fn start(args: &[&str], log: &Path) -> (Server, String) {
    start_with(args, log, &[])
}

/// [`start`] with `env` set.
fn start_with(args: &[&str], log: &Path, env: &[(&str, &str)]) -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(args)
        .envs(env.iter().copied())
        .env("FENCEGATE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("fencegate starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap_or_default();
    let addr = addr.trim_start_matches("http://").to_owned();
    assert!(!addr.is_empty(), "fencegate did not start: {line}");
    (Server(child), addr)
}

/// One request on its own connection: status and body.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).unwrap();
    let status = std::str::from_utf8(&answer[9..12])
        .unwrap()
        .parse()
        .unwrap();
    let at = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    (status, answer[at..].to_vec())
}

/// Stores the value at `/kv/big/v` through fencegate at `addr`.
fn store_value(addr: &str) {
    let (status, grant) = http(
        addr,
        "POST",
        "/_fence/leases/big",
        &[("Content-Type", "application/json")],
        br#"{"holder":"bench","ttl_ms":3600000}"#,
    );
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&grant));
    let grant: serde_json::Value = serde_json::from_slice(&grant).unwrap();
    let token = grant["token"].to_string();
    let id = grant["lease_id"].as_str().unwrap().to_owned();
    let (status, body) = http(
        addr,
        "PUT",
        "/kv/big/v",
        &[("Fencing-Token", &token), ("Fencing-Lease-Id", &id)],
        &vec![b'x'; VALUE_BYTES],
    );
    assert!(
        (200..300).contains(&status),
        "{status} {}",
        String::from_utf8_lossy(&body)
    );
}

/// Resident bytes of process `pid`.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// The resident size once it has stopped growing (bounded: 30 s).
fn settled_rss(pid: u32) -> u64 {
    let start = Instant::now();
    let mut last = rss_bytes(pid);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = rss_bytes(pid);
        if now.abs_diff(last) < now / 100 || start.elapsed() > Duration::from_secs(30) {
            return now;
        }
        last = now;
    }
}

/// `n` connections, each with `pipeline` GETs of the value sent and never
/// read.
fn slow_readers(addr: &str, n: usize, pipeline: usize) -> Vec<TcpStream> {
    let get = format!("GET /kv/big/v HTTP/1.1\r\nHost: {addr}\r\n\r\n").repeat(pipeline);
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(get.as_bytes()).unwrap();
            s
        })
        .collect()
}

/// `n` kept-alive connections that each sent one GET of a missing key (so
/// a proxied one has its upstream connection) and read the answer.
fn idle_clients(addr: &str, n: usize) -> Vec<TcpStream> {
    let get = format!("GET /kv/big/missing HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(get.as_bytes()).unwrap();
            let mut answer = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let got = s.read(&mut chunk).unwrap();
                assert!(got > 0, "closed before the answer");
                answer.extend_from_slice(&chunk[..got]);
                let Some(at) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
                    continue;
                };
                let head = String::from_utf8_lossy(&answer[..at]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if answer.len() >= at + 4 + length {
                    break;
                }
            }
            s
        })
        .collect()
}

/// Milliseconds each of `n` fresh clients waits for `/_fence/livez`, sorted.
fn livez_ms(addr: &str, n: usize) -> Vec<f64> {
    let mut out: Vec<f64> = (0..n)
        .map(|_| {
            let start = Instant::now();
            let (status, _) = http(addr, "GET", "/_fence/livez", &[], b"");
            assert_eq!(status, 200);
            start.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Lets this process (and the fencegate it starts) open as many files as
/// the hard limit allows: each slow reader is a socket on both sides.
fn raise_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct given.
    #[allow(unsafe_code)]
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn row(name: &str, fg: &Server, addr: &str, o: &Options) {
    store_value(addr);
    let pid = fg.0.id();
    let kib_each = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1024.0 / o.readers as f64;
    let before = settled_rss(pid);
    let idle = idle_clients(addr, o.readers);
    let with_idle = settled_rss(pid);
    drop(idle);
    let before_slow = settled_rss(pid);
    let held = slow_readers(addr, o.readers, o.pipeline);
    let during = settled_rss(pid);
    let livez = livez_ms(addr, 200);
    println!(
        "{name:<20} {:>8.1} MiB {:>9.1} KiB {:>8.1} MiB {:>9.1} KiB {:>8.2} ms {:>8.2} ms",
        before as f64 / 1048576.0,
        kib_each(before, with_idle),
        during as f64 / 1048576.0,
        kib_each(before_slow, during),
        percentile(&livez, 0.5),
        percentile(&livez, 0.99),
    );
    drop(held);
}

/// Resident bytes per connection of `n` connections that each send an
/// unfinished request head of `head_bytes` and then nothing.
fn unfinished_heads(dir: &Path, n: usize, head_bytes: usize) -> (f64, f64) {
    let data = dir.join("data-heads");
    let (fg, addr) = start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.join("heads.log"),
    );
    let pid = fg.0.id();
    let before = settled_rss(pid);
    let mut head = format!("GET /kv/a/b HTTP/1.1\r\nHost: {addr}\r\n");
    while head.len() + 40 < head_bytes {
        head.push_str("X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let held: Vec<TcpStream> = (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(head.as_bytes()).unwrap();
            s
        })
        .collect();
    let during = settled_rss(pid);
    drop(held);
    (
        during as f64 / 1048576.0,
        during.saturating_sub(before) as f64 / 1024.0 / n as f64,
    )
}

/// Bytes queued to send on the sockets of local port `port` (the `w` of
/// `ss -tm`'s skmem, summed), and how many there are: fencegate's client
/// connections, orphaned ones (closed, still sending) included.
fn send_queued(port: &str) -> (u64, usize) {
    let out = Command::new("ss")
        .args(["-tmnHa", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2) runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut bytes = 0;
    let mut sockets = 0;
    for skmem in text.split("skmem:(").skip(1) {
        let fields = skmem.split(')').next().unwrap_or_default();
        sockets += 1;
        bytes += fields
            .split(',')
            .find_map(|f| f.strip_prefix('w'))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    (bytes, sockets)
}

/// The kernel memory `n` slow readers hold in fencegate's send queues with
/// a send buffer of `sndbuf` (0: the system's), while held and after the
/// send timeout cut them off.
fn kernel_row(dir: &Path, sndbuf: usize, o: &Options) {
    let data = dir.join(format!("data-kernel-{sndbuf}"));
    let sndbuf_text = sndbuf.to_string();
    let (fg, addr) = start_with(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.join(format!("kernel-{sndbuf}.log")),
        &[
            ("FENCEGATE_LIMITS__SEND_TIMEOUT_MS", "2000"),
            ("FENCEGATE_LIMITS__SEND_BUFFER_BYTES", &sndbuf_text),
        ],
    );
    store_value(&addr);
    let port = addr.rsplit(':').next().unwrap_or_default().to_owned();
    let held = slow_readers(&addr, o.readers, o.pipeline);
    // The queues fill in well under a second on loopback.
    std::thread::sleep(Duration::from_millis(1500));
    let (during, sockets) = send_queued(&port);
    // Past the 2 s send timeout: every slow reader was cut off.
    std::thread::sleep(Duration::from_millis(3000));
    let (after, left) = send_queued(&port);
    let shown = if sndbuf == 0 {
        "system's".to_owned()
    } else {
        format!("{} KiB", sndbuf / 1024)
    };
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "{shown:<20} {:>10.1} MiB {:>9.1} KiB {:>12.1} MiB {:>10}",
        mib(during),
        during as f64 / 1024.0 / sockets.max(1) as f64,
        mib(after),
        left
    );
    drop(held);
    drop(fg);
}

fn main() {
    let o = options();
    raise_file_limit();
    let dir: PathBuf = std::env::temp_dir().join(format!("fencegate-slow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    println!(
        "{} slow readers, {} pipelined GETs of a {} KiB value each, never read",
        o.readers,
        o.pipeline,
        VALUE_BYTES / 1024
    );
    println!(
        "{:<20} {:>12} {:>13} {:>12} {:>13} {:>11} {:>11}",
        "backend",
        "RSS at start",
        "idle client",
        "RSS held",
        "slow reader",
        "livez p50",
        "livez p99"
    );
    let data = dir.join("data-embedded");
    let (fg, addr) = start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.join("embedded.log"),
    );
    row("embedded store", &fg, &addr, &o);
    drop(fg);

    let (backend, backend_addr) = start(
        &["backend", "--listen", "127.0.0.1:0"],
        &dir.join("backend.log"),
    );
    let upstream = format!("http://{backend_addr}");
    let data = dir.join("data-upstream");
    let (fg, addr) = start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &dir.join("upstream.log"),
    );
    row("upstream (backend)", &fg, &addr, &o);
    drop(fg);
    drop(backend);
    let n = o.readers;
    let (total, per) = unfinished_heads(&dir, n, 16 * 1024);
    println!(
        "{n} connections with an unfinished 16 KiB request head (max_header_bytes 16384): \
         {total:.1} MiB resident, {per:.1} KiB each"
    );
    println!(
        "kernel send queues of {} slow readers (send_timeout_ms 2000), held and after the cut-off",
        o.readers
    );
    println!(
        "{:<20} {:>14} {:>13} {:>16} {:>10}",
        "send buffer", "queued, held", "per reader", "queued after", "sockets"
    );
    for sndbuf in [0, 256 * 1024] {
        kernel_row(&dir, sndbuf, &o);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
