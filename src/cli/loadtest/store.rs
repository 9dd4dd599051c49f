//! What the load test's storage takes (`--store`): how a write, a read and
//! a delete of a key (named by `--path`) are sent, and what an answer
//! says. `http` is storage that names the key in the path (`PUT`, `GET`,
//! `DELETE` of the path: WebDAV, S3, the embedded store); `etcd-v3` is
//! etcd's v3 JSON gateway behind an `etcd-v3` route (SPEC §11): the
//! rendered path is the key, base64 in a JSON body, `POST /v3/kv/put`,
//! `/v3/kv/range` and `/v3/kv/deleterange`.
//!
//! For the relay of `--late-writes` it also reads what fencegate sends the
//! storage and what the storage answers a late write: on etcd, the
//! transaction on the lease's fence key, applied when etcd's answer says
//! it succeeded, refused when neither it nor its nested first-write branch
//! did.

use base64::Engine as _;
use bytes::Bytes;
use http::{Method, StatusCode};

use super::layout;

/// `--store`.
#[derive(clap::ValueEnum, serde::Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Store {
    /// The key in the path: PUT, GET and DELETE of it.
    #[default]
    Http,
    /// etcd's v3 JSON gateway: the key in the body.
    #[value(name = "etcd-v3")]
    #[serde(rename = "etcd-v3")]
    EtcdV3,
}

/// A request to send: method, path, body and its content type (none: the
/// run's `--content-type`).
#[derive(Debug)]
pub struct Call {
    pub method: Method,
    pub path: String,
    pub body: Bytes,
    pub content_type: Option<&'static str>,
}

/// What a read's answer says of the key.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadAnswer {
    /// It holds a value: the load test's write it names, if any.
    Holds(Option<(String, u64)>),
    Absent,
    /// Not an answer about the key.
    Error,
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(value: &serde_json::Value) -> Option<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(value.as_str()?)
        .ok()
}

fn json_call(path: &str, body: serde_json::Value) -> Call {
    Call {
        method: Method::POST,
        path: path.to_owned(),
        body: Bytes::from(body.to_string()),
        content_type: Some("application/json"),
    }
}

impl Store {
    /// A write of `value` (the rendered `--body`) to the key at `path`.
    pub fn write(self, path: &str, value: String) -> Call {
        match self {
            Store::Http => Call {
                method: Method::PUT,
                path: path.to_owned(),
                body: Bytes::from(value),
                content_type: None,
            },
            Store::EtcdV3 => json_call(
                "/v3/kv/put",
                serde_json::json!({"key": b64(path.as_bytes()), "value": b64(value.as_bytes())}),
            ),
        }
    }

    /// A read of the key at `path`.
    pub fn read(self, path: &str) -> Call {
        match self {
            Store::Http => Call {
                method: Method::GET,
                path: path.to_owned(),
                body: Bytes::new(),
                content_type: None,
            },
            Store::EtcdV3 => json_call(
                "/v3/kv/range",
                serde_json::json!({"key": b64(path.as_bytes())}),
            ),
        }
    }

    /// A delete of the key at `path`.
    pub fn delete(self, path: &str) -> Call {
        match self {
            Store::Http => Call {
                method: Method::DELETE,
                path: path.to_owned(),
                body: Bytes::new(),
                content_type: None,
            },
            Store::EtcdV3 => json_call(
                "/v3/kv/deleterange",
                serde_json::json!({"key": b64(path.as_bytes())}),
            ),
        }
    }

    /// What a read's answer says.
    pub fn read_answer(self, status: StatusCode, body: &[u8]) -> ReadAnswer {
        match self {
            Store::Http if status.is_success() => ReadAnswer::Holds(layout::find_value(body)),
            Store::Http if status == StatusCode::NOT_FOUND => ReadAnswer::Absent,
            Store::Http => ReadAnswer::Error,
            Store::EtcdV3 if status != StatusCode::OK => ReadAnswer::Error,
            Store::EtcdV3 => {
                let Ok(answer) = serde_json::from_slice::<serde_json::Value>(body) else {
                    return ReadAnswer::Error;
                };
                // proto3's JSON leaves out an empty list.
                match answer.get("kvs").and_then(|kvs| kvs.get(0)) {
                    None => ReadAnswer::Absent,
                    Some(kv) => ReadAnswer::Holds(
                        kv.get("value")
                            .and_then(unb64)
                            .and_then(|v| layout::find_value(&v)),
                    ),
                }
            }
        }
    }

    /// Whether a delete's answer says the key is gone.
    pub fn deleted(self, status: StatusCode) -> bool {
        match self {
            Store::Http => status.is_success() || status == StatusCode::NOT_FOUND,
            Store::EtcdV3 => status == StatusCode::OK,
        }
    }

    /// For the relay: the key a request fencegate sends writes (`None`: not
    /// a write), and whether the storage compares something before it
    /// applies it (`if_header`: it carries `If-Match` or `If-None-Match`).
    pub fn relayed_write(
        self,
        method: &Method,
        path: &str,
        body: &[u8],
        if_header: bool,
    ) -> Option<(String, bool)> {
        match self {
            Store::Http => {
                let write = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
                    && method.as_str() != "PROPFIND";
                write.then(|| (path.to_owned(), if_header))
            }
            Store::EtcdV3 => {
                if !path.ends_with("/kv/txn") {
                    return None;
                }
                let txn: serde_json::Value = serde_json::from_slice(body).ok()?;
                // fencegate's transaction: the fence key's put, then the
                // client's write ([`fencegate_core::body_keys::etcd::fenced`]).
                let write = txn.get("success")?.get(1)?;
                let key = ["request_put", "request_delete_range"]
                    .iter()
                    .find_map(|op| write.get(op)?.get("key"))
                    .and_then(unb64)?;
                let compared = txn
                    .get("compare")
                    .and_then(serde_json::Value::as_array)
                    .is_some_and(|c| !c.is_empty());
                Some((String::from_utf8_lossy(&key).into_owned(), compared))
            }
        }
    }

    /// For the relay: whether only a write's answer body, not its status,
    /// says whether the storage applied it.
    pub fn answer_says_applied(self) -> bool {
        self == Store::EtcdV3
    }

    /// For the relay: whether the storage applied a late write, and
    /// whether it refused it for a later term's write.
    pub fn delivered(self, status: StatusCode, body: &[u8]) -> (bool, bool) {
        match self {
            Store::Http => (status.is_success(), matches!(status.as_u16(), 409 | 412)),
            Store::EtcdV3 => {
                let Some(answer) = (status == StatusCode::OK)
                    .then(|| serde_json::from_slice::<serde_json::Value>(body).ok())
                    .flatten()
                else {
                    return (false, false);
                };
                let succeeded = |v: &serde_json::Value| v.get("succeeded") == Some(&true.into());
                if succeeded(&answer) {
                    return (true, false);
                }
                // The nested branch only makes a missing fence key: that is
                // no refusal (and applies nothing).
                let made_fence = answer
                    .get("responses")
                    .and_then(|r| r.get(0))
                    .and_then(|r| r.get("response_txn"))
                    .is_some_and(succeeded);
                (false, !made_fence)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_calls_carry_the_key_in_base64() {
        let w = Store::EtcdV3.write("/app/lt-0/k", "v".into());
        assert_eq!((w.method, w.path.as_str()), (Method::POST, "/v3/kv/put"));
        let body: serde_json::Value = serde_json::from_slice(&w.body).unwrap();
        assert_eq!(body["key"], b64(b"/app/lt-0/k"));
        let v = layout::value("r1-w1-1", 3);
        let read = format!(
            r#"{{"header":{{}},"kvs":[{{"key":"x","value":"{}"}}],"count":"1"}}"#,
            b64(v.as_bytes())
        );
        assert_eq!(
            Store::EtcdV3.read_answer(StatusCode::OK, read.as_bytes()),
            ReadAnswer::Holds(Some(("r1-w1-1".into(), 3)))
        );
        assert_eq!(
            Store::EtcdV3.read_answer(StatusCode::OK, br#"{"header":{}}"#),
            ReadAnswer::Absent
        );
        // What a late transaction's answer says.
        assert_eq!(
            Store::EtcdV3.delivered(StatusCode::OK, br#"{"succeeded":true}"#),
            (true, false)
        );
        assert_eq!(
            Store::EtcdV3.delivered(
                StatusCode::OK,
                br#"{"responses":[{"response_txn":{"responses":[]}}]}"#
            ),
            (false, true)
        );
        assert_eq!(
            Store::EtcdV3.delivered(
                StatusCode::OK,
                br#"{"responses":[{"response_txn":{"succeeded":true}}]}"#
            ),
            (false, false)
        );
        let txn = fencegate_core::body_keys::etcd::fenced(
            fencegate_core::body_keys::etcd::Call::Put,
            &w.body,
            b"fencegate/fence/lt-0",
            3,
        )
        .unwrap();
        assert_eq!(
            Store::EtcdV3.relayed_write(&Method::POST, "/v3/kv/txn", &txn, false),
            Some(("/app/lt-0/k".into(), true))
        );
    }
}
