//! What routes with preconditions (SPEC §10) cost in memory and
//! allocations: the key states table (`fencegate::precondition`) filled
//! with keys shaped like S3's (`/orders-bucket/orders/00000042`, 30 bytes)
//! and entity tags like S3's (a quoted MD5, 34 bytes), counted by a global
//! allocator that tallies what is live.
//!
//!     cargo bench --bench key_states             # 100,000 keys
//!     cargo bench --bench key_states -- --quick  # 10,000 keys
//!
//! Prints the bytes the table holds per remembered key, and the
//! allocations a write costs once its key is known: planning its
//! precondition (none: the remembered tag is handed over by reference
//! count) and learning the tag its answer carries (two: the tag's bytes and
//! their reference count). Counts, not times: they are the same on any
//! machine.

#![allow(clippy::disallowed_methods)]
// a benchmark may read what it likes
// A counting allocator is a `GlobalAlloc`, whose methods are unsafe.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use fencegate::precondition::{Dialect, KeyStateTable, Plan};
use http::{Request, Response};

/// The system allocator, counting live bytes and allocations made.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's layout goes to the system allocator as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as `GlobalAlloc::realloc` requires of its caller.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn key(i: usize) -> String {
    format!("/orders-bucket/orders/{i:08}")
}

/// A quoted 32-digit hex tag, different for each `(i, version)`.
fn etag(i: usize, version: u64) -> String {
    format!("\"{:016x}{:016x}\"", i as u64, version)
}

fn put(path: &str) -> Request<fencegate::body::Body> {
    Request::put(path)
        .body(fencegate::body::empty())
        .expect("request")
}

fn answer(tag: &str) -> Response<fencegate::body::Body> {
    Response::builder()
        .header("etag", tag)
        .body(fencegate::body::empty())
        .expect("response")
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let keys = if quick { 10_000 } else { 100_000 };
    let requests: Vec<_> = (0..keys).map(|i| put(&key(i))).collect();
    let mut answers: Vec<_> = (0..keys).map(|i| Some(answer(&etag(i, 1)))).collect();
    // Room for all of them: keys only read take half the table, and a full
    // generation of a part is dropped whole.
    let table = std::sync::Arc::new(KeyStateTable::new(4 * keys));

    // The relayed answers stay alive, so that only the table's bytes count.
    let mut relayed = Vec::with_capacity(keys);
    let before = LIVE.load(Ordering::Relaxed);
    for (i, req) in requests.iter().enumerate() {
        let get = Request::get(req.uri().clone()).body(()).expect("request");
        let read = table.read(&key(i), &get);
        let observed = fencegate::precondition::Observed {
            table: table.clone(),
            key: fencegate::precondition::Key::of(req.uri().path()),
            exchange: read,
        };
        relayed.push(observed.learn(answers[i].take().expect("an answer")));
    }
    let held = LIVE.load(Ordering::Relaxed) - before;
    assert_eq!(table.len(), keys, "every key is remembered");

    // A write of a known key: its plan, then the tag its answer carries.
    // (The key's first write moves it from the readers' half of the table
    // to the writers': the next one is measured.)
    let i = keys / 2;
    let path = key(i);
    let (_, exchange) = table.plan(&path, &requests[i], Dialect::S3);
    let first = fencegate::precondition::Observed {
        table: table.clone(),
        key: fencegate::precondition::Key::of(&path),
        exchange,
    };
    drop(first.learn(answer(&etag(i, 2))));
    let next = answer(&etag(i, 3));
    let allocations = || ALLOCATIONS.load(Ordering::Relaxed);
    let a0 = allocations();
    let (plan, exchange) = table.plan(&path, &requests[i], Dialect::S3);
    let planned = allocations() - a0;
    assert!(matches!(plan, Plan::IfMatch(_)), "{plan:?}");
    let observed = fencegate::precondition::Observed {
        table: table.clone(),
        key: fencegate::precondition::Key::of(&path),
        exchange,
    };
    let a1 = allocations();
    let relayed = observed.learn(next);
    let learned = allocations() - a1;
    drop(relayed);

    println!("key states of {keys} keys (30-byte S3 paths, 34-byte quoted MD5 tags)");
    println!(
        "  held               {:.1} MiB, {} bytes per key",
        held as f64 / (1 << 20) as f64,
        held / keys as i64
    );
    println!("  a write's plan     {planned} allocations");
    println!("  learning its tag   {learned} allocations (the tag and its reference count)");
}
