//! Power cuts and failed syncs under the real binary, on a file system that
//! loses what was not synced (`tests/support/lazyfs.rs`): the data
//! directory lives on it, fencegate is killed, and the disk keeps only what
//! was made durable (or any part of the writes since).

mod support;

use std::io::Write;

use serde_json::json;
use support::lazyfs::LazyFs;
use support::proc::{serve_args, Proc};
use support::{held_from, Held, HttpClient, Req};

/// The harness itself: what was not synced is lost, what was synced stays,
/// and a new file's name lasts only once its directory was synced.
#[test]
fn the_file_system_keeps_what_was_synced_and_nothing_else() {
    let mut fs = LazyFs::mount("lazyfs-self");
    let dir = fs.path().join("d");
    std::fs::create_dir(&dir).unwrap();
    std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
    let mut synced = std::fs::File::create(dir.join("synced")).unwrap();
    synced.write_all(b"kept").unwrap();
    synced.sync_all().unwrap();
    let mut unsynced = std::fs::File::create(dir.join("unsynced")).unwrap();
    unsynced.write_all(b"lost").unwrap();
    std::fs::File::open(&dir).unwrap().sync_all().unwrap();
    synced.write_all(b" and more").unwrap();
    let unnamed = dir.join("unnamed");
    std::fs::write(&unnamed, b"x").unwrap();
    std::fs::File::open(&unnamed).unwrap().sync_all().unwrap();
    assert_eq!(std::fs::read(dir.join("synced")).unwrap(), b"kept and more");
    drop((synced, unsynced));
    fs.power_cut(|_| false);
    assert_eq!(std::fs::read(dir.join("synced")).unwrap(), b"kept");
    assert_eq!(std::fs::read(dir.join("unsynced")).unwrap(), b"");
    assert!(
        !unnamed.exists(),
        "its directory was not synced after it was made"
    );

    // A cut may keep any part of what was written since the last sync.
    let mut f = std::fs::File::create(dir.join("parts")).unwrap();
    f.sync_all().unwrap();
    std::fs::File::open(&dir).unwrap().sync_all().unwrap();
    f.write_all(b"ab").unwrap();
    f.write_all(b"cd").unwrap();
    drop(f);
    assert_eq!(fs.pending_writes(), 2);
    fs.power_cut(|i| i == 1);
    assert_eq!(std::fs::read(dir.join("parts")).unwrap(), b"\0\0cd");

    // A failed sync makes nothing durable.
    let mut f = std::fs::File::create(dir.join("eio")).unwrap();
    std::fs::File::open(&dir).unwrap().sync_all().unwrap();
    f.write_all(b"data").unwrap();
    fs.fail_syncs(1);
    assert!(f.sync_data().is_err());
    drop(f);
    fs.power_cut(|_| true);
    assert_eq!(std::fs::read(dir.join("eio")).unwrap(), b"");
}

fn acquire(lease: &str, holder: &str, ttl_ms: u64) -> Req {
    Req::new("POST", &format!("/_fence/leases/{lease}"))
        .json(json!({"holder": holder, "ttl_ms": ttl_ms}))
}

/// `fencegate serve` on the manual clock with its data directory at `data`.
fn serve(data: &std::path::Path, log: &std::path::Path) -> Proc {
    Proc::start(&serve_args(data, true), log, &[])
}

/// Leases `l0`…`l{n-1}` acquired for ten minutes: their tokens.
async fn hold(c: &HttpClient, n: usize) -> Vec<u64> {
    let mut tokens = Vec::new();
    for i in 0..n {
        let r = c.send(acquire(&format!("l{i}"), "A", 600_000)).await;
        assert_eq!(r.status, 201, "{}", r.text());
        tokens.push(held_from(&r).token);
    }
    tokens
}

/// After a restart the leases are still held by the terms granted before,
/// and the start found nothing lost.
async fn still_held(c: &HttpClient, tokens: &[u64], log: &str, what: &str) {
    assert!(
        !log.contains("lost acknowledged records"),
        "{what}: the start took records for lost:\n{log}"
    );
    for (i, token) in tokens.iter().enumerate() {
        let v = c
            .send(Req::new("GET", &format!("/_fence/leases/l{i}")))
            .await
            .json();
        assert_eq!(
            (v["state"].as_str(), v["token"].as_u64()),
            (Some("held"), Some(*token)),
            "{what}: l{i}: {v}"
        );
    }
}

/// Real time, bounded: the journal's writer thread reaching its sync.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("{what} did not happen in 10 s");
}

/// A power cut while a batch is being synced: the disk may keep any part
/// of what was written for it. The batch was never acknowledged, so the
/// next start cuts it off and every live lease stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_during_a_sync_loses_no_live_lease() {
    let mut fs = LazyFs::mount("power-cut-sync");
    let cuts = power_cuts_during_syncs(&mut fs, None).await;
    assert_eq!(cuts.lost, None, "after {} power cuts", cuts.survived);
    assert_eq!(cuts.survived, 8);
}

/// The test above, with the bug it guards against planted back: the
/// header (the log's durable length) written before the sync of the batch
/// it claims, so both reach the disk in one sync. Seen failing before the
/// header was written after the sync, and caught here at every run: with
/// the header's write kept and the batch's lost, the start says "journal
/// lost acknowledged records" and ends every live term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_power_cut_test_catches_the_header_written_with_its_batch() {
    let mut fs = LazyFs::mount("power-cut-mutant");
    let cuts = power_cuts_during_syncs(&mut fs, Some("header-before-sync")).await;
    let lost = cuts.lost.expect("the planted bug was not caught");
    assert!(lost.contains("lost acknowledged records"), "{lost}");
}

/// What [`power_cuts_during_syncs`] saw.
struct Cuts {
    /// Power cuts after which every live lease was still held.
    survived: u32,
    /// The first start that lost live leases: its log.
    lost: Option<String>,
}

/// Eight power cuts, each in the middle of a sync: three leases held, a
/// fourth grant's batch being synced when the process dies, and each of
/// the writes since the last sync kept or lost by the bits of the cut's
/// number. After each, the next start must hold the three leases.
async fn power_cuts_during_syncs(fs: &mut LazyFs, mutant: Option<&str>) -> Cuts {
    let env: Vec<(&str, &str)> = mutant
        .map(|m| ("FENCEGATE_TEST_MUTANT", m))
        .into_iter()
        .collect();
    let mut survived = 0;
    for keep in 0..8u32 {
        let data = fs.path().join(format!("data-{keep}"));
        let log = fs.path().join(format!("../fencegate-{keep}.log"));
        let p = Proc::start(&serve_args(&data, true), &log, &env);
        let c = HttpClient::new(&p.url);
        let tokens = hold(&c, 3).await;
        fs.freeze_syncs();
        let late = tokio::spawn({
            let c = c.clone();
            async move { c.try_send(acquire("late", "B", 600_000)).await }
        });
        until("the journal's sync", || fs.blocked_syncs() > 0).await;
        let pending = fs.pending_writes();
        // The process dies in the middle of its sync.
        p.signal("-KILL");
        fs.thaw_syncs();
        p.kill9();
        let _ = late.await;
        fs.power_cut(|i| keep >> i & 1 == 1);
        let p = Proc::start(&serve_args(&data, true), &log, &env);
        let c = HttpClient::new(&p.url);
        let held = held_by(&c, &tokens).await;
        let text = p.log_text();
        p.kill9();
        if held && !text.contains("lost acknowledged records") {
            survived += 1;
        } else {
            let what = format!("{pending} writes pending, kept by the bits of {keep:03b}");
            return Cuts {
                survived,
                lost: Some(format!("{what}:\n{text}")),
            };
        }
    }
    Cuts {
        survived,
        lost: None,
    }
}

/// Whether leases `l0`… are still held by the terms of `tokens`.
async fn held_by(c: &HttpClient, tokens: &[u64]) -> bool {
    for (i, token) in tokens.iter().enumerate() {
        let v = c
            .send(Req::new("GET", &format!("/_fence/leases/l{i}")))
            .await
            .json();
        if (v["state"].as_str(), v["token"].as_u64()) != (Some("held"), Some(*token)) {
            return false;
        }
    }
    true
}

/// One failed sync, then a kill: the start must not take the failed batch
/// for acknowledged records lost. Seen failing before: the header was
/// written before the sync that failed and claimed the batch the writer
/// then cut back, so every live term was ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sync_and_a_kill_lose_no_live_lease() {
    let fs = LazyFs::mount("power-cut-eio");
    let data = fs.path().join("data");
    let log = fs.path().join("../fencegate.log");
    let p = serve(&data, &log);
    let c = HttpClient::new(&p.url);
    let tokens = hold(&c, 3).await;
    fs.fail_syncs(1);
    let r = c.send(acquire("late", "B", 600_000)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (503, "lease-store-unavailable")
    );
    // Before the journal's probe (a second later) writes again.
    p.kill9();
    let p = serve(&data, &log);
    let c = HttpClient::new(&p.url);
    still_held(&c, &tokens, &p.log_text(), "after EIO and kill -9").await;
    let r = c.send(acquire("late", "B", 600_000)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    p.kill9();
}

/// A power cut right after the first start on a new data directory: the
/// directory itself must have been made durable, or the next start would
/// begin a new store and issue token 1 again. Seen failing before the
/// parent directories were synced: the second grant got token 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_data_directory_survives_a_power_cut() {
    let mut fs = LazyFs::mount("power-cut-new-dir");
    let data = fs.path().join("new/data");
    let log = fs.path().join("../fencegate.log");
    let p = serve(&data, &log);
    let c = HttpClient::new(&p.url);
    let first = held_from(&c.send(acquire("x", "A", 1000)).await);
    assert_eq!(first.token, 1);
    p.kill9();
    fs.power_cut(|_| false);
    let p = serve(&data, &log);
    let c = HttpClient::new(&p.url);
    // The recovered term is held for a full TTL after the restart.
    c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 1000})))
        .await;
    let second = held_from(&c.send(acquire("x", "B", 1000)).await);
    assert!(second.token > 1, "token {} issued again", second.token);
    p.kill9();
}

/// A release answered 204 stays a release after a power cut: the released
/// term is not held again, its holder cannot renew or write, and the next
/// holder gets the lease at once. Seen failing before releases were made
/// durable before their answer: B got 409 and A renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_survives_a_power_cut() {
    let mut fs = LazyFs::mount("power-cut-release");
    let data = fs.path().join("data");
    let log = fs.path().join("../fencegate.log");
    let p = serve(&data, &log);
    let c = HttpClient::new(&p.url);
    let a = held_from(&c.send(acquire("orders", "A", 600_000)).await);
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&a))
        .await;
    assert_eq!(r.status, 204);
    p.kill9();
    fs.power_cut(|_| false);
    let p = serve(&data, &log);
    let c = HttpClient::new(&p.url);
    let r = c
        .send(Req::new("POST", "/_fence/leases/orders/renew").held(&a))
        .await;
    assert_eq!(r.status, 412, "the released term renewed: {}", r.text());
    let r = c
        .send(Req::new("PUT", "/kv/orders/1").held(&a).body("zombie"))
        .await;
    assert_eq!(r.status, 412, "the released term wrote: {}", r.text());
    let b = c.send(acquire("orders", "B", 600_000)).await;
    assert_eq!(b.status, 201, "{}", b.text());
    assert!(held_from(&b).token > a.token);
    p.kill9();
}

/// What the load saw of one lease in one round (between two cuts).
#[derive(Clone, Debug, Default)]
struct Seen {
    /// Every token of the lease before the round is at most this.
    floor: u64,
    /// The newest term granted in the round.
    granted: Option<Held>,
    /// Whether that term's release was answered.
    released: bool,
    /// Acquires and releases under way: at the cut, their outcome is
    /// unknown.
    open: u32,
    /// A token granted at or below the floor (issued again).
    reissued: Option<u64>,
}

/// Acquires and releases on `leases` leases until the process dies,
/// recording every answer.
async fn load(
    c: HttpClient,
    worker: usize,
    leases: usize,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
) {
    let mut rng = support::SplitMix::new(worker as u64 + 1);
    loop {
        let lease = rng.range(0..leases as u64) as usize;
        let release = {
            let mut s = seen.lock().unwrap();
            s[lease].open += 1;
            s[lease].granted.clone().filter(|_| !s[lease].released)
        };
        let req = match &release {
            Some(held) => Req::new("DELETE", &format!("/_fence/leases/p{lease}")).held(held),
            None => acquire(&format!("p{lease}"), "W", 600_000),
        };
        let Ok(r) = c.try_send(req).await else {
            return; // the process died: the outcome stays open
        };
        let mut s = seen.lock().unwrap();
        let s = &mut s[lease];
        s.open -= 1;
        match (r.status.as_u16(), &release) {
            (201, None) => {
                let held = held_from(&r);
                if held.token <= s.floor {
                    s.reissued = Some(held.token);
                }
                // Answers may cross: only a newer term replaces the one seen.
                if s.granted.as_ref().is_none_or(|g| g.token < held.token) {
                    s.granted = Some(held);
                    s.released = false;
                }
            }
            (204, Some(held)) if s.granted.as_ref().map(|g| g.token) == Some(held.token) => {
                s.released = true;
            }
            // Held by another worker's term, or released meanwhile.
            _ => {}
        }
    }
}

/// Many power cuts under load: four clients acquire and release sixteen
/// leases as fast as the journal syncs; the process is killed in the middle
/// of a sync, after a time the round picks, and the disk keeps a
/// pseudo-random part of the writes since the last sync. After each cut the start must find nothing
/// acknowledged lost: every granted term is there (held, unless its
/// release was answered), no released term is back, and no token is
/// granted again. Then the manual clock ends every term and the next round
/// starts. (Real time: the journal's writer thread and a real process; 20
/// cuts, bounded.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_power_cuts_under_load_lose_nothing_acknowledged() {
    let grants = power_cuts_under_load("power-cut-load", None).await;
    eprintln!("20 power cuts under load survived, {grants} terms checked");
}

/// The test above with the header written with its batch planted back in
/// the binary: some cut must then lose acknowledged records (seen: cut 7
/// at every run, by the pattern of writes it keeps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "the start took records for lost")]
async fn power_cuts_under_load_catch_the_header_written_with_its_batch() {
    power_cuts_under_load("power-cut-load-mutant", Some("header-before-sync")).await;
}

/// The same with the journal answering grants before their batch is
/// synced (`awaited-not-synced`, the core's rule of which batches are
/// synced broken): a cut must lose an acknowledged term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "below the granted")]
async fn power_cuts_under_load_catch_grants_answered_before_their_sync() {
    power_cuts_under_load("power-cut-load-unsynced", Some("awaited-not-synced")).await;
}

/// Twenty rounds of load and a power cut (see
/// [`many_power_cuts_under_load_lose_nothing_acknowledged`]); the terms
/// checked.
async fn power_cuts_under_load(tag: &str, mutant: Option<&str>) -> usize {
    const LEASES: usize = 16;
    let env: Vec<(&str, &str)> = mutant
        .map(|m| ("FENCEGATE_TEST_MUTANT", m))
        .into_iter()
        .collect();
    let serve = |data: &std::path::Path, log: &std::path::Path| {
        Proc::start(&serve_args(data, true), log, &env)
    };
    let mut fs = LazyFs::mount(tag);
    let data = fs.path().join("data");
    let log = fs.path().join(format!("../fencegate-{tag}.log"));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![Seen::default(); LEASES]));
    let (mut pending_total, mut grants) = (0, 0);
    for cut in 0..=20u64 {
        let p = serve(&data, &log);
        let c = HttpClient::new(&p.url);
        let round = seen.lock().unwrap().clone();
        let floors = check_after_cut(&c, &round, &p.log_text(), cut).await;
        grants += round.iter().filter(|s| s.granted.is_some()).count();
        if cut == 20 {
            p.kill9();
            break;
        }
        // Every term ends; the next round starts above what is there now.
        c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 600_001})))
            .await;
        *seen.lock().unwrap() = floors
            .into_iter()
            .map(|floor| Seen {
                floor,
                ..Seen::default()
            })
            .collect();
        let workers: Vec<_> = (0..4)
            .map(|w| tokio::spawn(load(c.clone(), w + 4 * cut as usize, LEASES, seen.clone())))
            .collect();
        // 20 to 200 ms of load, then the power goes in the middle of a
        // sync (the journal syncs all the time under this load).
        tokio::time::sleep(std::time::Duration::from_millis(20 + cut * 9)).await;
        fs.freeze_syncs();
        if mutant != Some("awaited-not-synced") {
            until("a sync under load", || fs.blocked_syncs() > 0).await;
        } // else nothing syncs under this load: the power goes as it is.
        let pending = fs.pending_writes();
        pending_total += pending;
        p.signal("-KILL");
        fs.thaw_syncs();
        p.kill9();
        for w in workers {
            let _ = w.await;
        }
        let mut rng = support::SplitMix::new(cut);
        let keep: Vec<bool> = (0..pending.max(64))
            .map(|_| rng.next_u64() & 1 == 1)
            .collect();
        fs.power_cut(|i| keep.get(i).copied().unwrap_or(false));
    }
    assert!(
        grants > 20 && pending_total > 0,
        "the load did little: {grants} grants"
    );
    grants
}

/// The checks after one cut (see the test above); every lease's token now.
async fn check_after_cut(c: &HttpClient, seen: &[Seen], log: &str, cut: u64) -> Vec<u64> {
    assert!(
        !log.contains("lost acknowledged records"),
        "cut {cut}: the start took records for lost:\n{log}"
    );
    let mut tokens = Vec::new();
    for (lease, s) in seen.iter().enumerate() {
        assert_eq!(
            s.reissued, None,
            "cut {cut}: p{lease}: a token granted again ({s:?})"
        );
        let r = c
            .send(Req::new("GET", &format!("/_fence/leases/p{lease}")))
            .await;
        let v = r.json();
        let token = v["token"].as_u64().unwrap_or(0);
        tokens.push(token.max(s.floor));
        let Some(granted) = &s.granted else { continue };
        let state = v["state"].as_str().unwrap_or("");
        assert!(
            token >= granted.token,
            "cut {cut}: p{lease}: token {token} below the granted {}: {v}",
            granted.token
        );
        if token == granted.token && s.open == 0 {
            let want = if s.released { "released" } else { "held" };
            assert_eq!(state, want, "cut {cut}: p{lease}: {v}");
        }
        if s.released && token == granted.token {
            assert_ne!(
                state, "held",
                "cut {cut}: p{lease}: a released term is back: {v}"
            );
        }
    }
    tokens
}
