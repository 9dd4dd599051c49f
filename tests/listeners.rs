//! The real binary's listeners: TLS with rustls (driven by curl, as a user
//! would), certificate reload on SIGHUP, and the separate admin listener.

mod support;

use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::proc::{serve_args, Proc, TempDir};

/// A self-signed certificate for 127.0.0.1 and localhost, written as PEM.
fn self_signed(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let pair =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, pair.cert.pem()).unwrap();
    std::fs::write(&key, pair.key_pair.serialize_pem()).unwrap();
    (cert, key)
}

/// curl's exit code and body (headers included with `-i`).
fn curl(args: &[&str]) -> (i32, String) {
    let out = Command::new(support::tools::program("curl"))
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .output()
        .expect("curl is installed (CI installs it)");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Status code and body of one curl exchange that must complete.
fn exchange(args: &[&str]) -> (u16, String) {
    let mut full = vec!["-o", "-", "-w", "\n%{http_code}"];
    full.extend_from_slice(args);
    let (code, out) = curl(&full);
    assert_eq!(code, 0, "curl {args:?} failed: {out}");
    let (body, status) = out.rsplit_once('\n').unwrap();
    (status.parse().unwrap(), body.to_owned())
}

fn tls_env<'a>(cert: &'a Path, key: &'a Path) -> Vec<(&'a str, &'a str)> {
    vec![
        ("FENCEGATE_TLS__CERT_FILE", cert.to_str().unwrap()),
        ("FENCEGATE_TLS__KEY_FILE", key.to_str().unwrap()),
    ]
}

#[test]
fn curl_acquires_and_writes_over_tls() {
    let dir = TempDir::new("tls");
    let (cert, key) = self_signed(dir.path(), "a");
    let log = dir.path().join("stderr.log");
    let p = Proc::start(
        &serve_args(&dir.path().join("data"), false),
        &log,
        &tls_env(&cert, &key),
    );
    assert!(p.url.starts_with("https://"), "{}", p.url);
    let ca = cert.to_str().unwrap();
    let (status, body) = exchange(&[
        "--cacert",
        ca,
        "-X",
        "POST",
        "-d",
        r#"{"holder":"a","ttl_ms":30000}"#,
        &format!("{}/_fence/leases/orders", p.url),
    ]);
    assert_eq!(status, 201, "{body}");
    let grant: Value = serde_json::from_str(&body).unwrap();
    let token = format!("Fencing-Token: {}", grant["token"]);
    let id = format!("Fencing-Lease-Id: {}", grant["lease_id"].as_str().unwrap());
    let url = format!("{}/kv/orders/1", p.url);
    let put = [
        "--cacert", ca, "-X", "PUT", "-H", &token, "-H", &id, "-d", "v1", &url,
    ];
    assert_eq!(exchange(&put).0, 201);
    assert_eq!(exchange(&["--cacert", ca, &url]), (200, "v1".to_owned()));

    // The certificate is really checked, and plain HTTP gets no answer.
    let (code, _) = curl(&[&url]);
    assert_eq!(code, 60, "curl without the CA must refuse the certificate");
    let (code, out) = curl(&[&url.replace("https://", "http://")]);
    assert_ne!(code, 0, "plain HTTP on the TLS port must fail, got {out}");
}

#[test]
fn sighup_reloads_the_certificate_and_a_bad_reload_keeps_it() {
    let dir = TempDir::new("tls-reload");
    let (cert, key) = self_signed(dir.path(), "live");
    let (next_cert, next_key) = self_signed(dir.path(), "next");
    let log = dir.path().join("stderr.log");
    let p = Proc::start(
        &serve_args(&dir.path().join("data"), false),
        &log,
        &tls_env(&cert, &key),
    );
    let livez = format!("{}/_fence/livez", p.url);
    let with_ca =
        |ca: &Path| curl(&["--cacert", ca.to_str().unwrap(), "-o", "/dev/null", &livez]).0;
    // A copy of the next certificate, since the live files are overwritten.
    let next_ca = dir.path().join("next-ca.crt");
    std::fs::copy(&next_cert, &next_ca).unwrap();
    assert_eq!(with_ca(&cert), 0);
    assert_eq!(
        with_ca(&next_ca),
        60,
        "the next certificate is not served yet"
    );

    std::fs::copy(&next_cert, &cert).unwrap();
    std::fs::copy(&next_key, &key).unwrap();
    p.signal("-HUP");
    // The signal is handled asynchronously: poll for its effect (bounded).
    let mut tries = 0;
    while with_ca(&next_ca) != 0 {
        tries += 1;
        assert!(tries < 200, "SIGHUP did not reload:\n{}", p.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }

    std::fs::write(&key, "not a key").unwrap();
    p.signal("-HUP");
    let mut tries = 0;
    while !p.log_text().contains("TLS reload failed") {
        tries += 1;
        assert!(tries < 200, "no reload error logged:\n{}", p.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        with_ca(&next_ca),
        0,
        "a failed reload keeps the pair in force"
    );
}

#[test]
fn bad_tls_settings_stop_the_start_with_a_message() {
    let dir = TempDir::new("tls-bad");
    let (cert, _) = self_signed(dir.path(), "a");
    let (_, other_key) = self_signed(dir.path(), "b");
    let log = dir.path().join("stderr.log");
    let args = serve_args(&dir.path().join("data"), false);
    let err = Proc::try_start(&args, &log, &tls_env(&cert, &other_key))
        .err()
        .expect("a key of another certificate must not start");
    assert!(err.contains("does not belong to the certificate"), "{err}");
    let err = Proc::try_start(
        &args,
        &log,
        &[("FENCEGATE_TLS__CERT_FILE", cert.to_str().unwrap())],
    )
    .err()
    .expect("a certificate without a key must not start");
    assert!(err.contains("set both cert_file and key_file"), "{err}");
    let missing = dir.path().join("missing.key");
    let err = Proc::try_start(&args, &log, &tls_env(&cert, &missing))
        .err()
        .expect("a missing key file must not start");
    assert!(err.contains("missing.key"), "{err}");
}

#[test]
fn a_silent_client_is_cut_off_during_the_handshake() {
    let dir = TempDir::new("tls-silent");
    let (cert, key) = self_signed(dir.path(), "a");
    let log = dir.path().join("stderr.log");
    let mut env = tls_env(&cert, &key);
    env.push(("FENCEGATE_LIMITS__HEADER_READ_TIMEOUT_MS", "300"));
    let p = Proc::start(&serve_args(&dir.path().join("data"), false), &log, &env);
    let addr = p.url.trim_start_matches("https://");
    let mut s = TcpStream::connect(addr).unwrap();
    // Real time by design: the handshake timeout is a wall-clock limit.
    // 10x the configured 300 ms before the test calls it a hang.
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = [0u8; 64];
    let n = s
        .read(&mut buf)
        .expect("the server closes, not the timeout");
    assert_eq!(n, 0, "EOF expected");
}

#[test]
fn the_admin_listener_serves_health_metrics_clock_and_the_status_page_only() {
    let dir = TempDir::new("admin");
    let log = dir.path().join("stderr.log");
    let mut p = Proc::start(
        &serve_args(&dir.path().join("data"), true),
        &log,
        &[("FENCEGATE_ADMIN__LISTEN", "127.0.0.1:0")],
    );
    let admin = p.next_url();
    assert!(admin.starts_with("http://") && admin != p.url, "{admin}");
    let main = p.url.clone();

    for path in [
        "/_fence/livez",
        "/_fence/readyz",
        "/_fence/metrics",
        "/_fence/clock",
        "/_fence/ui",
    ] {
        assert_eq!(
            exchange(&[&format!("{admin}{path}")]).0,
            200,
            "{path} on admin"
        );
    }
    let (status, text) = exchange(&[&format!("{admin}/_fence/metrics")]);
    assert_eq!(status, 200);
    assert!(text.contains("fencegate_leases_held"), "{text}");
    let advance = ["-X", "POST", "-d", r#"{"advance_ms":5}"#];
    let mut args = advance.to_vec();
    let clock = format!("{admin}/_fence/clock");
    args.push(&clock);
    assert_eq!(exchange(&args).0, 200);

    // The main listener keeps health and leases, and loses the admin endpoints.
    for path in ["/_fence/livez", "/_fence/readyz"] {
        assert_eq!(
            exchange(&[&format!("{main}{path}")]).0,
            200,
            "{path} on main"
        );
    }
    for path in ["/_fence/metrics", "/_fence/clock", "/_fence/ui"] {
        let (status, body) = exchange(&[&format!("{main}{path}")]);
        assert_eq!(status, 404, "{path} on main: {body}");
        assert!(body.contains("admin listener"), "{body}");
    }
    let acquire = ["-X", "POST", "-d", r#"{"holder":"a","ttl_ms":30000}"#];
    let mut args = acquire.to_vec();
    let lease = format!("{main}/_fence/leases/orders");
    args.push(&lease);
    assert_eq!(exchange(&args).0, 201);

    // The admin listener lists leases (its status page reads the listing),
    // but nothing is proxied or leased through it.
    let (status, body) = exchange(&[&format!("{admin}/_fence/leases")]);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"orders\""), "{body}");
    let lease_on_admin = format!("{admin}/_fence/leases/orders");
    let (status, body) = exchange(&[&lease_on_admin]);
    assert_eq!(status, 404, "{body}");
    let put = format!("{admin}/kv/orders/1");
    assert_eq!(exchange(&["-X", "PUT", "-d", "x", &put]).0, 404);
    assert_eq!(exchange(&[&format!("{main}/kv/orders/1")]).0, 404);

    // SIGTERM stops both listeners and exits 0.
    p.signal("-TERM");
    let status = p.child.wait().unwrap();
    assert!(status.success(), "{status}:\n{}", p.log_text());
    assert_ne!(curl(&[&format!("{admin}/_fence/livez")]).0, 0);
}

#[test]
fn the_client_commands_speak_tls_with_a_ca_file() {
    let dir = TempDir::new("tls-cli");
    let (cert, key) = self_signed(dir.path(), "a");
    let (other_ca, _) = self_signed(dir.path(), "other");
    let log = dir.path().join("stderr.log");
    let p = Proc::start(
        &serve_args(&dir.path().join("data"), false),
        &log,
        &tls_env(&cert, &key),
    );
    let fencegate = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(args)
            .env_remove("FENCEGATE_CACERT")
            .output()
            .unwrap()
    };
    let acquire = |ca: Option<&Path>| {
        let mut args = vec![
            "lease", "acquire", "orders", "--holder", "a", "--ttl", "30s", "--server", &p.url,
        ];
        if let Some(ca) = ca {
            args.extend(["--cacert", ca.to_str().unwrap()]);
        }
        fencegate(&args)
    };
    // Without the CA, or with another one, the certificate is refused: the
    // server counts as unreachable (exit 5), and no lease is taken.
    for ca in [None, Some(other_ca.as_path())] {
        let out = acquire(ca);
        assert_eq!(out.status.code(), Some(5), "{out:?}");
    }
    let out = acquire(Some(&cert));
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    // `fencegate run` holds another lease over TLS and releases it after.
    let out = fencegate(&[
        "run",
        "--server",
        &p.url,
        "--cacert",
        cert.to_str().unwrap(),
        "--lease",
        "jobs",
        "--holder",
        "r",
        "--ttl",
        "30s",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let (status, body) = exchange(&[
        "--cacert",
        cert.to_str().unwrap(),
        &format!("{}/_fence/leases/jobs", p.url),
    ]);
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (view["holder"].as_str(), view["state"].as_str()),
        (Some("r"), Some("released"))
    );

    // A CA file that is not PEM is a usage error.
    let out = acquire(Some(&log));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
