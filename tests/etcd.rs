//! The etcd client against a real etcd (its JSON gateway): keys,
//! transactions, leases, several endpoints, TLS with a private CA, and
//! etcd's user/password authentication; and a cluster member reaching etcd
//! over TLS and with a user and password.

mod support;

use fencegate::etcd::{Compare, EtcdClient, EtcdError, EtcdOptions, Op};
use support::proc::{Proc, TempDir};
use support::servers::{etcd_v3, free_port, Relay, TestCa};

fn client(urls: &[String], options: EtcdOptions) -> EtcdClient {
    EtcdClient::new(
        urls,
        &EtcdOptions {
            timeout_ms: 5000,
            ..options
        },
    )
    .unwrap()
}

#[tokio::test]
async fn keys_transactions_and_leases() {
    let etcd = etcd_v3(None).await;
    let c = client(std::slice::from_ref(&etcd.url), EtcdOptions::default());

    assert_eq!(c.get(b"/t/a").await.unwrap(), None);
    let rev = c.put(b"/t/a", b"one", 0).await.unwrap();
    c.put(b"/t/b", b"two", 0).await.unwrap();
    c.put(b"/u", b"elsewhere", 0).await.unwrap();
    let a = c.get(b"/t/a").await.unwrap().unwrap();
    assert_eq!((a.value.as_slice(), a.create_revision), (&b"one"[..], rev));
    let (under, at) = c.get_prefix(b"/t/").await.unwrap();
    let keys: Vec<&[u8]> = under.iter().map(|kv| kv.key.as_slice()).collect();
    assert_eq!(keys, [&b"/t/a"[..], b"/t/b"]);
    assert!(at > rev);

    // Create-if-absent: once, then the failure branch reads what is there.
    let create = |value: &'static [u8]| {
        let c = c.clone();
        async move {
            c.txn(
                &[Compare::CreateRevision(b"/t/primary".to_vec(), 0)],
                &[Op::Put {
                    key: b"/t/primary".to_vec(),
                    value: value.to_vec(),
                    lease: 0,
                }],
                &[Op::Get {
                    key: b"/t/primary".to_vec(),
                }],
            )
            .await
            .unwrap()
        }
    };
    let first = create(b"m1").await;
    assert!(first.succeeded);
    assert!(first.reads.is_empty());
    let second = create(b"m2").await;
    assert!(!second.succeeded);
    assert_eq!(second.reads[0][0].value, b"m1");
    // A comparison on the value and one on the mod revision.
    let held = c.get(b"/t/primary").await.unwrap().unwrap();
    let swapped = c
        .txn(
            &[
                Compare::Value(b"/t/primary".to_vec(), b"m1".to_vec()),
                Compare::ModRevision(b"/t/primary".to_vec(), held.mod_revision),
            ],
            &[Op::Delete {
                key: b"/t/primary".to_vec(),
            }],
            &[],
        )
        .await
        .unwrap();
    assert!(swapped.succeeded);
    assert_eq!(c.get(b"/t/primary").await.unwrap(), None);

    // A key attached to a lease lives as long as the lease.
    let (id, ttl) = c.grant(30).await.unwrap();
    assert_eq!(ttl, 30);
    c.put(b"/t/leased", b"x", id).await.unwrap();
    assert_eq!(c.get(b"/t/leased").await.unwrap().unwrap().lease, id);
    assert_eq!(c.keep_alive(id).await.unwrap(), Some(30));
    c.revoke(id).await.unwrap();
    assert_eq!(c.get(b"/t/leased").await.unwrap(), None);
    assert_eq!(c.keep_alive(id).await.unwrap(), None, "a revoked lease");
    c.revoke(id).await.unwrap();
    c.delete(b"/t/a").await.unwrap();
    assert_eq!(c.get(b"/t/a").await.unwrap(), None);
}

/// An endpoint that cannot be reached is skipped; with none reachable the
/// call is `Unavailable`, never `Refused`.
#[tokio::test]
async fn a_dead_endpoint_is_skipped() {
    let etcd = etcd_v3(None).await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let c = client(&[dead.clone(), etcd.url.clone()], EtcdOptions::default());
    c.put(b"k", b"v", 0).await.unwrap();
    assert_eq!(c.get(b"k").await.unwrap().unwrap().value, b"v");
    let only_dead = client(&[dead], EtcdOptions::default());
    assert!(matches!(
        only_dead.get(b"k").await,
        Err(EtcdError::Unavailable(_))
    ));
    drop(etcd);
    assert!(matches!(c.get(b"k").await, Err(EtcdError::Unavailable(_))));
}

/// A write that may have reached an endpoint that then went silent is not
/// sent again elsewhere (it could apply twice, or after a newer write): it
/// fails as unknown. A read goes on to the next endpoint.
#[tokio::test]
async fn an_unanswered_write_is_never_resent_elsewhere() {
    let etcd = etcd_v3(None).await;
    let silent = Relay::start(&etcd.url).await;
    silent.freeze();
    let options = EtcdOptions {
        timeout_ms: 500,
        ..EtcdOptions::default()
    };
    let c = EtcdClient::new(&[silent.url.clone(), etcd.url.clone()], &options).unwrap();
    let put = c.put(b"k", b"v", 0).await;
    assert!(
        matches!(&put, Err(EtcdError::Unavailable(e)) if e.contains("outcome is unknown")),
        "{put:?}"
    );
    let fresh = EtcdClient::new(&[silent.url.clone(), etcd.url.clone()], &options).unwrap();
    assert_eq!(fresh.get(b"k").await.unwrap(), None);
}

/// etcd over TLS with a private CA: trusted with `ca_file`, refused (never
/// a plain-text fallback) without it.
#[tokio::test]
async fn tls_with_a_private_ca() {
    let dir = TempDir::new("etcd-tls");
    let ca = TestCa::new(dir.path());
    let etcd = etcd_v3(Some(&ca)).await;
    assert!(etcd.url.starts_with("https://"));
    let trusted = client(
        std::slice::from_ref(&etcd.url),
        EtcdOptions {
            ca_file: Some(ca.ca.clone()),
            ..EtcdOptions::default()
        },
    );
    trusted.put(b"k", b"v", 0).await.unwrap();
    assert_eq!(trusted.get(b"k").await.unwrap().unwrap().value, b"v");
    let untrusted = client(std::slice::from_ref(&etcd.url), EtcdOptions::default());
    match untrusted.get(b"k").await {
        Err(EtcdError::Unavailable(e)) => assert!(e.contains("certificate"), "{e}"),
        other => panic!("expected a certificate error, got {other:?}"),
    }
    // A CA file is for https:// endpoints only.
    let err = EtcdClient::new(
        &["http://127.0.0.1:2379".to_owned()],
        &EtcdOptions {
            ca_file: Some(ca.ca.clone()),
            ..EtcdOptions::default()
        },
    )
    .unwrap_err();
    assert!(err.contains("https"), "{err}");
}

/// etcd's authentication: a user with a role on a prefix gets in, reads
/// and writes there, and nowhere else; a wrong password and no user are
/// refused.
#[tokio::test]
async fn user_and_password() {
    let etcd = etcd_v3(None).await;
    let admin = client(std::slice::from_ref(&etcd.url), EtcdOptions::default());
    enable_auth(&etcd.url, "/fg/").await;
    let as_user = |user: Option<(&str, &str)>| {
        client(
            std::slice::from_ref(&etcd.url),
            EtcdOptions {
                user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
                ..EtcdOptions::default()
            },
        )
    };
    let fg = as_user(Some(("fg", "fg-secret")));
    fg.put(b"/fg/k", b"v", 0).await.unwrap();
    assert_eq!(fg.get(b"/fg/k").await.unwrap().unwrap().value, b"v");
    let (id, _) = fg.grant(10).await.unwrap();
    fg.put(b"/fg/leased", b"x", id).await.unwrap();
    assert!(matches!(
        fg.put(b"/other", b"v", 0).await,
        Err(EtcdError::Refused(e)) if e.contains("permission denied")
    ));
    assert!(matches!(
        as_user(Some(("fg", "wrong"))).get(b"/fg/k").await,
        Err(EtcdError::Refused(_))
    ));
    assert!(matches!(
        admin.get(b"/fg/k").await,
        Err(EtcdError::Refused(_))
    ));
}

/// Turns on etcd's authentication through the gateway: a root user, and a
/// user `fg` (password `fg-secret`) with read and write on `prefix`.
async fn enable_auth(url: &str, prefix: &str) {
    use base64::Engine;
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let http = support::HttpClient::new(url);
    for (path, body) in [
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"root-secret"}"#.to_owned(),
        ),
        ("/v3/auth/role/add", r#"{"name":"root"}"#.to_owned()),
        (
            "/v3/auth/user/grant",
            r#"{"user":"root","role":"root"}"#.to_owned(),
        ),
        ("/v3/auth/role/add", r#"{"name":"fg"}"#.to_owned()),
        (
            "/v3/auth/role/grant",
            format!(
                r#"{{"name":"fg","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                b64(prefix.as_bytes()),
                b64(&end)
            ),
        ),
        (
            "/v3/auth/user/add",
            r#"{"name":"fg","password":"fg-secret"}"#.to_owned(),
        ),
        (
            "/v3/auth/user/grant",
            r#"{"user":"fg","role":"fg"}"#.to_owned(),
        ),
        ("/v3/auth/enable", "{}".to_owned()),
    ] {
        let r = http.send(support::Req::new("POST", path).body(body)).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
}

/// Starts a cluster member reaching etcd at `etcd` with these
/// `FENCEGATE_CLUSTER__*` settings (its upstream is never called: these
/// tests only acquire).
fn member(dir: &TempDir, etcd: &str, env: &[(&str, &str)]) -> Proc {
    let upstream = format!("http://127.0.0.1:{}", free_port());
    Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--etcd",
            etcd,
            "--name",
            "m",
        ],
        &dir.path().join("member.log"),
        env,
    )
}

/// Whether the member becomes primary within `ms` (bounded, real time: a
/// campaign through etcd) and then grants a lease.
async fn serves(member: &Proc, ms: u64) -> bool {
    let c = support::HttpClient::new(&member.url);
    for _ in 0..ms / 50 {
        let view = c
            .send(support::Req::new("GET", "/_fence/cluster"))
            .await
            .json();
        if view["role"] == "primary" {
            let r = c
                .send(
                    support::Req::new("POST", "/_fence/leases/x")
                        .json(serde_json::json!({"holder": "a", "ttl_ms": 5000})),
                )
                .await;
            assert_eq!(r.status, 201, "{}", r.text());
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// A member trusts a private CA with `cluster.ca_file`; without it, it
/// never reaches etcd, so it never serves (and never falls back to plain
/// text).
#[tokio::test]
async fn a_member_reaches_etcd_over_tls_with_its_ca_file() {
    let dir = TempDir::new("member-tls");
    let ca = TestCa::new(dir.path());
    let etcd = etcd_v3(Some(&ca)).await;
    let ca_file = ca.ca.to_string_lossy().into_owned();
    let trusting = member(&dir, &etcd.url, &[("FENCEGATE_CLUSTER__CA_FILE", &ca_file)]);
    assert!(serves(&trusting, 20_000).await, "{}", trusting.log_text());
    drop(trusting);
    let untrusting = member(&dir, &etcd.url, &[("FENCEGATE_CLUSTER__PREFIX", "/other/")]);
    assert!(!serves(&untrusting, 3_000).await);
    assert!(
        untrusting.log_text().contains("certificate"),
        "{}",
        untrusting.log_text()
    );
}

/// A member authenticates to etcd with `cluster.user` and
/// `cluster.password`; with a wrong password it never serves.
#[tokio::test]
async fn a_member_authenticates_to_etcd() {
    let dir = TempDir::new("member-auth");
    let etcd = etcd_v3(None).await;
    enable_auth(&etcd.url, "/fg/").await;
    let env = |password| {
        [
            ("FENCEGATE_CLUSTER__PREFIX", "/fg/"),
            ("FENCEGATE_CLUSTER__USER", "fg"),
            ("FENCEGATE_CLUSTER__PASSWORD", password),
        ]
    };
    let wrong = member(&dir, &etcd.url, &env("wrong-x9q"));
    assert!(!serves(&wrong, 3_000).await);
    let log = wrong.log_text();
    assert!(log.contains("cluster session ended"), "{log}");
    assert!(
        !log.contains("wrong-x9q"),
        "the password is in the log: {log}"
    );
    drop(wrong);
    let right = member(&dir, &etcd.url, &env("fg-secret"));
    assert!(serves(&right, 20_000).await, "{}", right.log_text());
}
