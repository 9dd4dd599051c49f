//! A small etcd v3 client over etcd's JSON gateway (`/v3/…`, etcd 3.4 and
//! later), on the hyper client already in the tree: no gRPC, no `protoc`.
//!
//! It speaks the few calls cluster mode needs: ranges, puts, deletes,
//! transactions (compare on a key's create or mod revision, or its value),
//! and leases (grant, one keep-alive, revoke). Keys and values are bytes
//! (base64 in the JSON); 64-bit numbers travel as JSON strings, as the
//! gateway writes them.
//!
//! Several endpoints may be given: a call goes to the one that answered last
//! and moves on to the next when an endpoint cannot be reached or answers
//! that it is unavailable (no leader, stopping), so one etcd member down
//! does not stop the client. TLS (system roots plus a CA file) and etcd's
//! user/password authentication are supported; an expired auth token is
//! renewed once per call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};

use crate::error::cause;

/// Longest answer read from etcd: a range of every lease record of a large
/// store fits well within it.
const MAX_ANSWER_BYTES: usize = 256 * 1024 * 1024;

/// How to reach etcd.
#[derive(Clone, Debug, Default)]
pub struct EtcdOptions {
    /// PEM CA certificates trusted beside the system's, for `https://`
    /// endpoints with a private CA.
    pub ca_file: Option<std::path::PathBuf>,
    /// etcd user and password, when etcd's authentication is on.
    pub user: Option<(String, String)>,
    /// Longest wait for one call's answer from one endpoint.
    pub timeout_ms: u64,
}

/// Why a call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdError {
    /// No endpoint could answer (unreachable, timed out, no leader): the
    /// outcome of a write is unknown.
    Unavailable(String),
    /// etcd answered and refused the call (bad request, permission denied).
    Refused(String),
}

/// Why an etcd client could not be set up from `cluster.etcd` and
/// `cluster.ca_file`.
#[derive(Debug)]
pub enum SetupError {
    /// No endpoint at all.
    NoEndpoint,
    /// An endpoint that is not an `http://` or `https://` URL with a host.
    BadEndpoint { url: String, why: &'static str },
    /// A CA file, but no `https://` endpoint to use it for.
    CaWithoutHttps,
    /// The CA file is unusable.
    Tls(crate::tls::TlsError),
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetupError::NoEndpoint => f.write_str("cluster.etcd: no endpoint"),
            SetupError::BadEndpoint { url, why } => write!(f, "cluster.etcd: {url:?} {why}"),
            SetupError::CaWithoutHttps => {
                f.write_str("cluster.ca_file is set, but no etcd endpoint is https://")
            }
            SetupError::Tls(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SetupError {}

impl std::fmt::Display for EtcdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EtcdError::Unavailable(e) => write!(f, "etcd unavailable: {e}"),
            EtcdError::Refused(e) => write!(f, "etcd refused: {e}"),
        }
    }
}

impl std::error::Error for EtcdError {}

/// A key-value pair as etcd stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The revision that created the key.
    pub create_revision: i64,
    /// The revision of the key's last change.
    pub mod_revision: i64,
    /// The etcd lease the key is attached to (0: none).
    pub lease: i64,
}

/// What a transaction compares.
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key's create revision equals this (0: the key does not exist).
    CreateRevision(Vec<u8>, i64),
    /// The key's mod revision equals this (0: the key does not exist).
    ModRevision(Vec<u8>, i64),
    /// The key's value equals this.
    Value(Vec<u8>, Vec<u8>),
}

/// One operation of a transaction.
#[derive(Clone, Debug)]
pub enum Op {
    /// Writes `value` at `key`, attached to etcd lease `lease` (0: none).
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
    },
    /// Deletes `key`.
    Delete { key: Vec<u8> },
    /// Deletes every key from `key` (included) to `end` (excluded).
    DeleteRange { key: Vec<u8>, end: Vec<u8> },
    /// Reads `key`.
    Get { key: Vec<u8> },
}

/// A transaction's result.
#[derive(Clone, Debug, Default)]
pub struct TxnResult {
    /// Whether every comparison held (the success branch ran).
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: i64,
    /// What the `Get`s of the branch that ran read, in order.
    pub reads: Vec<Vec<KeyValue>>,
}

/// An etcd client; cheap to clone.
#[derive(Clone)]
pub struct EtcdClient {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: Vec<String>,
    /// The endpoint that answered last.
    current: AtomicUsize,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
    user: Option<(String, String)>,
    /// The auth token, once authenticated.
    token: Mutex<Option<String>>,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClient")
            .field("endpoints", &self.inner.endpoints)
            .finish()
    }
}

impl EtcdClient {
    /// A client of the etcd cluster at `endpoints` (`http://` or `https://`
    /// URLs of its members).
    pub fn new(endpoints: &[String], options: &EtcdOptions) -> Result<Self, SetupError> {
        if endpoints.is_empty() {
            return Err(SetupError::NoEndpoint);
        }
        let mut https = false;
        let mut clean = Vec::with_capacity(endpoints.len());
        for url in endpoints {
            let bad = |why| SetupError::BadEndpoint {
                url: url.clone(),
                why,
            };
            let uri: http::Uri = url.parse().map_err(|_| bad("is not a URL"))?;
            match uri.scheme_str() {
                Some("https") => https = true,
                Some("http") => {}
                _ => return Err(bad("must be an http:// or https:// URL")),
            }
            if uri.authority().is_none() {
                return Err(bad("has no host"));
            }
            clean.push(url.trim_end_matches('/').to_owned());
        }
        if options.ca_file.is_some() && !https {
            return Err(SetupError::CaWithoutHttps);
        }
        let tls = crate::tls::client_config(options.ca_file.as_deref(), "cluster.ca_file")
            .map_err(SetupError::Tls)?;
        let mut config = tokio_rustls::rustls::ClientConfig::clone(&tls);
        // The builder sets ALPN itself (and refuses a config that has it).
        config.alpn_protocols.clear();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        connector.set_connect_timeout(Some(Duration::from_millis(options.timeout_ms.max(1))));
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let client = Client::builder(crate::rt::ClientExecutor::here())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Ok(Self {
            inner: Arc::new(Inner {
                endpoints: clean,
                current: AtomicUsize::new(0),
                client,
                timeout: Duration::from_millis(options.timeout_ms.max(1)),
                user: options.user.clone(),
                token: Mutex::new(None),
            }),
        })
    }

    /// The values under `key` exactly.
    pub async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, EtcdError> {
        let answer = self
            .call("/v3/kv/range", json!({ "key": B64.encode(key) }))
            .await?;
        Ok(kvs(&answer)?.into_iter().next())
    }

    /// Every key starting with `prefix`, and the store's revision they were
    /// read at.
    pub async fn get_prefix(&self, prefix: &[u8]) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        let answer = self
            .call(
                "/v3/kv/range",
                json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) }),
            )
            .await?;
        Ok((kvs(&answer)?, revision(&answer)))
    }

    /// Up to `limit` keys from `key` (included) to `end` (excluded), in
    /// key order, and whether more follow.
    pub async fn get_range(
        &self,
        key: &[u8],
        end: &[u8],
        limit: i64,
    ) -> Result<(Vec<KeyValue>, bool), EtcdError> {
        let answer = self
            .call(
                "/v3/kv/range",
                json!({ "key": B64.encode(key), "range_end": B64.encode(end), "limit": limit.to_string() }),
            )
            .await?;
        Ok((kvs(&answer)?, answer["more"].as_bool().unwrap_or(false)))
    }

    /// Writes `value` at `key`, attached to etcd lease `lease` (0: none);
    /// the store's revision after it.
    pub async fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        let answer = self.call("/v3/kv/put", put_json(key, value, lease)).await?;
        Ok(revision(&answer))
    }

    /// Deletes `key`; the store's revision after it.
    pub async fn delete(&self, key: &[u8]) -> Result<i64, EtcdError> {
        let answer = self
            .call("/v3/kv/deleterange", json!({ "key": B64.encode(key) }))
            .await?;
        Ok(revision(&answer))
    }

    /// Runs `success` if every comparison holds, `failure` otherwise, as
    /// one atomic step.
    pub async fn txn(
        &self,
        compare: &[Compare],
        success: &[Op],
        failure: &[Op],
    ) -> Result<TxnResult, EtcdError> {
        let body = json!({
            "compare": compare.iter().map(compare_json).collect::<Vec<_>>(),
            "success": success.iter().map(op_json).collect::<Vec<_>>(),
            "failure": failure.iter().map(op_json).collect::<Vec<_>>(),
        });
        let answer = self.call("/v3/kv/txn", body).await?;
        let mut reads = Vec::new();
        for response in answer["responses"].as_array().into_iter().flatten() {
            if let Some(range) = response.get("response_range") {
                reads.push(kvs(range)?);
            }
        }
        Ok(TxnResult {
            succeeded: answer["succeeded"].as_bool().unwrap_or(false),
            revision: revision(&answer),
            reads,
        })
    }

    /// A new etcd lease of `ttl_s` seconds: its id and the TTL etcd granted.
    pub async fn grant(&self, ttl_s: i64) -> Result<(i64, i64), EtcdError> {
        let answer = self
            .call("/v3/lease/grant", json!({ "TTL": ttl_s.to_string() }))
            .await?;
        let id = int(&answer["ID"]);
        if id == 0 {
            return Err(EtcdError::Refused(format!(
                "lease grant answered no id: {}",
                answer.get("error").unwrap_or(&Value::Null)
            )));
        }
        Ok((id, int(&answer["TTL"])))
    }

    /// Renews etcd lease `id` once: the TTL it has again, in seconds, or
    /// `None` if the lease is gone (expired or revoked).
    pub async fn keep_alive(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let answer = self
            .call("/v3/lease/keepalive", json!({ "ID": id.to_string() }))
            .await?;
        // A streaming call: the gateway wraps each answer in "result".
        let result = answer.get("result").unwrap_or(&answer);
        match int(&result["TTL"]) {
            ttl if ttl > 0 => Ok(Some(ttl)),
            _ => Ok(None),
        }
    }

    /// How many whole seconds etcd lease `id` has left by etcd's clock
    /// (rounded down), or `None` if the lease is gone.
    pub async fn time_to_live(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let answer = self
            .call("/v3/lease/timetolive", json!({ "ID": id.to_string() }))
            .await?;
        // The gateway leaves out a zero TTL; a lease that is gone has -1.
        match int(&answer["TTL"]) {
            ttl if ttl >= 0 => Ok(Some(ttl)),
            _ => Ok(None),
        }
    }

    /// Ends etcd lease `id` and deletes the keys attached to it.
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        match self
            .call("/v3/lease/revoke", json!({ "ID": id.to_string() }))
            .await
        {
            Ok(_) => Ok(()),
            // Already gone is what revoking asks for.
            Err(EtcdError::Refused(e)) if e.contains("lease not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// One call, on the endpoint that answered last, then on the others. A
    /// write (put, delete, transaction) goes to another endpoint only if it
    /// was never sent: after a timeout or a lost answer it may still be
    /// applied, and sending it again could apply it twice, or apply an older
    /// write after a newer one.
    async fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let write = matches!(path, "/v3/kv/put" | "/v3/kv/deleterange" | "/v3/kv/txn");
        let n = self.inner.endpoints.len();
        let first = self.inner.current.load(Ordering::Relaxed) % n;
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self.call_at(at, path, &body).await {
                Ok(answer) => {
                    self.inner.current.store(at, Ordering::Relaxed);
                    return Ok(answer);
                }
                Err(Failed {
                    error: EtcdError::Unavailable(e),
                    unsent,
                }) => {
                    // The next call starts elsewhere.
                    self.inner.current.store((at + 1) % n, Ordering::Relaxed);
                    last = format!("{}: {e}", self.inner.endpoints[at]);
                    if write && !unsent {
                        return Err(EtcdError::Unavailable(format!(
                            "{last} (the outcome is unknown)"
                        )));
                    }
                }
                Err(Failed { error, .. }) => return Err(error),
            }
        }
        Err(EtcdError::Unavailable(last))
    }

    /// One call on endpoint `at`, authenticating first if needed and once
    /// more if the token expired.
    async fn call_at(&self, at: usize, path: &str, body: &Value) -> Result<Value, Failed> {
        let mut renewed = false;
        loop {
            let token = match &self.inner.user {
                Some(_) => Some(self.token(at, renewed).await.map_err(Failed::unsent)?),
                None => None,
            };
            match self.exchange(at, path, body, token.as_deref()).await {
                Err(Failed {
                    error: EtcdError::Refused(e),
                    ..
                }) if token.is_some() && !renewed && auth_expired(&e) => {
                    renewed = true;
                }
                other => return other,
            }
        }
    }

    /// The auth token, asked for if there is none yet or `renew`.
    async fn token(&self, at: usize, renew: bool) -> Result<String, EtcdError> {
        if !renew {
            if let Some(token) = self.lock_token().clone() {
                return Ok(token);
            }
        }
        let Some((name, password)) = &self.inner.user else {
            return Err(EtcdError::Refused("no etcd user configured".into()));
        };
        let answer = self
            .exchange(
                at,
                "/v3/auth/authenticate",
                &json!({ "name": name, "password": password }),
                None,
            )
            .await
            .map_err(|f| f.error)?;
        let token = answer["token"]
            .as_str()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| EtcdError::Refused("authentication answered no token".into()))?
            .to_owned();
        *self.lock_token() = Some(token.clone());
        Ok(token)
    }

    fn lock_token(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.inner
            .token
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One HTTP exchange with endpoint `at`.
    async fn exchange(
        &self,
        at: usize,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<Value, Failed> {
        let url = format!("{}{path}", self.inner.endpoints[at]);
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(&url)
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            req = req.header(http::header::AUTHORIZATION, token);
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| Failed::unsent(EtcdError::Refused(format!("{url}: {e}"))))?;
        let exchange = async {
            let res = self.inner.client.request(req).await.map_err(|e| Failed {
                error: EtcdError::Unavailable(cause(&e)),
                unsent: e.is_connect(),
            })?;
            let status = res.status();
            let limited = http_body_util::Limited::new(res.into_body(), MAX_ANSWER_BYTES);
            let bytes = limited
                .collect()
                .await
                .map_err(|e| {
                    Failed::sent(EtcdError::Unavailable(format!("reading the answer: {e}")))
                })?
                .to_bytes();
            Ok::<_, Failed>((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(self.inner.timeout, exchange)
            .await
            .map_err(|_| {
                Failed::sent(EtcdError::Unavailable(format!(
                    "no answer within {} ms",
                    self.inner.timeout.as_millis()
                )))
            })??;
        let answer: Value = serde_json::from_slice(&bytes).map_err(|_| {
            Failed::sent(EtcdError::Unavailable(format!(
                "{status} with a body that is not JSON: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            )))
        })?;
        // Errors come as {"error": …, "code": grpc code, "message": …};
        // a streaming call puts them under "error" of its frame.
        let error = answer.get("error").filter(|e| !e.is_null());
        if status == StatusCode::OK && error.is_none() {
            return Ok(answer);
        }
        let message = error
            .and_then(|e| e.get("message").or(Some(e)))
            .or_else(|| answer.get("message"))
            .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_owned))
            .unwrap_or_else(|| status.to_string());
        let code = answer["code"]
            .as_i64()
            .or_else(|| error.and_then(|e| e["grpc_code"].as_i64()))
            .unwrap_or(0);
        // Without a leader nothing was proposed; anything else etcd
        // answered may still be applied.
        let unsent = message.contains("no leader");
        let error = if unavailable(status, code, &message) {
            EtcdError::Unavailable(message)
        } else {
            EtcdError::Refused(message)
        };
        Err(Failed { error, unsent })
    }
}

/// A failed exchange, and whether the request was surely not applied
/// (never sent, or refused before it was proposed).
struct Failed {
    error: EtcdError,
    unsent: bool,
}

impl Failed {
    fn unsent(error: EtcdError) -> Self {
        Self {
            error,
            unsent: true,
        }
    }

    fn sent(error: EtcdError) -> Self {
        Self {
            error,
            unsent: false,
        }
    }
}

/// Whether an error answer means "try again, maybe elsewhere": gRPC
/// UNAVAILABLE (14) or DEADLINE_EXCEEDED (4), an HTTP 5xx, or etcd's own
/// words for a member without a leader or shutting down.
fn unavailable(status: StatusCode, code: i64, message: &str) -> bool {
    matches!(code, 4 | 14)
        || status.is_server_error() && !message.contains("permission denied")
        || [
            "no leader",
            "leader changed",
            "server stopped",
            "timed out",
            "too many requests",
        ]
        .iter()
        .any(|m| message.contains(m))
}

/// Whether a refusal says the auth token is no longer valid.
fn auth_expired(message: &str) -> bool {
    message.contains("invalid auth token") || message.contains("user name is empty")
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from the prefix on.
    vec![0]
}

/// A 64-bit number as the gateway writes it (a string), or a plain number.
fn int(value: &Value) -> i64 {
    match value {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn revision(answer: &Value) -> i64 {
    int(&answer["header"]["revision"])
}

/// The key-value pairs of a range answer.
fn kvs(answer: &Value) -> Result<Vec<KeyValue>, EtcdError> {
    let decode = |v: &Value| -> Result<Vec<u8>, EtcdError> {
        match v.as_str() {
            None => Ok(Vec::new()),
            Some(s) => B64
                .decode(s)
                .map_err(|e| EtcdError::Unavailable(format!("a key or value is not base64: {e}"))),
        }
    };
    answer["kvs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|kv| {
            Ok(KeyValue {
                key: decode(&kv["key"])?,
                value: decode(&kv["value"])?,
                create_revision: int(&kv["create_revision"]),
                mod_revision: int(&kv["mod_revision"]),
                lease: int(&kv["lease"]),
            })
        })
        .collect()
}

fn put_json(key: &[u8], value: &[u8], lease: i64) -> Value {
    let mut put = json!({ "key": B64.encode(key), "value": B64.encode(value) });
    if lease != 0 {
        put["lease"] = Value::String(lease.to_string());
    }
    put
}

fn compare_json(compare: &Compare) -> Value {
    match compare {
        Compare::CreateRevision(key, rev) => json!({
            "key": B64.encode(key), "target": "CREATE", "result": "EQUAL",
            "create_revision": rev.to_string(),
        }),
        Compare::ModRevision(key, rev) => json!({
            "key": B64.encode(key), "target": "MOD", "result": "EQUAL",
            "mod_revision": rev.to_string(),
        }),
        Compare::Value(key, value) => json!({
            "key": B64.encode(key), "target": "VALUE", "result": "EQUAL",
            "value": B64.encode(value),
        }),
    }
}

fn op_json(op: &Op) -> Value {
    match op {
        Op::Put { key, value, lease } => json!({ "request_put": put_json(key, value, *lease) }),
        Op::Delete { key } => json!({ "request_delete_range": { "key": B64.encode(key) } }),
        Op::DeleteRange { key, end } => json!({
            "request_delete_range": { "key": B64.encode(key), "range_end": B64.encode(end) }
        }),
        Op::Get { key } => json!({ "request_range": { "key": B64.encode(key) } }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/fg/"), b"/fg0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn numbers_come_as_strings_or_numbers() {
        assert_eq!(int(&json!("42")), 42);
        assert_eq!(int(&json!(42)), 42);
        assert_eq!(int(&Value::Null), 0);
    }

    #[test]
    fn unavailable_or_refused() {
        assert!(unavailable(
            StatusCode::SERVICE_UNAVAILABLE,
            14,
            "etcdserver: no leader"
        ));
        assert!(unavailable(
            StatusCode::OK,
            0,
            "etcdserver: request timed out"
        ));
        assert!(!unavailable(
            StatusCode::BAD_REQUEST,
            3,
            "etcdserver: duplicate key given in txn request"
        ));
        assert!(!unavailable(
            StatusCode::FORBIDDEN,
            7,
            "etcdserver: permission denied"
        ));
    }
}
