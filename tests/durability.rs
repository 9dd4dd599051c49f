//! Durability of the lease store with the real binary: tokens never go
//! backwards across SIGKILL, a live term stays held for a full TTL after a
//! restart, torn journal tails are cut, corrupt journals stop the start.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use support::proc::{serve_args, Proc, TempDir};
use support::{held_from, Held, HttpClient, Req, SplitMix};

const LEASES: usize = 8;
const WRITERS: usize = 8;
const TTL_MS: u64 = 10_000;

fn acquire(lease: &str, holder: &str, ttl_ms: u64) -> Req {
    Req::new("POST", &format!("/_fence/leases/{lease}"))
        .json(json!({"holder": holder, "ttl_ms": ttl_ms}))
}

/// What the clients believe, across all restarts.
#[derive(Default)]
struct Ledger {
    /// Every token received for each lease, in the order received.
    received: HashMap<String, Vec<u64>>,
    /// Terms the clients hold (acquired, not released), by lease.
    holding: HashMap<String, (usize, Held)>,
    /// Failures of the invariant, reported at the end.
    violations: Vec<String>,
}

impl Ledger {
    fn granted(&mut self, lease: &str, writer: usize, held: Held) {
        let tokens = self.received.entry(lease.to_owned()).or_default();
        if let Some(&last) = tokens.last() {
            if held.token <= last {
                self.violations.push(format!(
                    "{lease}: token {} received after {last}",
                    held.token
                ));
            }
        }
        tokens.push(held.token);
        self.holding.insert(lease.to_owned(), (writer, held));
    }
}

/// One writer of the storm: acquires, writes, renews and releases at random
/// until the server goes away.
async fn writer(id: usize, url: String, ledger: Arc<Mutex<Ledger>>, seed: u64) {
    let c = HttpClient::new(&url);
    let mut rng = SplitMix::new(seed);
    loop {
        let lease = format!("l{}", rng.range(0..LEASES as u64));
        let mine = ledger
            .lock()
            .unwrap()
            .holding
            .get(&lease)
            .filter(|(w, _)| *w == id)
            .map(|(_, h)| h.clone());
        let outcome = match mine {
            None => c
                .try_send(acquire(&lease, &format!("w{id}"), TTL_MS))
                .await
                .map(|r| {
                    if r.status == 201 {
                        ledger.lock().unwrap().granted(&lease, id, held_from(&r));
                    }
                }),
            Some(held) => match rng.range(0..10) {
                0..=5 => c
                    .try_send(
                        Req::new("PUT", &format!("/kv/{lease}/k"))
                            .held(&held)
                            .body("v"),
                    )
                    .await
                    .map(|_| ()),
                6..=8 => c
                    .try_send(
                        Req::new("POST", &format!("/_fence/leases/{lease}/renew")).held(&held),
                    )
                    .await
                    .map(|_| ()),
                _ => {
                    // Whatever the answer, this writer stops relying on the term.
                    ledger.lock().unwrap().holding.remove(&lease);
                    c.try_send(Req::new("DELETE", &format!("/_fence/leases/{lease}")).held(&held))
                        .await
                        .map(|_| ())
                }
            },
        };
        if outcome.is_err() {
            return; // the server was killed
        }
    }
}

/// SIGKILL at random moments of an acquire/renew/write/release storm, 100
/// times in a row. The manual clock stands still during a storm (so no term
/// expires and grants of a lease are causally ordered), is moved past the
/// restart's settle window before the held terms write (writes sent before
/// the kill may still be at the backend until then), and past the TTL after
/// each restart's checks (so terms held by lost responses do not block the
/// next storm).
///
/// Seen failing against the in-memory lease store (tokens restart at 1 after
/// a restart): round 1 grants a held lease to the intruder with token 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_survive_sigkill_during_a_storm_100_times() {
    let dir = TempDir::new("storm");
    let data = dir.path().join("data");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    // Writes of a recovered lease's later terms wait this long after a
    // restart: the upstream deadline plus the settle time.
    let env = [
        ("FENCEGATE_PROXY__TIMEOUT_MS", "1000"),
        ("FENCEGATE_FENCE__SETTLE_MS", "500"),
    ];
    const SETTLE_WINDOW_MS: u64 = 1500;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut rng = SplitMix::new(7);
    let mut held_after_restart = 0;
    for round in 0..100u64 {
        let p = Proc::start(&args, &log, &env);
        let c = HttpClient::new(&p.url);
        c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": SETTLE_WINDOW_MS})))
            .await;
        // Restart rule: every term the clients hold is still held by them…
        let holding: Vec<(String, Held)> = ledger
            .lock()
            .unwrap()
            .holding
            .iter()
            .map(|(l, (_, h))| (l.clone(), h.clone()))
            .collect();
        for (lease, held) in &holding {
            let r = c
                .send(
                    Req::new("PUT", &format!("/kv/{lease}/k"))
                        .held(held)
                        .body("after-restart"),
                )
                .await;
            assert!(
                r.status.is_success(),
                "round {round}: {lease}: the live term's write was refused after restart: {}",
                r.text()
            );
        }
        // …and no lease that was held (even by a grant whose answer was lost
        // in the kill) goes to a new holder within a TTL of the restart.
        let list = c.send(Req::new("GET", "/_fence/leases")).await.json();
        for l in list["leases"].as_array().unwrap() {
            let lease = l["lease"].as_str().unwrap();
            if l["state"] == "held" {
                assert_eq!(
                    l["expires_in_ms"],
                    TTL_MS - SETTLE_WINDOW_MS,
                    "round {round}: {lease}: not a full TTL after restart"
                );
                let r = c.send(acquire(lease, "intruder", 1000)).await;
                assert_eq!(
                    r.status,
                    409,
                    "round {round}: {lease} granted to a new holder after restart: {}",
                    r.text()
                );
                held_after_restart += 1;
            } else {
                assert!(
                    !holding.iter().any(|(h, _)| h == lease),
                    "round {round}: {lease} held by a client is {}",
                    l["state"]
                );
            }
        }
        // Let every restored term expire, so the storm starts from free leases.
        c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": TTL_MS})))
            .await;
        ledger.lock().unwrap().holding.clear();

        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                tokio::spawn(writer(
                    w,
                    p.url.clone(),
                    ledger.clone(),
                    round * 100 + w as u64,
                ))
            })
            .collect();
        // Real time here only picks the moment of the kill.
        tokio::time::sleep(Duration::from_millis(rng.range(5..60))).await;
        p.kill9();
        for w in writers {
            w.await.unwrap();
        }
    }
    let ledger = ledger.lock().unwrap();
    assert!(ledger.violations.is_empty(), "{:#?}", ledger.violations);
    let grants: usize = ledger.received.values().map(Vec::len).sum();
    assert!(grants >= 500, "the storm granted only {grants} terms");
    assert!(
        held_after_restart >= 100,
        "only {held_after_restart} held terms were checked after restarts"
    );
    for (lease, tokens) in &ledger.received {
        let mut sorted = tokens.clone();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            tokens.len(),
            "{lease}: a token was received twice"
        );
    }
    eprintln!("storm: {grants} grants, {held_after_restart} held terms checked after 100 SIGKILLs");
}

/// The manual clock makes the restart rule exact: held for the full TTL after
/// the restart, renewable by its holder, then free.
#[tokio::test]
async fn a_live_term_is_held_for_a_full_ttl_after_restart() {
    let dir = TempDir::new("restart");
    let data = dir.path().join("data");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    let advance = |ms: u64| Req::new("POST", "/_fence/clock").json(json!({"advance_ms": ms}));

    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    let a = held_from(&c.send(acquire("orders", "A", 5000)).await);
    assert_eq!(a.token, 1);
    let r = c.send(acquire("other", "X", 5000)).await;
    let other = held_from(&r);
    c.send(Req::new("DELETE", "/_fence/leases/other").held(&other))
        .await;
    c.send(advance(4000)).await;
    p.kill9();

    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    // The old term's write is accepted right after the restart…
    let r = c
        .send(Req::new("PUT", "/kv/orders/x").held(&a).body("a-after"))
        .await;
    assert!(r.status.is_success(), "{}", r.text());
    let v = c
        .send(Req::new("GET", "/_fence/leases/orders"))
        .await
        .json();
    assert_eq!(
        (
            v["state"].as_str(),
            v["token"].as_u64(),
            v["expires_in_ms"].as_u64()
        ),
        (Some("held"), Some(1), Some(5000))
    );
    // …nobody else gets the lease for a full TTL after the restart…
    c.send(advance(4999)).await;
    let r = c.send(acquire("orders", "B", 5000)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (409, "lease-held")
    );
    c.send(advance(1)).await;
    // …then it expires, B gets token 2, and token 1 is stale.
    let r = c.send(acquire("orders", "B", 5000)).await;
    assert_eq!(r.status, 201);
    let b = held_from(&r);
    assert_eq!(b.token, 2);
    let r = c
        .send(Req::new("PUT", "/kv/orders/x").held(&a).body("a-late"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (412, "stale-fencing-token")
    );
    // A released term stays released; its next token continues above.
    let r = c.send(acquire("other", "Y", 5000)).await;
    assert_eq!(held_from(&r).token, 2);
    p.kill9();

    // Renewal after a restart works with the persisted lease id.
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    let r = c
        .send(Req::new("POST", "/_fence/leases/orders/renew").held(&b))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = c.send(Req::new("GET", "/_fence/leases")).await.json();
    assert_eq!(v["leases"].as_array().unwrap().len(), 2);
    assert_eq!(v["leases"][0]["transitions"], 2);
    p.kill9();
}

/// The restart window holds only the leases whose earlier terms may still
/// have a write on its way to the storage. Before, every write of a token
/// above 1 waited `proxy.timeout_ms + fence.settle_ms` after any restart
/// (31 s with the defaults; seen failing: the first write below was refused
/// 504 for the restart window). After kill -9:
/// - `calm`: term 2 was granted with nothing in flight: its holder writes at
///   once;
/// - `handed`: term 1 was released with nothing in flight: term 2, granted
///   after the restart, writes at once;
/// - `busy`: term 2 was granted while a write of term 1 was in flight: its
///   write is held back until the restart window has passed.
#[tokio::test]
async fn the_restart_window_holds_only_what_may_be_unfinished() {
    let dir = TempDir::new("window");
    let data = dir.path().join("data");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    // The restart window: the upstream deadline plus the settle time.
    let env = [
        ("FENCEGATE_PROXY__TIMEOUT_MS", "1000"),
        ("FENCEGATE_FENCE__SETTLE_MS", "500"),
        // The unfinished body below is not cut off (real time).
        ("FENCEGATE_LIMITS__BODY_READ_TIMEOUT_MS", "600000"),
    ];
    let put = |lease: &str, held: &Held| {
        Req::new("PUT", &format!("/kv/{lease}/k"))
            .held(held)
            .body(format!("by {}", held.token))
    };
    let release = |lease: &str, held: &Held| {
        Req::new("DELETE", &format!("/_fence/leases/{lease}")).held(held)
    };
    let waits = |metrics: &str| {
        support::metric(metrics, "fencegate_barrier_waits_total").map(str::to_owned)
    };

    let p = Proc::start(&args, &log, &env);
    let c = HttpClient::new(&p.url);
    let one = held_from(&c.send(acquire("calm", "A", TTL_MS)).await);
    assert_eq!(c.send(put("calm", &one)).await.status, 201);
    c.send(release("calm", &one)).await;
    let calm = held_from(&c.send(acquire("calm", "B", TTL_MS)).await);
    assert_eq!(calm.token, 2);
    assert!(c.send(put("calm", &calm)).await.status.is_success());

    let one = held_from(&c.send(acquire("handed", "A", TTL_MS)).await);
    assert_eq!(c.send(put("handed", &one)).await.status, 201);
    c.send(release("handed", &one)).await;

    // A write still in flight (its body unfinished) when term 1 is released
    // and term 2 granted, and when the store is killed.
    let one = held_from(&c.send(acquire("busy", "A", TTL_MS)).await);
    let addr = p.url.trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let head = format!(
            "PUT /kv/busy/k HTTP/1.1\r\nhost: x\r\nfencing-token: {}\r\n\
             fencing-lease-id: {}\r\ncontent-length: 100\r\n\r\npartial",
            one.token, one.lease_id
        );
        s.write_all(head.as_bytes()).await.unwrap();
        // Until the proxy counts it in flight (bounded: 10 s).
        let mut counted = false;
        for _ in 0..1000 {
            let m = c.send(Req::new("GET", "/_fence/metrics")).await.text();
            if m.contains("fencegate_writes_in_flight 1") {
                counted = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(counted, "the partial write was never in flight");
    }
    c.send(release("busy", &one)).await;
    let busy = held_from(&c.send(acquire("busy", "B", TTL_MS)).await);
    assert_eq!(busy.token, 2);
    p.kill9();
    drop(s);

    let p = Proc::start(&args, &log, &env);
    let c = HttpClient::new(&p.url);
    let r = c.send(put("calm", &calm)).await;
    assert!(r.status.is_success(), "{}", r.text());
    let handed = held_from(&c.send(acquire("handed", "C", TTL_MS)).await);
    assert_eq!(handed.token, 2);
    let r = c.send(put("handed", &handed)).await;
    assert!(r.status.is_success(), "{}", r.text());
    let m = c.send(Req::new("GET", "/_fence/metrics")).await.text();
    assert_eq!(waits(&m).as_deref(), Some("0"), "{m}");

    // It is held back: the window (1.5 s) is longer than the upstream
    // deadline (1 s), so it is refused at once, told when to come back…
    let r = c.send(put("busy", &busy)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (504, "upstream-timeout"),
        "{}",
        r.text()
    );
    assert!(
        r.text().contains("before fencegate restarted"),
        "{}",
        r.text()
    );
    let m = c.send(Req::new("GET", "/_fence/metrics")).await.text();
    assert_eq!(waits(&m).as_deref(), Some("1"), "{m}");
    // …and goes out once the restart window has passed.
    c.send(Req::new("POST", "/_fence/clock").json(json!({"advance_ms": 1500})))
        .await;
    let r = c.send(put("busy", &busy)).await;
    assert!(r.status.is_success(), "{}", r.text());
    p.kill9();
}

/// A term that ended before a restart stays ended (issue: after a crash
/// every unreleased term was held again for a full TTL, so a holder whose
/// term had expired renewed it and wrote; seen failing: `gone` was held
/// again, its renewal accepted). The journal's wall-clock hint of each
/// term's end, 20 s later on the wall clock: `gone` (TTL 1 s) has ended,
/// `live` (TTL 60 s) is held for its full TTL, and `renewed` (TTL 10 s,
/// last renewed at 6 s, recorded as its hint fell half a TTL behind) for
/// what the hint allows at most: its end (16 s) plus half its TTL plus the
/// tolerance (1 s), 2 s. In process, on manual clocks (the second starting
/// 20 s later, as the restart's wall clock).
#[tokio::test]
async fn a_term_that_ended_before_a_restart_stays_ended() {
    use fencegate::clock::Clock;
    use fencegate::journal::{FileJournal, FileJournalOptions};
    use fencegate::lease::{LeaseLimits, LeaseStore, RestartRule, TermState};
    use fencegate::names::{Holder, LeaseName};

    let dir = TempDir::new("hint");
    let data = dir.path().join("data");
    let open = |start_ms: u64| {
        let (journal, recovered) = loop {
            match FileJournal::open(&data, FileJournalOptions::default()) {
                Ok(opened) => break opened,
                // The last store's journal thread lets go of the directory.
                Err(e) if e.0.contains("in use") => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("{e}"),
            }
        };
        LeaseStore::restore(
            Clock::manual(start_ms),
            LeaseLimits::default(),
            Arc::new(journal),
            recovered.leases,
            RestartRule::default(),
        )
        .unwrap()
    };
    let name = |n: &str| LeaseName::new(n).unwrap();
    let holder = |h: &str| Holder::new(h).unwrap();

    let leases = open(0);
    leases
        .acquire(&name("left"), &holder("L"), 1000, 0)
        .await
        .unwrap();
    let gone = leases
        .acquire(&name("gone"), &holder("A"), 1000, 0)
        .await
        .unwrap();
    leases
        .acquire(&name("live"), &holder("B"), 60_000, 0)
        .await
        .unwrap();
    let renewed = leases
        .acquire(&name("renewed"), &holder("C"), 10_000, 0)
        .await
        .unwrap();
    let id = renewed.lease_id.to_text();
    for at in [4_000, 6_000] {
        leases.clock().advance(at - leases.clock().now_ms());
        leases
            .renew("renewed", renewed.token, Some(&id), None, None)
            .unwrap();
    }
    // A grant is synced, and with it the renewal's lazy record before it.
    leases
        .acquire(&name("sync"), &holder("D"), 60_000, 0)
        .await
        .unwrap();
    drop(leases);

    let leases = open(20_000);
    let view = |n: &str| leases.inspect(n).unwrap();
    assert_eq!(view("gone").state, TermState::Expired);
    let gone_id = gone.lease_id.to_text();
    assert!(leases
        .renew("gone", gone.token, Some(&gone_id), None, None)
        .is_err());
    let next = leases
        .acquire(&name("gone"), &holder("E"), 1000, 0)
        .await
        .unwrap();
    assert_eq!(next.token, 2);
    assert_eq!(
        (view("live").state, view("live").expires_in_ms),
        (TermState::Held, 60_000)
    );
    assert_eq!(
        (view("renewed").state, view("renewed").expires_in_ms),
        (TermState::Held, 2_000)
    );
    assert_eq!(view("left").state, TermState::Expired);
    drop(leases);

    // A later start whose wall clock went back keeps it ended: the start
    // that ended it recorded so (seen failing: held again for a full TTL).
    let leases = open(0);
    assert_ne!(leases.inspect("left").unwrap().state, TermState::Held);
}

/// Nobody takes the lease namespace for good: names idle for
/// `leases.retention_ms` are forgotten, new names fit again, and a
/// forgotten name's next token is above every token it had, also after
/// kill -9. (The manual clock moves the lease time; the sweep itself runs
/// on a real-time tick, so the test waits for it, bounded.) Seen failing
/// before retention: the fourth name was refused for ever.
#[tokio::test]
async fn idle_names_are_forgotten_and_keep_their_tokens_across_sigkill() {
    let dir = TempDir::new("retention");
    let data = dir.path().join("data");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    let env = [
        ("FENCEGATE_LEASES__MAX_LEASES", "3"),
        ("FENCEGATE_LEASES__RETENTION_MS", "5000"),
        ("FENCEGATE_LEASES__MAX_WAIT_MS", "1000"),
        ("FENCEGATE_PROXY__TIMEOUT_MS", "1000"),
        ("FENCEGATE_FENCE__SETTLE_MS", "100"),
    ];
    let advance = |ms: u64| Req::new("POST", "/_fence/clock").json(json!({"advance_ms": ms}));
    let listed = |c: HttpClient| async move {
        let v = c.send(Req::new("GET", "/_fence/leases")).await.json();
        v["leases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["lease"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };

    let p = Proc::start(&args, &log, &env);
    let c = HttpClient::new(&p.url);
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let a = held_from(&c.send(acquire("a", "A", 1000)).await);
        tokens.push(a.token);
        c.send(Req::new("DELETE", "/_fence/leases/a").held(&a))
            .await;
    }
    held_from(&c.send(acquire("b", "B", 1000)).await);
    held_from(&c.send(acquire("c", "C", 1000)).await);
    let r = c.send(acquire("d", "D", 1000)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (429, "too-many-leases")
    );
    c.send(advance(10_000)).await;
    let mut waited = 0;
    while !listed(c.clone()).await.is_empty() {
        assert!(waited < 100, "the idle leases were not forgotten in 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
    }
    let d = c.send(acquire("d", "D", 1000)).await;
    assert_eq!(d.status, 201, "{}", d.text());
    // The grant of d is synced, and with it the records of the leases
    // forgotten before it.
    p.kill9();

    let p = Proc::start(&args, &log, &env);
    let c = HttpClient::new(&p.url);
    assert_eq!(listed(c.clone()).await, ["d"]);
    let again = held_from(&c.send(acquire("a", "A2", 1000)).await);
    assert!(
        tokens.iter().all(|&t| again.token > t),
        "a got {} after {tokens:?}",
        again.token
    );
    let fresh = held_from(&c.send(acquire("e", "E", 1000)).await);
    assert!(
        fresh.token > 3,
        "a new name starts above every forgotten token: {}",
        fresh.token
    );
    p.kill9();
}

/// A journal whose tail was torn mid-record: the start cuts the tail and keeps
/// every acknowledged grant.
#[tokio::test]
async fn a_torn_tail_is_cut_and_acknowledged_grants_survive() {
    let dir = TempDir::new("torn");
    let data = dir.path().join("data");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    let mut tokens = Vec::new();
    for i in 0..5 {
        let r = c.send(acquire(&format!("l{i}"), "A", 5000)).await;
        tokens.push(held_from(&r));
    }
    p.kill9();
    let journal = data.join("journal.log");
    let len = std::fs::metadata(&journal).unwrap().len();
    // A grant that was being written when the power went: its record is
    // truncated mid-way, and it was never acknowledged.
    let mut frame = Vec::new();
    fencegate::journal::record::Record::Grant {
        lease: "unacked".into(),
        token: 1,
        holder: "Z".into(),
        ttl_ms: 5000,
        lease_id: [b'0'; 32],
        quiet: false,
        wall_ms: 0,
    }
    .encode_frame(&mut frame);
    let bytes = std::fs::read(&journal).unwrap();
    std::fs::write(
        &journal,
        [bytes.clone(), frame[..frame.len() / 2].to_vec()].concat(),
    )
    .unwrap();

    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    assert!(
        p.log_text().contains("torn"),
        "the cut is logged: {}",
        p.log_text()
    );
    // Cut, and then the start gave the journal a new identity (a record).
    let mut identity = Vec::new();
    fencegate::journal::record::Record::Identity { id: 1 }.encode_frame(&mut identity);
    assert_eq!(
        std::fs::metadata(&journal).unwrap().len(),
        len + identity.len() as u64,
        "the torn tail was cut"
    );
    let r = c.send(Req::new("GET", "/_fence/leases/unacked")).await;
    assert_eq!(r.status, 404, "the torn grant was recovered");
    for (i, held) in tokens.iter().enumerate() {
        let r = c
            .send(Req::new("PUT", &format!("/kv/l{i}/x")).held(held).body("x"))
            .await;
        assert!(r.status.is_success(), "l{i}: {}", r.text());
    }
    p.kill9();
}

/// A corrupt record that is not the tail stops the start with a clear error:
/// never a silent reset of the tokens.
#[tokio::test]
async fn a_corrupt_record_inside_the_journal_stops_the_start() {
    let dir = TempDir::new("corrupt");
    let data = dir.path().join("data");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    for i in 0..5 {
        c.send(acquire(&format!("l{i}"), "A", 5000)).await;
    }
    p.kill9();
    let journal = data.join("journal.log");
    let mut bytes = std::fs::read(&journal).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&journal, &bytes).unwrap();
    let err = Proc::try_start(&args, &log, &[])
        .err()
        .expect("the start must fail");
    assert!(err.contains("corrupt"), "{err}");
    assert_eq!(
        std::fs::read(&journal).unwrap(),
        bytes,
        "the journal was left as it was"
    );
}

/// An older copy of the journal put back beside `store.meta`, and a whole
/// data directory put back from a backup. Seen failing before journals had
/// an identity: the copy was taken for the journal, the lease at token 2
/// was granted token 2 again, and the term released since was held again.
#[tokio::test]
async fn an_older_journal_is_caught_and_a_restored_backup_reissues_nothing() {
    let dir = TempDir::new("restore");
    let data = dir.path().join("data");
    let backup = dir.path().join("backup");
    let log = dir.path().join("fencegate.log");
    let args = serve_args(&data, true);
    let renew = |h: &Held| Req::new("POST", "/_fence/leases/orders/renew").held(h);
    let copy_dir = |from: &std::path::Path, to: &std::path::Path| {
        std::fs::create_dir_all(to).unwrap();
        for file in ["journal.log", "store.meta"] {
            std::fs::copy(from.join(file), to.join(file)).unwrap();
        }
    };
    let stop = |mut p: Proc| {
        p.signal("-TERM");
        assert!(p.child.wait().unwrap().success());
    };

    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    let a = held_from(&c.send(acquire("orders", "A", 60_000)).await);
    assert_eq!(a.token, 1);
    stop(p);
    copy_dir(&data, &backup);

    // Since the backup: A released, B granted token 2 and released.
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&a))
        .await;
    assert_eq!(r.status, 204);
    let b = held_from(&c.send(acquire("orders", "B", 60_000)).await);
    assert_eq!(b.token, 2);
    let r = c
        .send(Req::new("DELETE", "/_fence/leases/orders").held(&b))
        .await;
    assert_eq!(r.status, 204);
    stop(p);

    // The backup's journal alone, beside today's store.meta: caught.
    std::fs::copy(backup.join("journal.log"), data.join("journal.log")).unwrap();
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    assert_ne!(
        c.send(renew(&a)).await.status,
        200,
        "the ended term is back"
    );
    let n = held_from(&c.send(acquire("orders", "N", 60_000)).await);
    assert!(n.token > 2, "token {} issued again", n.token);
    assert!(p.log_text().contains("not the log store.meta"));
    stop(p);

    // The whole directory put back cannot be told from the real one: what
    // the procedure is for.
    let _ = std::fs::remove_dir_all(&data);
    copy_dir(&backup, &data);
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    assert_eq!(c.send(renew(&a)).await.status, 200);
    p.kill9();

    // Started as restored: every term ended, every token above the backup's
    // plus the bump, and later starts need nothing more.
    let _ = std::fs::remove_dir_all(&data);
    copy_dir(&backup, &data);
    let mut restored = args.clone();
    restored.extend(["--restored-from-backup".to_string(), "1000".to_string()]);
    let p = Proc::start(&restored, &log, &[]);
    let c = HttpClient::new(&p.url);
    assert_ne!(
        c.send(renew(&a)).await.status,
        200,
        "the ended term is back"
    );
    let d = held_from(&c.send(acquire("orders", "D", 60_000)).await);
    assert!(d.token > 1001, "token {}", d.token);
    let e = held_from(&c.send(acquire("new-name", "E", 60_000)).await);
    assert!(
        e.token > 1001,
        "a name the backup never saw: token {}",
        e.token
    );
    stop(p);
    let p = Proc::start(&args, &log, &[]);
    let c = HttpClient::new(&p.url);
    assert_eq!(c.send(renew(&d)).await.status, 200);
    p.kill9();
}

/// A journal that cannot persist (the fault-injection seam of the real file
/// journal, in-process): acquire is 503 with no token, readiness is 503,
/// writes of live terms keep working, and all recovers once the disk does.
#[tokio::test]
async fn a_journal_that_cannot_persist_fails_closed_and_recovers() {
    use fencegate::app::{self, Parts};
    use fencegate::backend::{Backend, EmbeddedStore};
    use fencegate::clock::{Clock, ClockKind};
    use fencegate::config::Config;
    use fencegate::journal::{FileJournal, FileJournalOptions};
    use fencegate::lease::{LeaseStore, RestartRule};
    use std::sync::atomic::AtomicBool;
    use tower::ServiceExt;

    let dir = TempDir::new("faults");
    let options = FileJournalOptions {
        probe_interval_ms: 10,
        ..FileJournalOptions::default()
    };
    let (journal, recovered) = FileJournal::open(&dir.path().join("data"), options).unwrap();
    let faults = journal.faults();
    let config = Config {
        clock: ClockKind::Manual,
        ..Config::default()
    };
    let leases = LeaseStore::restore(
        Clock::new(ClockKind::Manual),
        config.lease_limits(),
        Arc::new(journal),
        recovered.leases,
        RestartRule::default(),
    )
    .unwrap();
    let store = EmbeddedStore::new();
    let app = app::build(
        &config,
        Parts {
            leases,
            backend: Backend::Embedded(store.clone()),
            draining: Arc::new(AtomicBool::new(false)),
            primacy: None,
            metrics: None,
            key_states: None,
        },
    )
    .unwrap();
    let send = |req: Req| {
        let app = app.clone();
        async move { support::Resp::read(app.oneshot(req.build("")).await.unwrap()).await }
    };

    let a = held_from(&send(acquire("a", "A", 5000)).await);
    faults.set_disk_full(true);
    let r = send(acquire("b", "B", 5000)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (503, "lease-store-unavailable")
    );
    assert!(!r.headers.contains_key("fencing-token") && !r.text().contains("lease_id"));
    let r = send(Req::new("GET", "/_fence/readyz")).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (503, "lease-store-unavailable")
    );
    assert_eq!(
        send(Req::new("GET", "/_fence/leases/b")).await.status,
        404,
        "no term without persistence"
    );
    // The live term keeps writing and renewing while the disk is full.
    let r = send(Req::new("PUT", "/kv/a/x").held(&a).body("during")).await;
    assert!(r.status.is_success());
    assert_eq!(store.get("/kv/a/x").unwrap(), "during");
    assert_eq!(
        send(Req::new("POST", "/_fence/leases/a/renew").held(&a))
            .await
            .status,
        200
    );

    faults.set_disk_full(false);
    // The probe finds the disk writable again on its own (bounded poll; this
    // waits for the journal's retry, not for a lease).
    let mut ready = false;
    for _ in 0..500 {
        if send(Req::new("GET", "/_fence/readyz")).await.status == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(ready, "readiness did not recover");
    let r = send(acquire("b", "B", 5000)).await;
    assert_eq!(r.status, 201);
    assert_eq!(
        held_from(&r).token,
        2,
        "the refused grant's token is never handed out"
    );
}

/// The real binary on a real full disk: a tiny tmpfs mounted for the test.
/// It fails closed while running, starts degraded on the full disk (the
/// recovered term served, nothing granted: seen failing, it did not start
/// at all), and recovers by itself when space returns. Needs root, and says
/// so rather than skip.
#[tokio::test]
async fn the_real_binary_on_a_full_disk_fails_closed_and_recovers() {
    use std::process::Command;
    assert!(
        support::tools::is_root(),
        "this test mounts a tmpfs to fill a real disk, which needs root: run the tests as root"
    );
    let dir = TempDir::new("tmpfs");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount tmpfs failed");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());

    let data = mnt.join("data");
    let log = dir.path().join("fencegate.log");
    let p = Proc::start(&serve_args(&data, true), &log, &[]);
    let c = HttpClient::new(&p.url);
    let a = held_from(&c.send(acquire("a", "A", 60_000)).await);
    // Fill the disk.
    let junk = mnt.join("junk");
    let mut f = std::fs::File::create(&junk).unwrap();
    let chunk = vec![0u8; 4096];
    while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
    let _ = f.sync_all();
    drop(f);

    // Appends still fit in the journal's last, partly used block; grants
    // succeed (durably) until it is full, then fail closed.
    let mut granted = 1;
    let refused = loop {
        let r = c.send(acquire(&format!("b{granted}"), "B", 5000)).await;
        if r.status != 201 {
            break r;
        }
        granted += 1;
        assert!(granted < 200, "the full disk never refused a grant");
    };
    assert_eq!(
        (refused.status.as_u16(), refused.reason().as_str()),
        (503, "lease-store-unavailable"),
        "{}",
        refused.text()
    );
    assert_eq!(c.send(Req::new("GET", "/_fence/readyz")).await.status, 503);
    let r = c
        .send(Req::new("PUT", "/kv/a/x").held(&a).body("during"))
        .await;
    assert!(r.status.is_success(), "the live term's write: {}", r.text());

    // Restarted on the full disk: it comes up, degraded. The live term is
    // held and written under; nothing is granted; not ready.
    p.kill9();
    let p = Proc::start(&serve_args(&data, true), &log, &[]);
    let c = HttpClient::new(&p.url);
    assert_eq!(c.send(Req::new("GET", "/_fence/readyz")).await.status, 503);
    let r = c.send(acquire("new", "B", 5000)).await;
    assert_eq!(
        (r.status.as_u16(), r.reason().as_str()),
        (503, "lease-store-unavailable"),
        "{}",
        r.text()
    );
    let r = c
        .send(Req::new("PUT", "/kv/a/x").held(&a).body("degraded"))
        .await;
    assert!(
        r.status.is_success(),
        "the recovered term's write: {}",
        r.text()
    );
    let r = c
        .send(Req::new("POST", "/_fence/leases/a/renew").held(&a))
        .await;
    assert_eq!(r.status, 200, "the recovered term's renewal: {}", r.text());

    std::fs::remove_file(&junk).unwrap();
    let mut ready = false;
    for _ in 0..300 {
        if c.send(Req::new("GET", "/_fence/readyz")).await.status == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready, "readiness did not recover: {}", p.log_text());
    let r = c.send(acquire("last", "B", 5000)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    p.kill9();
    // Everything acknowledged is on the disk, the refused grant is not.
    let p = Proc::start(&serve_args(&data, true), &log, &[]);
    let c = HttpClient::new(&p.url);
    let v = c.send(Req::new("GET", "/_fence/leases")).await.json();
    let names: Vec<&str> = v["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["lease"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), granted + 1, "{names:?}");
    assert!(names.contains(&"last") && names.contains(&"a"));
    assert!(
        !names.contains(&format!("b{granted}").as_str()),
        "the refused grant was recovered"
    );
    p.kill9();
}

/// Damage to the journal's end, or its loss, never reissues a token. Each
/// case builds the same history (five terms of `orders` granted and
/// released, then a sixth granted and held; two terms of `other`; one term of
/// `last`, granted in the very last batch), kills the proxy, damages the
/// journal, and restarts: every lease's next token must be above every token
/// ever returned, or the start must be refused with a message that says what
/// to do (and then, told to go on, the same holds).
///
/// Seen failing on the journal without a header and a token floor: a bit
/// flip in the last grant gave token 6 of `orders` out again; a cut gave
/// `last` token 1 again; an empty or missing log started a new store at 1.
#[tokio::test]
async fn damage_at_the_journals_end_never_reissues_a_token() {
    use fencegate::journal::record::{read_frame, Frame, HEADER_LEN};
    // Where each frame of a version 2 journal starts.
    fn frames(bytes: &[u8]) -> Vec<usize> {
        let mut at = HEADER_LEN;
        let mut starts = Vec::new();
        while let Frame::Record(_, len) = read_frame(&bytes[at..]) {
            starts.push(at);
            at += len;
        }
        assert_eq!(at, bytes.len(), "the undamaged journal is whole");
        starts
    }
    type Damage = fn(&std::path::Path);
    let cases: [(&str, Damage, bool); 5] = [
        (
            "a bit flip in the last complete grant",
            |p| {
                let mut b = std::fs::read(p).unwrap();
                let last = *frames(&b).last().unwrap();
                let at = last + (b.len() - last) / 2;
                b[at] ^= 0x10;
                std::fs::write(p, b).unwrap();
            },
            false,
        ),
        (
            "a truncation in the middle of the file",
            |p| {
                let b = std::fs::read(p).unwrap();
                std::fs::write(p, &b[..(HEADER_LEN + b.len()) / 2]).unwrap();
            },
            false,
        ),
        (
            "a truncation inside the last record",
            |p| {
                let b = std::fs::read(p).unwrap();
                let last = *frames(&b).last().unwrap();
                std::fs::write(p, &b[..last + 5]).unwrap();
            },
            false,
        ),
        (
            "an empty journal",
            |p| std::fs::write(p, b"").unwrap(),
            true,
        ),
        (
            "a missing journal",
            |p| std::fs::remove_file(p).unwrap(),
            true,
        ),
    ];
    for (what, damage, refused) in cases {
        let dir = TempDir::new("damage");
        let data = dir.path().join("data");
        let log = dir.path().join("fencegate.log");
        let args = serve_args(&data, true);
        let p = Proc::start(&args, &log, &[]);
        let c = HttpClient::new(&p.url);
        let mut returned: std::collections::BTreeMap<&str, u64> = Default::default();
        for (lease, terms) in [("orders", 5), ("other", 2)] {
            for _ in 0..terms {
                let held = held_from(&c.send(acquire(lease, "A", 60_000)).await);
                returned.insert(lease, held.token);
                let r = c
                    .send(Req::new("DELETE", &format!("/_fence/leases/{lease}")).held(&held))
                    .await;
                assert_eq!(r.status, 204);
            }
        }
        let sixth = held_from(&c.send(acquire("orders", "A", 60_000)).await);
        assert_eq!(sixth.token, 6);
        returned.insert("orders", 6);
        let last = held_from(&c.send(acquire("last", "A", 60_000)).await);
        returned.insert("last", last.token);
        p.kill9();

        damage(&data.join("journal.log"));
        let p = match Proc::try_start(&args, &log, &[]) {
            Ok(p) => {
                assert!(!refused, "{what}: the start was not refused");
                assert!(
                    p.log_text().contains("lost acknowledged records"),
                    "{what}: {}",
                    p.log_text()
                );
                p
            }
            Err(message) => {
                assert!(refused, "{what}: refused: {message}");
                assert!(
                    message.contains("--accept-journal-loss"),
                    "{what}: {message}"
                );
                let mut told = args.clone();
                told.push("--accept-journal-loss".into());
                Proc::start(&told, &log, &[])
            }
        };
        let c = HttpClient::new(&p.url);
        // The held sixth term did not come back to life.
        let r = c
            .send(Req::new("PUT", "/kv/orders/x").held(&sixth).body("zombie"))
            .await;
        assert_eq!(r.status, 412, "{what}: {}", r.text());
        for (lease, max) in &returned {
            let r = c.send(acquire(lease, "B", 60_000)).await;
            assert_eq!(r.status, 201, "{what}: {lease}: {}", r.text());
            let token = held_from(&r).token;
            assert!(
                token > *max,
                "{what}: {lease} issued token {token} again (returned up to {max})"
            );
        }
        p.kill9();
    }
}
