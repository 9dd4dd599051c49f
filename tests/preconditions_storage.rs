//! Storage-side preconditions (SPEC §10) in front of real storage of two
//! APIs, started by the test on loopback: moto's S3 server (its PutObject
//! and DeleteObject evaluate `If-Match` and `If-None-Match`) and Azurite,
//! Microsoft's Azure Blob emulator (entity tags that change on every
//! write, SAS-signed requests).
//!
//! Between fencegate and the storage runs the load tester's relay
//! (`fencegate::cli::loadtest::relay`): it holds a write of writer A,
//! closes fencegate's connection unanswered (an unknown outcome: fencegate
//! holds the next term back for `settle_ms`), and delivers the write only
//! after writer B, the next holder, has written the same key. With the
//! route's preconditions on, the storage refuses A's late write and B's
//! bytes stay; with them off, A's stale bytes land over B's (or A's late
//! DELETE removes B's object): the same test, seen failing.

mod support;

use std::sync::Arc;

use base64::Engine as _;
use fencegate::backend::{Backend, EmbeddedStore, Upstream};
use fencegate::cli::loadtest::relay::{Hold, Relay};
use fencegate::cli::loadtest::sigv4::S3Signer;
use fencegate::client::http_client;
use fencegate::clock::ClockKind;
use fencegate::config::{Config, RouteConfig};
use fencegate::route::Preconditions;
use hmac::Mac;
use support::servers::{azurite, moto, Server, AZURITE_ACCOUNT};
use support::{spawn, Harness, Held, HttpClient, Req, Resp};

/// One storage API: where the key lives, and how a request to it is made.
struct Storage {
    server: Server,
    /// The route pattern guarding the keys.
    pattern: &'static str,
    /// The key the writers share.
    key: String,
    /// Added to every request's path (a SAS token for Azurite).
    query: String,
    /// Headers every write carries.
    write_headers: Vec<(&'static str, &'static str)>,
    /// Signs S3 requests (moto takes conditional writes only signed).
    signer: Option<S3Signer>,
}

impl Storage {
    /// A request of `method` to `path` with `body`, as this storage takes it.
    fn req(&self, method: &str, path: &str, body: &str) -> Req {
        let path = format!("{path}{}", self.query);
        let mut r = Req::new(method, &path)
            .header("x-ms-version", "2021-08-06")
            .body(body.to_owned());
        if method != "GET" && method != "HEAD" {
            for (k, v) in &self.write_headers {
                r = r.header(k, v);
            }
        }
        if let Some(signer) = &self.signer {
            let unix_s = fencegate::clock::unix_now_ms() / 1000;
            let signed = signer.sign(method, "127.0.0.1", &path, body.as_bytes(), unix_s);
            r = r
                .header("host", "127.0.0.1")
                .header("authorization", &signed.authorization)
                .header("x-amz-date", &signed.amz_date)
                .header("x-amz-content-sha256", &signed.content_sha256);
        }
        r
    }
}

async fn s3() -> Storage {
    let server = moto().await;
    let s = Storage {
        server,
        pattern: "/orders-bucket/{lease}",
        key: "/orders-bucket/orders/42".into(),
        query: String::new(),
        write_headers: vec![],
        signer: Some(S3Signer::new("testing", "testing", "us-east-1")),
    };
    let direct = HttpClient::new(&s.server.url);
    let r = direct.send(s.req("PUT", "/orders-bucket", "")).await;
    assert_eq!(r.status, 200, "create the bucket: {}", r.text());
    s
}

/// An account SAS for Azurite's well-known account: every service, every
/// permission, until 2030 (query string form, with its leading `?`).
fn account_sas() -> String {
    let (account, key) = AZURITE_ACCOUNT;
    let key = base64::engine::general_purpose::STANDARD
        .decode(key)
        .unwrap();
    let (sv, sp, ss, srt, se, spr) = (
        "2021-08-06",
        "racwdl",
        "b",
        "sco",
        "2030-01-01T00:00:00Z",
        "http,https",
    );
    let to_sign = format!("{account}\n{sp}\n{ss}\n{srt}\n\n{se}\n\n{spr}\n{sv}\n\n");
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(to_sign.as_bytes());
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    let enc = |v: &str| {
        percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    format!(
        "?sv={sv}&ss={ss}&srt={srt}&sp={sp}&se={}&spr={}&sig={}",
        enc(se),
        enc(spr),
        enc(&sig)
    )
}

async fn azure() -> Storage {
    let server = azurite().await;
    let sas = account_sas();
    let direct = HttpClient::new(&server.url);
    let r = direct
        .send(
            Req::new(
                "PUT",
                &format!("/devstoreaccount1/orders-container{sas}&restype=container"),
            )
            .header("x-ms-version", "2021-08-06"),
        )
        .await;
    assert_eq!(r.status, 201, "create the container: {}", r.text());
    Storage {
        server,
        pattern: "/devstoreaccount1/orders-container/{lease}",
        key: "/devstoreaccount1/orders-container/orders/42".into(),
        query: sas,
        write_headers: vec![("x-ms-blob-type", "BlockBlob")],
        signer: None,
    }
}

/// fencegate (manual clock) in front of a relay in front of `storage`.
async fn stack(storage: &Storage, preconditions: Preconditions) -> (Harness, Relay, HttpClient) {
    let client = http_client(&storage.server.url, None).unwrap();
    let hold = Arc::new(|parts: &http::request::Parts| {
        if parts.headers.contains_key("x-test-hold") {
            Hold::UntilReleased
        } else {
            Hold::Pass
        }
    });
    let relay = Relay::start(
        "127.0.0.1:0".parse().unwrap(),
        &storage.server.url,
        client,
        hold,
    )
    .await
    .unwrap();
    let url = format!("http://{}", relay.addr());
    let mut config = Config {
        clock: ClockKind::Manual,
        upstream: url.clone(),
        ..Config::default()
    };
    config.fence.routes = vec![RouteConfig {
        pattern: storage.pattern.into(),
        lease: None,
        fence_reads: false,
        timeout_ms: None,
        upstream_prefix: None,
        preconditions,
    }];
    let up = Upstream::new(&url.parse().unwrap(), &config.upstream_options()).unwrap();
    let h = Harness::with_backend(config, Backend::Upstream(up), EmbeddedStore::new());
    let fg = spawn(h.app.clone()).await;
    let c = HttpClient::new(&fg.url());
    // The server lives as long as the app's clones do.
    std::mem::forget(fg);
    (h, relay, c)
}

/// A write through fencegate under `held`; on `428 precondition-required`
/// the key is read once and the write sent again, as the clients do.
async fn write(s: &Storage, c: &HttpClient, method: &str, held: &Held, body: &str) -> Resp {
    let send = || s.req(method, &s.key, body).held(held);
    let r = c.send(send()).await;
    if r.status != 428 {
        return r;
    }
    assert_eq!(r.reason(), "precondition-required");
    let read = c.send(s.req("HEAD", &s.key, "")).await;
    assert!(
        read.status == 200 || read.status == 404,
        "the read: {read:?}"
    );
    c.send(send()).await
}

/// What the key holds at the storage, read straight from it.
async fn stored(s: &Storage) -> Option<String> {
    let r = HttpClient::new(&s.server.url)
        .send(s.req("GET", &s.key, ""))
        .await;
    match r.status.as_u16() {
        200 => Some(r.text()),
        404 => None,
        other => panic!("reading the key back: {other} {}", r.text()),
    }
}

/// A writes, then sends `late` (PUT or DELETE), which the relay holds; A's
/// term ends and its unknown write settles; B writes; A's write arrives.
/// What the storage answered it, and what the key holds at the end.
async fn late_write(
    s: &Storage,
    preconditions: Preconditions,
    late: &str,
) -> (u16, Option<String>) {
    let (h, relay, c) = stack(s, preconditions).await;
    let a = h.acquire("orders", "A", 1_000).await;
    let r = write(s, &c, "PUT", &a, "a-1").await;
    assert!(r.status.is_success(), "A's write: {r:?}");
    let body = if late == "PUT" { "a-2-late" } else { "" };
    let held = c
        .send(
            s.req(late, &s.key, body)
                .held(&a)
                .header("x-test-hold", "1"),
        )
        .await;
    assert_eq!(held.status, 502, "the held write: {}", held.text());
    h.advance(1_000 + 1_000);
    let b = h.acquire("orders", "B", 1_000).await;
    let r = write(s, &c, "PUT", &b, "b-1").await;
    assert!(r.status.is_success(), "B's write: {r:?}");
    assert_eq!(stored(s).await.as_deref(), Some("b-1"));
    let delivered = relay.release().await;
    assert_eq!(delivered.len(), 1, "{delivered:?}");
    assert_eq!(delivered[0].token, Some(a.token));
    assert!(delivered[0].stale, "B's write was not seen applied first");
    (delivered[0].status, stored(s).await)
}

/// The storage's refusal of a stale write: 412 (S3 and Azure both, for a
/// false If-Match).
fn refused(status: u16) -> bool {
    status == 412
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_refuses_late_writes_of_an_old_term() {
    let s = s3().await;
    let (status, kept) = late_write(&s, Preconditions::Etag, "PUT").await;
    assert!(refused(status), "the late PUT: {status}");
    assert_eq!(kept.as_deref(), Some("b-1"));
    let (status, kept) = late_write(&s, Preconditions::Etag, "DELETE").await;
    assert!(refused(status), "the late DELETE: {status}");
    assert_eq!(kept.as_deref(), Some("b-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_preconditions_late_writes_land_in_moto() {
    let s = s3().await;
    let (status, kept) = late_write(&s, Preconditions::Off, "PUT").await;
    assert_eq!(status, 200);
    assert_eq!(
        kept.as_deref(),
        Some("a-2-late"),
        "the stale PUT did not land"
    );
    let (status, kept) = late_write(&s, Preconditions::Off, "DELETE").await;
    assert_eq!(status, 204);
    assert_eq!(kept, None, "the stale DELETE did not land");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azurite_refuses_late_writes_of_an_old_term() {
    let s = azure().await;
    let (status, kept) = late_write(&s, Preconditions::Etag, "PUT").await;
    assert!(refused(status), "the late PUT: {status}");
    assert_eq!(kept.as_deref(), Some("b-1"));
    let (status, kept) = late_write(&s, Preconditions::Etag, "DELETE").await;
    assert!(refused(status), "the late DELETE: {status}");
    assert_eq!(kept.as_deref(), Some("b-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_preconditions_late_writes_land_in_azurite() {
    let s = azure().await;
    let (status, kept) = late_write(&s, Preconditions::Off, "PUT").await;
    assert_eq!(status, 201);
    assert_eq!(
        kept.as_deref(),
        Some("a-2-late"),
        "the stale PUT did not land"
    );
    let (status, kept) = late_write(&s, Preconditions::Off, "DELETE").await;
    assert_eq!(status, 202);
    assert_eq!(kept, None, "the stale DELETE did not land");
}

/// What moto does with the writes S3 evaluates preconditions on but moto
/// 5.2 does not (measured, so the docs can say it): a CompleteMultipartUpload
/// and a CopyObject whose If-Match is false are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_ignores_preconditions_on_complete_and_copy() {
    let s = s3().await;
    let direct = HttpClient::new(&s.server.url);
    let key = "/orders-bucket/orders/7";
    let r = direct.send(s.req("PUT", key, "v1")).await;
    assert_eq!(r.status, 200);
    let r = direct
        .send(s.req("PUT", key, "v2").header("if-match", "\"nope\""))
        .await;
    assert_eq!(r.status, 412, "PutObject evaluates If-Match");
    let r = direct
        .send(
            s.req("PUT", key, "")
                .header("x-amz-copy-source", "/orders-bucket/orders/7")
                .header("x-amz-metadata-directive", "REPLACE")
                .header("if-match", "\"nope\""),
        )
        .await;
    assert_eq!(
        r.status,
        200,
        "CopyObject with a false If-Match: {}",
        r.text()
    );
    let r = direct
        .send(s.req("POST", &format!("{key}?uploads"), ""))
        .await;
    let text = r.text();
    let upload = text
        .split("<UploadId>")
        .nth(1)
        .and_then(|t| t.split("</UploadId>").next())
        .expect("an upload id");
    let r = direct
        .send(s.req(
            "PUT",
            &format!("{key}?partNumber=1&uploadId={upload}"),
            "part",
        ))
        .await;
    assert_eq!(r.status, 200);
    let part = r.headers["etag"].to_str().unwrap().to_owned();
    let complete = format!(
        "<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>{part}</ETag></Part></CompleteMultipartUpload>"
    );
    let r = direct
        .send(
            s.req("POST", &format!("{key}?uploadId={upload}"), &complete)
                .header("if-match", "\"nope\""),
        )
        .await;
    assert_eq!(
        r.status,
        200,
        "CompleteMultipartUpload with a false If-Match: {}",
        r.text()
    );
    let r = direct.send(s.req("GET", key, "")).await;
    assert_eq!(r.text(), "part", "moto 5.2 applied it");
}

/// Azure's Shared Key signature over a request to Azurite's account
/// (`path` is the URL's, with the account first; `query` its parameters;
/// `headers` every header the request will carry, names lower case).
fn shared_key(method: &str, path: &str, headers: &[(&str, &str)], length: usize) -> String {
    let (account, key) = AZURITE_ACCOUNT;
    let key = base64::engine::general_purpose::STANDARD
        .decode(key)
        .unwrap();
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| *k == name)
            .map_or("", |(_, v)| *v)
    };
    let mut ms: Vec<_> = headers
        .iter()
        .filter(|(k, _)| k.starts_with("x-ms-"))
        .collect();
    ms.sort();
    let canonical_headers: String = ms.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let length = if length == 0 {
        String::new()
    } else {
        length.to_string()
    };
    let to_sign = format!(
        "{method}\n\n\n{length}\n\n{}\n\n\n{}\n{}\n\n\n{canonical_headers}/{account}{path}",
        get("content-type"),
        get("if-match"),
        get("if-none-match"),
    );
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(to_sign.as_bytes());
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!("SharedKey {account}:{sig}")
}

/// A Put Blob of `body` to `path`, signed with Shared Key over `headers`
/// (and the standard ones); `after`: headers added once it is signed.
fn signed_put(path: &str, body: &str, headers: &[(&str, &str)], after: &[(&str, &str)]) -> Req {
    let date = httpdate_now();
    let mut all = vec![
        ("x-ms-version", "2021-08-06"),
        ("x-ms-blob-type", "BlockBlob"),
        ("x-ms-date", date.as_str()),
    ];
    all.extend_from_slice(headers);
    let auth = shared_key("PUT", path, &all, body.len());
    let mut r = Req::new("PUT", path)
        .header("authorization", &auth)
        .body(body.to_owned());
    for (k, v) in all.iter().chain(after) {
        r = r.header(k, v);
    }
    r
}

/// The time now as an HTTP date (`x-ms-date`).
fn httpdate_now() -> String {
    let out = std::process::Command::new("date")
        .args(["-u", "+%a, %d %b %Y %H:%M:%S GMT"])
        .env("LC_ALL", "C")
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// A request signed with Azure's Shared Key signs If-Match: a precondition
/// added after signing breaks the signature (Azurite answers 403).
/// fencegate adds none to such a request: it answers 428 and names the
/// one to send, which, signed by the client, goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_key_requests_send_their_own_precondition() {
    let s = azure().await;
    let direct = HttpClient::new(&s.server.url);
    let key = s.key.as_str();
    let r = direct.send(signed_put(key, "v0", &[], &[])).await;
    assert_eq!(r.status, 201, "a signed Put Blob: {}", r.text());
    let tag = r.headers["etag"].to_str().unwrap().to_owned();
    let r = direct
        .send(signed_put(key, "v1", &[], &[("if-match", tag.as_str())]))
        .await;
    assert_eq!(r.status, 403, "If-Match added after signing: {}", r.text());

    let (h, _relay, c) = stack(&s, Preconditions::Etag).await;
    let a = h.acquire("orders", "A", 60_000).await;
    let r = c.send(s.req("HEAD", key, "")).await;
    assert_eq!(r.status, 200);
    let fenced =
        |body: &str, headers: &[(&str, &str)]| signed_put(key, body, headers, &[]).held(&a);
    let r = c.send(fenced("v1", &[])).await;
    assert_eq!(r.reason(), "precondition-required");
    assert_eq!(r.json()["if_match"], tag.as_str());
    let r = c.send(fenced("v1", &[("if-match", tag.as_str())])).await;
    assert_eq!(r.status, 201, "the client's own, signed: {}", r.text());
    assert_eq!(stored(&s).await.as_deref(), Some("v1"));
}
