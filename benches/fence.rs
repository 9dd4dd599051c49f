//! The fenced write path, in process (no sockets): nanoseconds per `PUT`
//! through the whole app (limits, routing, header checks, lease check,
//! in-flight accounting, embedded store), side by side with the same write
//! unfenced, in one run.
//!
//!     cargo bench --bench fence             # full run
//!     cargo bench --bench fence -- --quick  # smoke run
//!
//! Modes are interleaved over several rounds and the median is reported, so
//! machine noise hits every mode alike. For counts that do not drift with
//! noise, run one mode under callgrind and difference two request counts:
//!
//!     valgrind --tool=callgrind target/release/deps/fence-* --only 0 20000 Only the public API and environment
//! settings are used, so the file also builds against older revisions for
//! before/after comparisons.

#![allow(clippy::disallowed_methods)] // a benchmark measures wall time

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use fencegate::app::{self, Parts};
use fencegate::backend::{Backend, EmbeddedStore};
use fencegate::clock::Clock;
use fencegate::config::{Config, Overrides};
use fencegate::journal::MemoryJournal;
use fencegate::lease::LeaseStore;
use fencegate::names::{Holder, LeaseName};
use http::Request;
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;

struct Mode {
    name: &'static str,
    env: Vec<(&'static str, &'static str)>,
    fenced: bool,
    /// The route has storage-side preconditions (SPEC §10): each PUT
    /// carries the `If-Match` fencegate learned from the last answer.
    preconditions: bool,
}

fn modes() -> Vec<Mode> {
    vec![
        Mode {
            name: "fenced write (barrier on)",
            env: vec![],
            fenced: true,
            preconditions: false,
        },
        Mode {
            name: "fenced write (preconditions)",
            env: vec![],
            fenced: true,
            preconditions: true,
        },
        Mode {
            name: "fenced write (barrier off)",
            env: vec![
                ("FENCEGATE_FENCE__DRAIN_BARRIER", "false"),
                ("FENCEGATE_ALLOW_UNSAFE_SETTINGS", "true"),
            ],
            fenced: true,
            preconditions: false,
        },
        Mode {
            name: "unfenced write (no route)",
            env: vec![("FENCEGATE_FENCE__ALLOW_UNROUTED_WRITES", "true")],
            fenced: false,
            preconditions: false,
        },
    ]
}

/// Runs `n` sequential PUTs in `mode`; returns nanoseconds per request.
async fn run(mode: &Mode, n: u32) -> f64 {
    let env = mode.env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let mut config = Config::load(None, env, &Overrides::default()).expect("config");
    if !mode.fenced {
        config.fence.routes.clear();
    }
    if mode.preconditions {
        config.fence.routes[0].preconditions = fencegate::route::Preconditions::Etag;
    }
    let leases = LeaseStore::new(
        Clock::system(),
        config.lease_limits(),
        Arc::new(MemoryJournal::default()),
    );
    let app = app::build(
        &config,
        Parts {
            leases: leases.clone(),
            backend: Backend::Embedded(EmbeddedStore::new()),
            draining: Arc::new(AtomicBool::new(false)),
            primacy: None,
            metrics: None,
            key_states: None,
        },
    )
    .expect("app");
    let held = leases
        .acquire(
            &LeaseName::new("orders").unwrap(),
            &Holder::new("bench").unwrap(),
            3_600_000,
            0,
        )
        .await
        .expect("acquire");
    let token = held.token.to_string();
    let id = held.lease_id.expose().to_owned();
    let body = Bytes::from_static(&[b'x'; 64]);
    if mode.preconditions {
        // Once: the key's state, so no PUT is answered 428.
        let read = Request::get("/kv/orders/x")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let _ = app.clone().oneshot(read).await.expect("infallible");
    }
    let start = Instant::now();
    for _ in 0..n {
        let req = Request::put("/kv/orders/x")
            .header("fencing-token", &token)
            .header("fencing-lease-id", &id)
            .header("content-length", "64")
            .body(Full::new(body.clone()))
            .expect("request");
        let res = app.clone().oneshot(req).await.expect("infallible");
        assert!(res.status().is_success(), "{}", res.status());
        let _ = res.into_body().collect().await;
    }
    start.elapsed().as_nanos() as f64 / f64::from(n)
}

/// `--only I N`: run mode I once with N requests and print nothing else
/// (for instruction counts under `valgrind --tool=callgrind`).
fn only(args: &[String]) -> Option<(usize, u32)> {
    let i = args.iter().position(|a| a == "--only")?;
    Some((
        args.get(i + 1)?.parse().ok()?,
        args.get(i + 2)?.parse().ok()?,
    ))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some((mode, n)) = only(&args) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(run(&modes()[mode], n));
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let (n, rounds) = if quick { (2_000, 1) } else { (200_000, 5) };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let modes = modes();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    rt.block_on(async {
        for _ in 0..rounds {
            for (i, mode) in modes.iter().enumerate() {
                samples[i].push(run(mode, n).await);
            }
        }
    });
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let medians: Vec<f64> = samples.iter_mut().map(median).collect();
    let base = medians[modes.len() - 1];
    println!("in-process PUT, 64-byte body, {n} requests x {rounds} rounds (median)");
    println!("{:<30} {:>10} {:>14}", "mode", "ns/req", "vs unfenced");
    for (mode, ns) in modes.iter().zip(&medians) {
        println!("{:<30} {:>10.0} {:>+13.0}ns", mode.name, ns, ns - base);
    }
}
