//! Durable lease-store benchmark: acquires per second with 1, 16 and 64
//! concurrent clients (every grant fsync'd before it is returned; concurrent
//! grants share fsyncs), renewals per second, and recovery time of 100,000
//! leases; resident memory per held lease, the write-admission check time
//! and the time to list a page of 1,000 leases and to render the whole
//! `/_fence/metrics` exposition, at 1,000, 100,000 and 1,000,000 leases.
//!
//!     cargo bench --bench journal             # full run (about 10 s)
//!     cargo bench --bench journal -- --quick  # smoke run
//!
//! The journal lives under the build's target directory, on the same disk as
//! a default `./data`. Ratios are measured side by side in one run; the
//! machines are shared and noisy, so compare ratios rather than absolutes.

#![allow(clippy::disallowed_methods)] // a benchmark measures wall time

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::clock::Clock;
use fencegate::journal::{FileJournal, FileJournalOptions, GrantRecord, Journal};
use fencegate::lease::{Admission, AdmitOptions, LeaseLimits, LeaseStore, RestartRule};
use fencegate::names::{Holder, LeaseName};

fn scratch(tag: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// No per-holder rate limit: the benchmark measures the journal, not the
/// limiter (its clients acquire thousands of leases a second).
fn limits() -> LeaseLimits {
    LeaseLimits {
        acquire_rate_per_client: 0,
        ..LeaseLimits::default()
    }
}

fn bench_holder() -> Holder {
    Holder::new("bench").expect("a holder name")
}

fn open_store(dir: &Path) -> LeaseStore {
    let (journal, recovered) =
        FileJournal::open(dir, FileJournalOptions::default()).expect("journal");
    LeaseStore::restore(
        Clock::system(),
        limits(),
        Arc::new(journal),
        recovered.leases,
        RestartRule::default(),
    )
    .expect("restore")
}

/// Durable acquires per second with `clients` concurrent clients, each
/// acquiring fresh leases one after another for `duration`.
async fn acquires_per_second(clients: usize, duration: Duration) -> (f64, u64) {
    let dir = scratch(&format!("acquire-{clients}"));
    let store = open_store(&dir);
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while start.elapsed() < duration {
                    store
                        .acquire(
                            &LeaseName::new(&format!("c{c}-{n}")).unwrap(),
                            &bench_holder(),
                            60_000,
                            0,
                        )
                        .await
                        .expect("acquire");
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    (rate, total)
}

/// Renewals per second on one lease (no fsync: renewals are not journalled
/// unless their TTL changes).
async fn renews_per_second(duration: Duration) -> f64 {
    let dir = scratch("renew");
    let store = open_store(&dir);
    let held = store
        .acquire(&LeaseName::new("r").unwrap(), &bench_holder(), 60_000, 0)
        .await
        .expect("acquire");
    let id = held.lease_id.expose().as_bytes().to_vec();
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < duration {
        for _ in 0..1000 {
            store
                .renew("r", held.token, Some(&id), None, None)
                .expect("renew");
        }
        n += 1000;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    rate
}

/// Milliseconds to reopen a journal of `leases` granted leases and rebuild
/// the lease store from it.
async fn recovery_ms(leases: usize) -> (f64, u64) {
    let dir = scratch("recovery");
    {
        let (journal, _) = FileJournal::open(&dir, FileJournalOptions::default()).expect("journal");
        let journal = Arc::new(journal);
        // Write in concurrent chunks so group commit keeps the set-up short.
        let chunks: Vec<_> = (0..64)
            .map(|c| {
                let journal = journal.clone();
                tokio::spawn(async move {
                    for i in (c..leases).step_by(64) {
                        let record = GrantRecord {
                            lease: format!("lease-{i:07}"),
                            token: 1 + i as u64 % 7,
                            holder: format!("holder-{}", i % 100),
                            ttl_ms: 30_000,
                            lease_id: [b'a'; 32],
                            quiet: false,
                            wall_ms: 0,
                        };
                        journal.persist_grant(record).await.expect("persist");
                    }
                })
            })
            .collect();
        for c in chunks {
            c.await.expect("chunk");
        }
    }
    let bytes =
        std::fs::metadata(dir.join(fencegate::journal::file::JOURNAL_FILE)).map_or(0, |m| m.len());
    // The writer thread lets go of the directory lock once it has drained.
    let start = loop {
        let start = Instant::now();
        match FileJournal::open(&dir, FileJournalOptions::default()) {
            Ok((journal, recovered)) => {
                assert_eq!(recovered.leases.len(), leases);
                let store = LeaseStore::restore(
                    Clock::system(),
                    limits(),
                    Arc::new(journal),
                    recovered.leases,
                    RestartRule::default(),
                )
                .expect("restore");
                assert!(store.inspect("lease-0000000").is_some());
                break start;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    let _ = std::fs::remove_dir_all(&dir);
    (ms, bytes)
}

/// Resident memory of this process, from `/proc/self/statm`.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Nanoseconds per write admission (lookup, term check, in-flight count up
/// and down) over `sample`, a spread of held leases.
fn check_ns(store: &LeaseStore, sample: &[(String, u64, Vec<u8>)]) -> f64 {
    let options = AdmitOptions::default();
    let rounds = 1_000_000 / sample.len();
    let start = Instant::now();
    for _ in 0..rounds {
        for (name, token, id) in sample {
            match store.try_admit_write(name, *token, Some(id), None, &options) {
                Admission::Admitted(guard) => guard.finish(),
                _ => panic!("a held lease refused a write"),
            }
        }
    }
    start.elapsed().as_nanos() as f64 / (rounds * sample.len()) as f64
}

/// Microseconds to list a page of 1,000 leases (`GET /_fence/leases`'s
/// default), the first and one from the middle, the slower of the two.
fn page_us(store: &LeaseStore, leases: usize) -> f64 {
    let half = leases / 2;
    let middle = format!("tenant-{half:08}");
    [(None, leases), (Some(middle.as_str()), leases - half - 1)]
        .iter()
        .map(|&(after, left)| {
            let start = Instant::now();
            let (page, _) = store.page(None, "", after, 1000);
            let us = start.elapsed().as_secs_f64() * 1e6;
            assert_eq!(page.len(), left.min(1000));
            us
        })
        .fold(0.0, f64::max)
}

/// Run in a child process (`--memory N`) so each size starts from a fresh
/// heap: acquires N leases (durably, 64 at a time), prints the resident
/// memory they added and the admission check time over 1,000 of them.
async fn memory_child(leases: usize) {
    let dir = scratch(&format!("memory-{leases}"));
    let store = open_store(&dir);
    let before = rss_bytes();
    let tasks: Vec<_> = (0..64)
        .map(|c| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut sample = Vec::new();
                for i in (c..leases).step_by(64) {
                    let name = format!("tenant-{i:08}");
                    let held = store
                        .acquire(
                            &LeaseName::new(&name).unwrap(),
                            &bench_holder(),
                            3_600_000,
                            0,
                        )
                        .await
                        .expect("acquire");
                    if i % (leases / 1000).max(1) == 0 {
                        let id = held.lease_id.expose().as_bytes().to_vec();
                        sample.push((name, held.token, id));
                    }
                }
                sample
            })
        })
        .collect();
    let mut sample = Vec::new();
    for t in tasks {
        sample.extend(t.await.expect("task"));
    }
    let after = rss_bytes();
    // What the heap still holds once freed memory is handed back: the live
    // size, without the allocator's slack from table growth.
    // SAFETY: malloc_trim only releases free heap memory.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0)
    };
    let live = rss_bytes();
    let ns = check_ns(&store, &sample);
    let page_us = page_us(&store, leases);
    // The one pass the first page of a holder's own leases pays.
    let start = Instant::now();
    store.build_holder_index();
    let index_ms = start.elapsed().as_secs_f64() * 1000.0;
    // A whole /_fence/metrics exposition, the median of 21.
    let metrics = fencegate::metrics::Metrics::new(&store);
    let mut scrapes: Vec<f64> = (0..21)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(metrics.render());
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    scrapes.sort_by(f64::total_cmp);
    let scrape_us = scrapes[scrapes.len() / 2];
    println!(
        "{} {} {ns:.1} {page_us:.0} {index_ms:.0} {scrape_us:.0}",
        after.saturating_sub(before),
        live.saturating_sub(before)
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Resident bytes added by `leases` held leases (and after `malloc_trim`),
/// check ns, page µs, the holder index's build ms and a metrics scrape's
/// µs, measured in a child process.
fn memory(leases: usize) -> (u64, u64, f64, f64, f64, f64) {
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args(["--memory", &leases.to_string()])
        .output()
        .expect("child");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    match (
        words.next().and_then(|w| w.parse().ok()),
        words.next().and_then(|w| w.parse().ok()),
        words.next().and_then(|w| w.parse().ok()),
        words.next().and_then(|w| w.parse().ok()),
        words.next().and_then(|w| w.parse().ok()),
        words.next().and_then(|w| w.parse().ok()),
    ) {
        (Some(bytes), Some(live), Some(ns), Some(page_us), Some(index_ms), Some(scrape_us)) => {
            (bytes, live, ns, page_us, index_ms, scrape_us)
        }
        _ => panic!(
            "memory child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--memory") {
        let leases = args[i + 1].parse().expect("--memory N");
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(memory_child(leases));
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let duration = Duration::from_millis(if quick { 200 } else { 2000 });
    let recovery_leases = if quick { 10_000 } else { 100_000 };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        println!(
            "durable acquires (each fsync'd before it returns; {:?} per point)",
            duration
        );
        println!(
            "{:>8} {:>12} {:>10} {:>8}",
            "clients", "acquires/s", "acquires", "vs 1"
        );
        let mut base = None;
        for clients in [1, 16, 64] {
            let (rate, total) = acquires_per_second(clients, duration).await;
            let base = *base.get_or_insert(rate);
            println!(
                "{clients:>8} {rate:>12.0} {total:>10} {:>7.1}x",
                rate / base
            );
        }
        println!(
            "renewals/s (one lease, in memory): {:.0}",
            renews_per_second(duration).await
        );
        let (ms, bytes) = recovery_ms(recovery_leases).await;
        println!(
            "recovery of {recovery_leases} leases ({:.1} MiB journal): {ms:.0} ms",
            bytes as f64 / 1048576.0
        );
    });
    let sizes: &[usize] = if quick {
        &[1_000, 10_000]
    } else {
        &[1_000, 100_000, 1_000_000]
    };
    println!("\nheld leases (names like tenant-00000042, one holder)");
    println!(
        "{:>10} {:>12} {:>10} {:>14} {:>10} {:>10} {:>16} {:>10}",
        "leases",
        "RSS added",
        "per lease",
        "live per lease",
        "check ns",
        "page µs",
        "holder index ms",
        "scrape µs"
    );
    for &n in sizes {
        let (bytes, live, ns, page_us, index_ms, scrape_us) = memory(n);
        println!(
            "{n:>10} {:>8.1} MiB {:>8} B {:>12} B {ns:>10.1} {page_us:>10.0} {index_ms:>16.0} {scrape_us:>10.0}",
            bytes as f64 / 1048576.0,
            bytes / n as u64,
            live / n as u64
        );
    }
}
