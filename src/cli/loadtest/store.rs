//! What the load test's storage takes (`--store`): how a write, a read and
//! a delete of a key (named by `--path`) are sent, and what an answer
//! says. `http` is storage that names the key in the path (`PUT`, `GET`,
//! `DELETE` of the path: WebDAV, S3, the embedded store); `etcd-v3` is
//! etcd's v3 JSON gateway behind an `etcd-v3` route (SPEC §11): the
//! rendered path is the key, base64 in a JSON body, `POST /v3/kv/put`,
//! `/v3/kv/range` and `/v3/kv/deleterange`; `dynamodb` is DynamoDB's API
//! behind a `dynamodb` route: the rendered path is `/{table}/{partition
//! key}`, and a write is a `PutItem` that carries the term's token in the
//! item and the condition on it DynamoDB evaluates (`GetItem` reads it,
//! `DeleteItem` deletes it).
//!
//! For the relay of `--late-writes` it also reads what fencegate sends the
//! storage and what the storage answers a late write: on etcd, the
//! transaction on the lease's fence key, applied when etcd's answer says
//! it succeeded, refused when neither it nor its nested first-write branch
//! did; on DynamoDB, the `PutItem` and its condition, applied on 200,
//! refused with `ConditionalCheckFailedException`.

use base64::Engine as _;
use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::{json, Value};

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
    /// DynamoDB's API: the table and the item's partition key in the body.
    #[value(name = "dynamodb")]
    #[serde(rename = "dynamodb")]
    DynamoDb,
}

/// The storage the load test speaks to: `--store`, and for DynamoDB the
/// table's attribute names.
#[derive(Clone, Debug)]
pub struct Storage {
    pub store: Store,
    /// DynamoDB: the partition key's attribute (a string).
    pub partition_key: String,
    /// DynamoDB: the attribute that holds the item's token.
    pub token_attribute: String,
    /// DynamoDB: whether a write carries the condition on the token (off:
    /// to see what happens without it).
    pub condition: bool,
}

impl Storage {
    /// Storage of kind `store` (DynamoDB's names: the defaults of a
    /// `dynamodb` route and of the Python client).
    pub fn new(store: Store) -> Self {
        Self {
            store,
            partition_key: "pk".to_owned(),
            token_attribute: "fencing_token".to_owned(),
            condition: true,
        }
    }
}

/// A request to send: method, path, body, its content type (none: the
/// run's `--content-type`) and DynamoDB's `X-Amz-Target`.
#[derive(Debug)]
pub struct Call {
    pub method: Method,
    pub path: String,
    pub body: Bytes,
    pub content_type: Option<&'static str>,
    pub amz_target: Option<&'static str>,
}

impl Call {
    /// The headers the call names (beside the run's own).
    pub fn headers(&self) -> Vec<(&'static str, &'static str)> {
        let mut headers = Vec::new();
        if let Some(ct) = self.content_type {
            headers.push(("content-type", ct));
        }
        if let Some(target) = self.amz_target {
            headers.push(("x-amz-target", target));
        }
        headers
    }
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

fn unb64(value: &Value) -> Option<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(value.as_str()?)
        .ok()
}

fn plain(method: Method, path: &str) -> Call {
    Call {
        method,
        path: path.to_owned(),
        body: Bytes::new(),
        content_type: None,
        amz_target: None,
    }
}

fn etcd(path: &str, body: Value) -> Call {
    Call {
        method: Method::POST,
        path: path.to_owned(),
        body: Bytes::from(body.to_string()),
        content_type: Some("application/json"),
        amz_target: None,
    }
}

/// The condition a fenced DynamoDB write carries (SPEC §11).
pub const DYNAMODB_CONDITION: &str =
    "attribute_not_exists(#fencegate_token) OR #fencegate_token <= :fencegate_token";

/// A DynamoDB operation (`PutItem`, ...) with `body`.
fn dynamodb(target: &'static str, body: &Value) -> Call {
    Call {
        method: Method::POST,
        path: "/".to_owned(),
        body: Bytes::from(body.to_string()),
        content_type: Some("application/x-amz-json-1.0"),
        amz_target: Some(target),
    }
}

/// The table and the partition key of the item at `path` (`/{table}/{key}`).
pub fn dynamodb_item(path: &str) -> Option<(&str, &str)> {
    let (table, key) = path.strip_prefix('/')?.split_once('/')?;
    (!table.is_empty() && !key.is_empty()).then_some((table, key))
}

/// DynamoDB's answer to a write refused by its condition.
const CONDITION_FAILED: &[u8] = b"ConditionalCheckFailedException";

/// The attribute of an item that holds the load test's value.
const VALUE_ATTRIBUTE: &str = "value";

impl Storage {
    /// A DynamoDB call on the item at `path`: its table and `Key`.
    fn item_call(&self, target: &'static str, path: &str, extra: Value) -> Call {
        let (table, key) = dynamodb_item(path).unwrap_or(("", path));
        let mut body = json!({
            "TableName": table,
            "Key": {self.partition_key.as_str(): {"S": key}},
        });
        if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
            body.extend(extra);
        }
        dynamodb(target, &body)
    }

    /// A write of `value` (the rendered `--body`) under `token` to the key
    /// at `path`.
    pub fn write(&self, path: &str, value: String, token: u64) -> Call {
        match self.store {
            Store::Http => Call {
                body: Bytes::from(value),
                ..plain(Method::PUT, path)
            },
            Store::EtcdV3 => etcd(
                "/v3/kv/put",
                json!({"key": b64(path.as_bytes()), "value": b64(value.as_bytes())}),
            ),
            Store::DynamoDb => {
                let (table, key) = dynamodb_item(path).unwrap_or(("", path));
                let token = json!({"N": token.to_string()});
                let mut body = json!({
                    "TableName": table,
                    "Item": {
                        self.partition_key.as_str(): {"S": key},
                        VALUE_ATTRIBUTE: {"S": value},
                        self.token_attribute.as_str(): token,
                    },
                });
                if self.condition {
                    body["ConditionExpression"] = DYNAMODB_CONDITION.into();
                    body["ExpressionAttributeNames"] =
                        json!({"#fencegate_token": self.token_attribute});
                    body["ExpressionAttributeValues"] = json!({":fencegate_token": token});
                }
                dynamodb("DynamoDB_20120810.PutItem", &body)
            }
        }
    }

    /// A read of the key at `path`.
    pub fn read(&self, path: &str) -> Call {
        match self.store {
            Store::Http => plain(Method::GET, path),
            Store::EtcdV3 => etcd("/v3/kv/range", json!({"key": b64(path.as_bytes())})),
            Store::DynamoDb => self.item_call(
                "DynamoDB_20120810.GetItem",
                path,
                json!({"ConsistentRead": true}),
            ),
        }
    }

    /// A delete of the key at `path`.
    pub fn delete(&self, path: &str) -> Call {
        match self.store {
            Store::Http => plain(Method::DELETE, path),
            Store::EtcdV3 => etcd("/v3/kv/deleterange", json!({"key": b64(path.as_bytes())})),
            Store::DynamoDb => self.item_call("DynamoDB_20120810.DeleteItem", path, json!({})),
        }
    }

    /// Whether the run's keys can be deleted through fencegate: not on
    /// DynamoDB, whose `DeleteItem` fencegate refuses (a deleted item keeps
    /// no token, SPEC §11).
    pub fn deletes_through_fencegate(&self) -> bool {
        self.store != Store::DynamoDb
    }

    /// What a read's answer says.
    pub fn read_answer(&self, status: StatusCode, body: &[u8]) -> ReadAnswer {
        let json = || serde_json::from_slice::<Value>(body).ok();
        match self.store {
            Store::Http if status.is_success() => ReadAnswer::Holds(layout::find_value(body)),
            Store::Http if status == StatusCode::NOT_FOUND => ReadAnswer::Absent,
            Store::Http => ReadAnswer::Error,
            Store::EtcdV3 | Store::DynamoDb if status != StatusCode::OK => ReadAnswer::Error,
            Store::EtcdV3 => {
                let Some(answer) = json() else {
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
            Store::DynamoDb => {
                let Some(answer) = json().filter(Value::is_object) else {
                    return ReadAnswer::Error;
                };
                // An item that is not there: `{}`.
                match answer.get("Item") {
                    None => ReadAnswer::Absent,
                    Some(item) => ReadAnswer::Holds(
                        item.get(VALUE_ATTRIBUTE)
                            .and_then(|v| v.get("S"))
                            .and_then(Value::as_str)
                            .and_then(|v| layout::find_value(v.as_bytes())),
                    ),
                }
            }
        }
    }

    /// Whether a delete's answer says the key is gone.
    pub fn deleted(&self, status: StatusCode) -> bool {
        match self.store {
            Store::Http => status.is_success() || status == StatusCode::NOT_FOUND,
            Store::EtcdV3 | Store::DynamoDb => status == StatusCode::OK,
        }
    }

    /// For the relay: the key a request fencegate sends writes (`None`: not
    /// a write), and whether the storage compares something before it
    /// applies it (`if_header`: it carries `If-Match` or `If-None-Match`).
    pub fn relayed_write(
        &self,
        method: &Method,
        path: &str,
        amz_target: Option<&str>,
        body: &[u8],
        if_header: bool,
    ) -> Option<(String, bool)> {
        match self.store {
            Store::Http => {
                let write = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
                    && method.as_str() != "PROPFIND";
                write.then(|| (path.to_owned(), if_header))
            }
            Store::EtcdV3 => relayed_etcd_write(path, body),
            Store::DynamoDb => {
                let item = match amz_target?.rsplit_once('.')?.1 {
                    "PutItem" => "Item",
                    "UpdateItem" | "DeleteItem" => "Key",
                    _ => return None,
                };
                let request: Value = serde_json::from_slice(body).ok()?;
                let table = request.get("TableName")?.as_str()?;
                let key = request
                    .get(item)?
                    .get(&self.partition_key)?
                    .get("S")?
                    .as_str()?;
                // The condition of the load test's writes (with the
                // condition off, none at all).
                let compared = request
                    .get("ConditionExpression")
                    .and_then(Value::as_str)
                    .is_some_and(|c| c.contains(":fencegate_token"));
                Some((format!("/{table}/{key}"), compared))
            }
        }
    }

    /// For the relay: whether only a write's answer body, not its status,
    /// says whether the storage applied it.
    pub fn answer_says_applied(&self) -> bool {
        self.store == Store::EtcdV3
    }

    /// For the relay: whether the storage applied a late write, and
    /// whether it refused it for a later term's write.
    pub fn delivered(&self, status: StatusCode, body: &[u8]) -> (bool, bool) {
        match self.store {
            Store::Http => (status.is_success(), matches!(status.as_u16(), 409 | 412)),
            Store::EtcdV3 => etcd_delivered(status, body),
            Store::DynamoDb => (
                status == StatusCode::OK,
                status == StatusCode::BAD_REQUEST
                    && body
                        .windows(CONDITION_FAILED.len())
                        .any(|w| w == CONDITION_FAILED),
            ),
        }
    }
}

/// The key of fencegate's transaction on etcd, and whether it compares.
fn relayed_etcd_write(path: &str, body: &[u8]) -> Option<(String, bool)> {
    if !path.ends_with("/kv/txn") {
        return None;
    }
    let txn: Value = serde_json::from_slice(body).ok()?;
    // fencegate's transaction: the fence key's put, then the client's
    // write ([`fencegate_core::body_keys::etcd::fenced`]).
    let write = txn.get("success")?.get(1)?;
    let key = ["request_put", "request_delete_range"]
        .iter()
        .find_map(|op| write.get(op)?.get("key"))
        .and_then(unb64)?;
    let compared = txn
        .get("compare")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    Some((String::from_utf8_lossy(&key).into_owned(), compared))
}

/// Whether etcd applied a transaction, and whether it refused it.
fn etcd_delivered(status: StatusCode, body: &[u8]) -> (bool, bool) {
    let Some(answer) = (status == StatusCode::OK)
        .then(|| serde_json::from_slice::<Value>(body).ok())
        .flatten()
    else {
        return (false, false);
    };
    let succeeded = |v: &Value| v.get("succeeded") == Some(&true.into());
    if succeeded(&answer) {
        return (true, false);
    }
    // The nested branch only makes a missing fence key: that is no refusal
    // (and applies nothing).
    let made_fence = answer
        .get("responses")
        .and_then(|r| r.get(0))
        .and_then(|r| r.get("response_txn"))
        .is_some_and(succeeded);
    (false, !made_fence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_calls_carry_the_key_in_base64() {
        let etcd = Storage::new(Store::EtcdV3);
        let w = etcd.write("/app/lt-0/k", "v".into(), 3);
        assert_eq!((w.method, w.path.as_str()), (Method::POST, "/v3/kv/put"));
        let body: serde_json::Value = serde_json::from_slice(&w.body).unwrap();
        assert_eq!(body["key"], b64(b"/app/lt-0/k"));
        let v = layout::value("r1-w1-1", 3);
        let read = format!(
            r#"{{"header":{{}},"kvs":[{{"key":"x","value":"{}"}}],"count":"1"}}"#,
            b64(v.as_bytes())
        );
        assert_eq!(
            etcd.read_answer(StatusCode::OK, read.as_bytes()),
            ReadAnswer::Holds(Some(("r1-w1-1".into(), 3)))
        );
        assert_eq!(
            etcd.read_answer(StatusCode::OK, br#"{"header":{}}"#),
            ReadAnswer::Absent
        );
        // What a late transaction's answer says.
        assert_eq!(
            etcd.delivered(StatusCode::OK, br#"{"succeeded":true}"#),
            (true, false)
        );
        assert_eq!(
            etcd.delivered(
                StatusCode::OK,
                br#"{"responses":[{"response_txn":{"responses":[]}}]}"#
            ),
            (false, true)
        );
        assert_eq!(
            etcd.delivered(
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
            etcd.relayed_write(&Method::POST, "/v3/kv/txn", None, &txn, false),
            Some(("/app/lt-0/k".into(), true))
        );
    }

    #[test]
    fn dynamodb_writes_carry_the_token_in_the_item_and_the_condition() {
        let dynamo = Storage::new(Store::DynamoDb);
        let w = dynamo.write("/jobs/lt-0/k", "v".into(), 7);
        assert_eq!((w.method, w.path.as_str()), (Method::POST, "/"));
        assert_eq!(w.amz_target, Some("DynamoDB_20120810.PutItem"));
        let body: Value = serde_json::from_slice(&w.body).unwrap();
        assert_eq!(body["TableName"], "jobs");
        assert_eq!(body["Item"]["pk"]["S"], "lt-0/k");
        assert_eq!(body["Item"]["fencing_token"]["N"], "7");
        assert_eq!(
            body["ExpressionAttributeValues"][":fencegate_token"]["N"],
            "7"
        );
        // The very check fencegate makes passes.
        let table = fencegate_core::body_keys::dynamodb::Table {
            name: "jobs".into(),
            partition_key: "pk".into(),
            token_attribute: "fencing_token".into(),
        };
        let op = fencegate_core::body_keys::dynamodb::Op::of("DynamoDB_20120810.PutItem").unwrap();
        assert_eq!(
            fencegate_core::body_keys::dynamodb::check(op, &w.body, &[table], 7),
            Ok(())
        );
        assert_eq!(
            dynamo.relayed_write(&Method::POST, "/", w.amz_target, &w.body, false),
            Some(("/jobs/lt-0/k".into(), true))
        );
        let bare = Storage {
            condition: false,
            ..dynamo.clone()
        };
        let w = bare.write("/jobs/lt-0/k", "v".into(), 7);
        assert_eq!(
            bare.relayed_write(&Method::POST, "/", w.amz_target, &w.body, false),
            Some(("/jobs/lt-0/k".into(), false))
        );
        let read = dynamo.read("/jobs/lt-0/k");
        assert_eq!(read.amz_target, Some("DynamoDB_20120810.GetItem"));
        assert_eq!(
            dynamo.relayed_write(&Method::POST, "/", read.amz_target, &read.body, false),
            None
        );
        let item = format!(
            r#"{{"Item":{{"pk":{{"S":"lt-0/k"}},"value":{{"S":"{}"}}}}}}"#,
            layout::value("r1-w1-1", 3)
        );
        assert_eq!(
            dynamo.read_answer(StatusCode::OK, item.as_bytes()),
            ReadAnswer::Holds(Some(("r1-w1-1".into(), 3)))
        );
        assert_eq!(
            dynamo.read_answer(StatusCode::OK, b"{}"),
            ReadAnswer::Absent
        );
        assert_eq!(
            dynamo.delivered(
                StatusCode::BAD_REQUEST,
                br#"{"__type":"com.amazonaws.dynamodb.v20120810#ConditionalCheckFailedException"}"#
            ),
            (false, true)
        );
        assert_eq!(
            dynamo.delivered(
                StatusCode::BAD_REQUEST,
                br#"{"__type":"x#ValidationException"}"#
            ),
            (false, false)
        );
    }
}
