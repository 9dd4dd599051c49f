//! What a person sees, checked in a real browser (headless Chromium from
//! Debian): the status page of a fencegate under a running load test, and
//! the load test's HTML reports through the proxy and straight to the
//! storage. With `FENCEGATE_SCREENSHOTS=DIR` set, the tests also save the
//! screenshots the docs show.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;
use support::browser::Browser;
use support::proc::{proxy_to, recording_backend, Proc, TempDir};
use support::{HttpClient, Req};

/// A recording backend and fencegate in front of it, with its data dir.
fn servers(dir: &TempDir) -> (Proc, Proc, PathBuf) {
    let backend = recording_backend(dir);
    let proxy = proxy_to(dir, &backend.url, &[]);
    (backend, proxy, dir.path().join("data"))
}

/// Every lease id the journal under `data` holds: each grant's record
/// carries its id as 32 lowercase hex digits, right after the holder's name
/// (which may end in hex digits too), so every 32-digit window of a longer
/// run counts: a window that is no id only makes the check stricter. The
/// journal compacts only past 16 MiB, far beyond these runs, so it still
/// holds the id of every grant made.
fn journaled_ids(data: &Path) -> Vec<String> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(data).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap_or_default();
        let hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
        for run in bytes.split(|b| !hex(b)) {
            for window in run.windows(32) {
                ids.push(String::from_utf8(window.to_vec()).unwrap());
            }
        }
    }
    ids.sort();
    ids.dedup();
    ids
}

fn assert_no_id(ids: &[String], what: &str, text: &str) {
    for id in ids {
        assert!(!text.contains(id.as_str()), "{what} shows lease id {id}");
    }
}

/// A child process killed (by its pid) and reaped when dropped.
struct Stopped(std::process::Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn screenshot(browser: &mut Browser, name: &str) {
    if let Some(dir) = std::env::var_os("FENCEGATE_SCREENSHOTS") {
        browser.screenshot(&Path::new(&dir).join(name));
    }
}

/// The number of elements matching a CSS selector.
fn count(browser: &mut Browser, selector: &str) -> u64 {
    browser
        .eval(&format!("document.querySelectorAll({selector:?}).length"))
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_a_running_loadtests_leases_live() {
    let dir = TempDir::new("browser-ui");
    let (backend, proxy, data) = servers(&dir);
    let http = HttpClient::new(&proxy.url);
    // A lease of our own with a long term, to watch its countdown.
    let watched = http
        .send(
            Req::new("POST", "/_fence/leases/ui-watch")
                .json(json!({"holder": "watcher", "ttl_ms": 600_000})),
        )
        .await;
    assert_eq!(watched.status, 201);
    let watched_id = watched.json()["lease_id"].as_str().unwrap().to_owned();

    // A load test runs through the proxy while the page is open (stopped
    // when the test ends, however it ends); TTL 2 s so that terms last long
    // enough to be seen, and hand over often.
    let _loadtest = Stopped(
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(["loadtest", "--target", &proxy.url])
            .args(["--history", &backend.url])
            .args(["--writers", "6", "--leases", "4", "--duration", "600s"])
            .args(["--ttl", "2s", "--pause-prob", "0.05", "--min-stale", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let url = format!("{}/_fence/ui", proxy.url);
    let page = tokio::task::spawn_blocking(move || {
        let mut b = Browser::open(&url, 1280, 720);
        // Real time from here: the page polls once a second and counts down
        // on the browser's clock. Waits are generous (30 s) for a loaded
        // machine; nothing here measures speed.
        let within = Duration::from_secs(30);
        // The load test's leases appear, with their holders.
        b.wait_for(
            "['lt-0','lt-1','lt-2','lt-3'].every(n => document.querySelector(`tr[data-lease='${n}']`))",
            within,
        );
        let holder = b.eval("document.querySelector(\"tr[data-lease='lt-0'] .holder\").textContent");
        assert!(holder.as_str().unwrap().contains("-w"), "{holder}");
        // Their terms change hands on the page, which refreshes by itself.
        let tokens = "JSON.stringify([...document.querySelectorAll(\"tr[data-lease^='lt-'] .token\")].map(t => t.textContent))";
        let before = b.eval(tokens);
        b.wait_for(&format!("{tokens} !== {before}"), within);
        // Writes forwarded and rejected are counted; the proxy is ready.
        b.wait_for(
            "+document.getElementById('m-forwarded').textContent.replace(/\\D/g, '') > 0",
            within,
        );
        assert_eq!(b.eval("document.getElementById('ready').textContent"), "ready");
        // The countdown of the watched lease moves: 1.5 s apart, its time
        // left drops by at least 0.5 s (the margin covers a refresh landing
        // in between and timer slack; it can only drop by more).
        let left = "+document.querySelector(\"tr[data-lease='ui-watch']\").dataset.leftMs";
        b.wait_for(left, within);
        let first = b.eval(left).as_f64().unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        let second = b.eval(left).as_f64().unwrap();
        assert!(
            first <= 600_000.0 && first - second >= 500.0,
            "time left went from {first} to {second} ms"
        );
        // A prefix search narrows the table to matching names.
        b.eval("(() => { const p = document.getElementById('prefix'); p.value = 'ui-'; p.dispatchEvent(new Event('input')); })()");
        b.wait_for(
            "document.querySelectorAll('#leases tr').length === 1 && !!document.querySelector(\"tr[data-lease='ui-watch']\")",
            within,
        );
        b.eval("(() => { const p = document.getElementById('prefix'); p.value = ''; p.dispatchEvent(new Event('input')); })()");
        b.wait_for("document.querySelectorAll('#leases tr').length === 5", within);
        screenshot(&mut b, "status-page.png");
        let page = b.eval("document.documentElement.outerHTML");
        page.as_str().unwrap().to_owned()
    })
    .await
    .unwrap();
    let listing = http
        .send(Req::new("GET", "/_fence/leases?limit=10000"))
        .await;
    let source = http.send(Req::new("GET", "/_fence/ui")).await;
    let mut ids = journaled_ids(&data);
    assert!(ids.contains(&watched_id), "the journal scan finds ids");
    assert!(ids.len() > 5, "only {} ids in the journal", ids.len());
    ids.push(watched_id);
    assert_no_id(&ids, "the status page", &page);
    assert_no_id(&ids, "the listing", &listing.text());
    assert_no_id(&ids, "the page's source", &source.text());
    drop((backend, proxy));
}

/// Runs `fencegate loadtest` to completion with `args` and an HTML and a
/// JSON report; returns its exit status and the JSON report.
fn loadtest(args: &[&str], html: &Path, json: &Path) -> (i32, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .arg("loadtest")
        .args(args)
        .args(["--writers", "8", "--leases", "4", "--writes", "600"])
        .args(["--ttl", "300ms", "--pause-prob", "0.15", "--seed", "3"])
        .arg("--html")
        .arg(html)
        .arg("--json")
        .arg(json)
        .output()
        .unwrap();
    let report = std::fs::read_to_string(json).unwrap_or_else(|_| {
        panic!(
            "no report: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_str(&report).unwrap(),
    )
}

#[test]
fn the_reports_show_where_stale_writes_landed_and_only_without_the_proxy() {
    let dir = TempDir::new("browser-report");
    let (backend, proxy, data) = servers(&dir);
    let fenced = dir.path().join("fenced.html");
    let direct = dir.path().join("direct.html");
    let (code, fenced_json) = loadtest(
        &["--target", &proxy.url, "--history", &backend.url],
        &fenced,
        &dir.path().join("fenced.json"),
    );
    assert_eq!(code, 0, "{fenced_json}");
    let (code, direct_json) = loadtest(
        &["--target", &proxy.url, "--direct", &backend.url],
        &direct,
        &dir.path().join("direct.json"),
    );
    assert_eq!(code, 1, "{direct_json}");
    let landed = direct_json["findings"]["stale_writes_applied"]
        .as_u64()
        .unwrap();
    assert!(landed > 0, "{direct_json}");

    for (file, safe) in [(&fenced, true), (&direct, false)] {
        let html = std::fs::read_to_string(file).unwrap();
        // Self-contained: nothing to fetch, no script at all.
        for outside in ["<script", "<link", "src=", "url("] {
            assert!(!html.contains(outside), "{} has {outside}", file.display());
        }
        let mut b = Browser::open(&format!("file://{}", file.display()), 1280, 1000);
        let verdict = b.eval("document.getElementById('verdict').textContent");
        let verdict = verdict.as_str().unwrap();
        assert!(
            verdict.starts_with(if safe { "SAFE" } else { "UNSAFE" }),
            "{verdict}"
        );
        // One lane per lease, with terms and writes in it.
        assert_eq!(count(&mut b, ".lane"), 4);
        assert!(count(&mut b, ".lane .term") >= 4);
        assert!(count(&mut b, ".lane circle") > 100);
        assert!(count(&mut b, "#latency polyline.p99") == 1);
        let red = count(&mut b, ".stale-landed");
        if safe {
            // Stale attempts were made, and rejected at the boundary.
            assert_eq!(red, 0);
            assert!(count(&mut b, "circle.w-stale.w-rejected") > 0);
            screenshot(&mut b, "report-fenced.png");
        } else {
            // Every stale write that landed is drawn in red.
            assert_eq!(red, landed);
            screenshot(&mut b, "report-direct.png");
        }
        let summary = b.eval("document.getElementById('summary').textContent");
        assert!(summary.as_str().unwrap().contains("stale writes applied"));
    }
    let ids = journaled_ids(&data);
    assert!(ids.len() > 10, "only {} ids in the journal", ids.len());
    for file in [&fenced, &direct] {
        assert_no_id(&ids, "the report", &std::fs::read_to_string(file).unwrap());
    }
    drop((backend, proxy));
}
