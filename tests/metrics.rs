//! `/_fence/metrics`: Prometheus text that `promtool check metrics` accepts,
//! with bounded labels and the counts the proxy's decisions imply.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};

use support::{Harness, Req};

#[tokio::test]
async fn metrics_pass_promtool_and_count_decisions() {
    let h = Harness::new();
    let a = h.acquire("orders", "A", 1000).await;
    assert_eq!(
        h.send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
            .await
            .status,
        201
    );
    assert_eq!(
        h.send(Req::new("PUT", "/kv/orders/1").body("x"))
            .await
            .status,
        428
    );
    assert_eq!(
        h.send(Req::new("POST", "/_fence/leases/orders/renew").held(&a))
            .await
            .status,
        200
    );
    h.advance(1000);
    assert_eq!(
        h.send(Req::new("PUT", "/kv/orders/1").held(&a).body("x"))
            .await
            .status,
        412
    );
    h.acquire("orders", "B", 1000).await;
    let r = h.send(Req::new("GET", "/_fence/metrics")).await;
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = r.text();
    for line in [
        "fencegate_writes_forwarded_total 1",
        "fencegate_writes_rejected_total{reason=\"missing-fencing-token\"} 1",
        "fencegate_writes_rejected_total{reason=\"lease-expired\"} 1",
        "fencegate_lease_operations_total{op=\"acquire\",outcome=\"ok\"} 2",
        "fencegate_lease_operations_total{op=\"renew\",outcome=\"ok\"} 1",
        "fencegate_leases_held 1",
        "fencegate_writes_in_flight 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    // No lease names, holders or ids as labels.
    assert!(!text.contains("orders") && !text.contains(&a.lease_id));

    let mut promtool = Command::new(support::tools::program("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every metric the README or the docs name exists under that name. Seen failing when
/// the README said `fencegate_barrier_wait_milliseconds_total` and the
/// binary exposed `fencegate_barrier_wait_seconds_total`.
#[tokio::test]
async fn every_metric_the_readme_names_is_exposed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    for doc in std::fs::read_dir(root.join("docs")).unwrap().flatten() {
        readme.push_str(&std::fs::read_to_string(doc.path()).unwrap());
    }
    let h = Harness::new();
    // A lease operation and a refused write, so labelled families have samples.
    h.acquire("orders", "A", 1000).await;
    h.send(Req::new("PUT", "/kv/orders/1").body("x")).await;
    let mut text = h.send(Req::new("GET", "/_fence/metrics")).await.text();
    // A cluster member's with several shards adds its own.
    text.push_str(&fencegate::metrics::Metrics::for_shards(Default::default()).render());
    // Family names (`# TYPE name kind`) and sample names.
    let exposed: Vec<&str> = text
        .lines()
        .filter_map(|line| match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if !line.starts_with('#') => line.split(['{', ' ']).next(),
            None => None,
        })
        .collect();
    // `name` or `name{labels}` in backticks.
    let named: Vec<&str> = readme
        .split('`')
        .map(|s| s.split('{').next().unwrap_or_default())
        .filter(|s| {
            s.starts_with("fencegate_") && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        })
        .collect();
    assert!(named.len() >= 8, "the README names only {named:?}");
    for name in named {
        assert!(
            exposed.contains(&name),
            "README names {name}, exposed: {exposed:?}"
        );
    }
}
