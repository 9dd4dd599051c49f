//! etcd's v3 JSON gateway (SPEC §11): which call a request is, by its path,
//! and what a write touches, read from its JSON body as etcd reads it.
//!
//! The gateway takes `POST` for everything, reads too, so a call is known
//! by its path ([`Call::of`]): `/v3/kv/put`, `/v3/kv/deleterange` and
//! `/v3/kv/txn` write keys (under `/v3beta/` as well, which etcd 3.4
//! still serves, and `/v3alpha/`, which older ones did; a trailing `:`, an
//! empty custom verb, is the same call); `/v3/kv/range`, watches and the
//! lease calls that touch no key (grant, keep-alive, time-to-live,
//! listing) read;
//! any other call (a lease's revocation, which deletes every key attached
//! to it; compaction; authentication; maintenance; locks and elections,
//! which write keys of their own) is one no key route can fence.
//!
//! Bodies are read strictly ([`super::json`]): etcd's gateway takes each
//! field under its proto name (`range_end`) and its JSON name
//! (`rangeEnd`), so both are read, and a body that names one field twice,
//! or a field fencegate does not know, is refused: what fencegate reads is
//! what etcd will act on. Keys are standard base64 (with padding), as etcd
//! writes them. A transaction's operations count at most [`MAX_OPS`] (etcd's
//! own default limit) and nest at most [`MAX_NESTING`] deep.

use base64::Engine as _;

use super::json::Json;
use super::Touched;

/// The most operations a transaction may hold, nested ones included
/// (etcd's `--max-txn-ops` default).
pub const MAX_OPS: usize = 128;

/// How deep transactions may nest (`request_txn` inside `request_txn`).
pub const MAX_NESTING: usize = 4;

/// What a request to etcd's gateway is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `kv/put`.
    Put,
    /// `kv/deleterange`.
    DeleteRange,
    /// `kv/txn`: a write, or a read if it touches no key.
    Txn,
    /// A read: `kv/range`, a watch, a lease call that touches no key.
    Read,
    /// A call that changes no key's value and that no key route can fence
    /// (`kv/compaction`, `auth/…`, `maintenance/…`, `cluster/…`): an
    /// unrouted write.
    Unfenced,
    /// A call that may write or delete keys fencegate cannot see (a lease's
    /// revocation deletes the keys attached to it; locks and elections
    /// write keys of their own; a call fencegate does not know): refused
    /// even where unrouted writes are allowed, since those keys may be
    /// guarded ones.
    Unfenceable,
}

impl Call {
    /// The call a request to `path` is, if `path` is one of the gateway's
    /// (`/v3/…`, `/v3beta/…`, `/v3alpha/…`). The path is percent-decoded
    /// first, as etcd's gateway reads it: `/v3/kv/%70ut` is a put.
    pub fn of(path: &str) -> Option<Call> {
        let decoded: Vec<u8> = percent_encoding::percent_decode_str(path).collect();
        let rest = [&b"/v3/"[..], b"/v3beta/", b"/v3alpha/"]
            .iter()
            .find_map(|prefix| decoded.strip_prefix(*prefix))?;
        // The gateway reads a trailing `:` as an empty custom verb: `put:`
        // is a put. Any other `:` is a call fencegate does not know.
        let rest = rest.strip_suffix(b":").unwrap_or(rest);
        Some(match rest {
            b"kv/put" => Call::Put,
            b"kv/deleterange" => Call::DeleteRange,
            b"kv/txn" => Call::Txn,
            b"kv/range"
            | b"watch"
            | b"lease/grant"
            | b"lease/keepalive"
            | b"lease/timetolive"
            | b"lease/leases"
            | b"kv/lease/timetolive"
            | b"kv/lease/leases" => Call::Read,
            b"kv/compaction" => Call::Unfenced,
            _ if ["auth/", "maintenance/", "cluster/"]
                .iter()
                .any(|p| rest.starts_with(p.as_bytes())) =>
            {
                Call::Unfenced
            }
            _ => Call::Unfenceable,
        })
    }
}

/// Why a body cannot be read as etcd would read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed(pub String);

fn bad(why: impl Into<String>) -> Malformed {
    Malformed(why.into())
}

/// What a write of `call` with `body` touches (empty for a transaction of
/// reads only).
pub fn touched(call: Call, body: &[u8]) -> Result<Vec<Touched>, Malformed> {
    let doc =
        Json::parse(body).map_err(|e| bad(format!("the body is not JSON etcd takes: {e}")))?;
    let mut out = Vec::new();
    let mut ops = 0;
    match call {
        Call::Put => put(&doc, &mut out)?,
        Call::DeleteRange => delete_range(&doc, &mut out)?,
        Call::Txn => txn(&doc, 1, &mut ops, &mut out)?,
        Call::Read | Call::Unfenced | Call::Unfenceable => {}
    }
    Ok(out)
}

/// The fields of a message: each as its proto name and its JSON name (the
/// same for one word).
type Fields = &'static [(&'static str, &'static str)];

const PUT: Fields = &[
    ("key", "key"),
    ("value", "value"),
    ("lease", "lease"),
    ("prev_kv", "prevKv"),
    ("ignore_value", "ignoreValue"),
    ("ignore_lease", "ignoreLease"),
];

const DELETE_RANGE: Fields = &[
    ("key", "key"),
    ("range_end", "rangeEnd"),
    ("prev_kv", "prevKv"),
];

const RANGE: Fields = &[
    ("key", "key"),
    ("range_end", "rangeEnd"),
    ("limit", "limit"),
    ("revision", "revision"),
    ("sort_order", "sortOrder"),
    ("sort_target", "sortTarget"),
    ("serializable", "serializable"),
    ("keys_only", "keysOnly"),
    ("count_only", "countOnly"),
    ("min_mod_revision", "minModRevision"),
    ("max_mod_revision", "maxModRevision"),
    ("min_create_revision", "minCreateRevision"),
    ("max_create_revision", "maxCreateRevision"),
];

const TXN: Fields = &[
    ("compare", "compare"),
    ("success", "success"),
    ("failure", "failure"),
];

const COMPARE: Fields = &[
    ("result", "result"),
    ("target", "target"),
    ("key", "key"),
    ("version", "version"),
    ("create_revision", "createRevision"),
    ("mod_revision", "modRevision"),
    ("value", "value"),
    ("lease", "lease"),
    ("range_end", "rangeEnd"),
];

const REQUEST_OP: Fields = &[
    ("request_range", "requestRange"),
    ("request_put", "requestPut"),
    ("request_delete_range", "requestDeleteRange"),
    ("request_txn", "requestTxn"),
];

/// `doc`'s fields as `fields` names them, by proto name: an object whose
/// every member is a known field, named once under either name.
fn fields<'a>(
    doc: &'a Json,
    what: &str,
    fields: Fields,
) -> Result<Vec<(&'static str, &'a Json)>, Malformed> {
    let Json::Object(members) = doc else {
        return Err(bad(format!("{what} must be an object, not {}", doc.kind())));
    };
    let mut out: Vec<(&'static str, &'a Json)> = Vec::with_capacity(members.len());
    for (name, value) in members {
        let Some(&(proto, _)) = fields.iter().find(|(p, j)| p == name || j == name) else {
            return Err(bad(format!(
                "{what} has a field etcd's fencing does not know: {name:?}"
            )));
        };
        if out.iter().any(|(p, _)| *p == proto) {
            return Err(bad(format!(
                "{what} names {proto} twice (under both of its names)"
            )));
        }
        out.push((proto, value));
    }
    Ok(out)
}

fn field<'a>(fields: &[(&'static str, &'a Json)], name: &str) -> Option<&'a Json> {
    fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

/// Bytes as etcd's JSON writes them: standard base64, padded.
fn bytes(value: &Json, what: &str) -> Result<Vec<u8>, Malformed> {
    let Json::String(text) = value else {
        return Err(bad(format!(
            "{what} must be a base64 string, not {}",
            value.kind()
        )));
    };
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|_| bad(format!("{what} is not standard base64")))
}

fn key(fields: &[(&'static str, &Json)], what: &str) -> Result<Vec<u8>, Malformed> {
    let key = field(fields, "key").ok_or_else(|| bad(format!("{what} names no key")))?;
    bytes(key, &format!("{what}'s key"))
}

fn put(doc: &Json, out: &mut Vec<Touched>) -> Result<(), Malformed> {
    let f = fields(doc, "a put", PUT)?;
    out.push(Touched::Key(key(&f, "a put")?));
    Ok(())
}

fn delete_range(doc: &Json, out: &mut Vec<Touched>) -> Result<(), Malformed> {
    let f = fields(doc, "a range delete", DELETE_RANGE)?;
    let from = key(&f, "a range delete")?;
    let to = match field(&f, "range_end") {
        Some(end) => bytes(end, "a range delete's range_end")?,
        None => Vec::new(),
    };
    out.push(match to.as_slice() {
        [] => Touched::Key(from),
        [0] => Touched::From(from),
        _ => Touched::Range { from, to },
    });
    Ok(())
}

fn txn(doc: &Json, depth: usize, ops: &mut usize, out: &mut Vec<Touched>) -> Result<(), Malformed> {
    if depth > MAX_NESTING {
        return Err(bad(format!("transactions nest deeper than {MAX_NESTING}")));
    }
    let f = fields(doc, "a transaction", TXN)?;
    if let Some(compare) = field(&f, "compare") {
        for c in array(compare, "a transaction's compare")? {
            // A comparison reads; its fields must still be etcd's.
            fields(c, "a comparison", COMPARE)?;
        }
    }
    for branch in ["success", "failure"] {
        let Some(list) = field(&f, branch) else {
            continue;
        };
        for op in array(list, &format!("a transaction's {branch}"))? {
            *ops += 1;
            if *ops > MAX_OPS {
                return Err(bad(format!(
                    "a transaction holds more than {MAX_OPS} operations"
                )));
            }
            request_op(op, depth, ops, out)?;
        }
    }
    Ok(())
}

fn request_op(
    doc: &Json,
    depth: usize,
    ops: &mut usize,
    out: &mut Vec<Touched>,
) -> Result<(), Malformed> {
    let f = fields(doc, "an operation", REQUEST_OP)?;
    let [(name, value)] = f.as_slice() else {
        return Err(bad("an operation must be exactly one request"));
    };
    match *name {
        "request_range" => fields(value, "a range read", RANGE).map(|_| ()),
        "request_put" => put(value, out),
        "request_delete_range" => delete_range(value, out),
        _ => txn(value, depth + 1, ops, out),
    }
}

fn array<'a>(value: &'a Json, what: &str) -> Result<&'a [Json], Malformed> {
    match value {
        Json::Array(items) => Ok(items),
        other => Err(bad(format!(
            "{what} must be an array, not {}",
            other.kind()
        ))),
    }
}

/// The path of a transaction under the gateway prefix `path` was sent to
/// (`/v3/`, `/v3beta/` or `/v3alpha/`), for the transaction a write
/// becomes.
pub fn txn_path(path: &str) -> &'static str {
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(path).collect();
    if decoded.starts_with(b"/v3beta/") {
        "/v3beta/kv/txn"
    } else if decoded.starts_with(b"/v3alpha/") {
        "/v3alpha/kv/txn"
    } else {
        "/v3/kv/txn"
    }
}

/// The fence key of `lease`: `prefix` followed by the lease's name.
pub fn fence_key(prefix: &str, lease: &str) -> Vec<u8> {
    [prefix.as_bytes(), lease.as_bytes()].concat()
}

/// A token as a fence key holds it: 20 decimal digits, zero-padded (a
/// `u64` has at most 20), so that etcd, which compares values as bytes,
/// orders tokens as numbers.
pub fn token_text(token: u128) -> String {
    format!("{token:020}")
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The transaction that carries out the write of `call` with `body` (as
/// [`touched`] read it) only if the lease's fence key names no later term
/// than `token`, and sets the fence key to `token` with it:
///
/// ```text
/// compare: fence key's value < token + 1             (no later term wrote)
/// success: put fence key = token, the client's write
/// failure: txn { compare: fence key's create_revision == 0   (no fence key yet)
///                success: put fence key = token      (the write is not done:
///                                                     the caller sends it again)
///                failure: range fence key }          (the later term, for the answer)
/// ```
///
/// The client's write is its put or range delete as an operation, or its
/// transaction nested whole, its own compares kept. etcd evaluates a
/// value comparison on a missing key as false, hence the nested
/// transaction that only creates the fence key ([`Answer::FenceCreated`]):
/// the client's write is in the transaction once (etcd's request size
/// limit counts it once), and a write that meets no fence key is never
/// applied by that transaction, so a late one of an old term after the
/// fence key was deleted by hand does not land either.
pub fn fenced(call: Call, body: &[u8], fence_key: &[u8], token: u64) -> Result<Vec<u8>, Malformed> {
    // The client's body goes in as it came, spliced, not parsed into a
    // tree and written out again (that cost a fenced put half again as
    // many instructions); it must be one JSON value, nothing else.
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map_err(|e| bad(format!("the body is not JSON etcd takes: {e}")))?;
    let op = match call {
        Call::Put => "request_put",
        Call::DeleteRange => "request_delete_range",
        Call::Txn => "request_txn",
        Call::Read | Call::Unfenced | Call::Unfenceable => return Err(bad("not a write")),
    };
    // Base64 and decimal digits: nothing in them needs escaping.
    let key = b64(fence_key);
    let set = format!(
        r#"{{"request_put":{{"key":"{key}","value":"{}"}}}}"#,
        b64(token_text(token.into()).as_bytes())
    );
    let mut txn = Vec::with_capacity(body.len() + 2 * set.len() + 512);
    if crate::mutant::planted(crate::mutant::Mutant::EtcdCompareDropped) {
        txn.extend_from_slice(format!(r#"{{"success":[{set},{{"{op}":"#).as_bytes());
        txn.extend_from_slice(body);
        txn.extend_from_slice(b"}]}");
        return Ok(txn);
    }
    let next = b64(token_text(u128::from(token) + 1).as_bytes());
    txn.extend_from_slice(
        format!(
            r#"{{"compare":[{{"key":"{key}","target":"VALUE","result":"LESS","value":"{next}"}}],"success":[{set},{{"{op}":"#
        )
        .as_bytes(),
    );
    txn.extend_from_slice(body);
    txn.extend_from_slice(
        format!(
            r#"}}],"failure":[{{"request_txn":{{"compare":[{{"key":"{key}","target":"CREATE","result":"EQUAL","create_revision":"0"}}],"success":[{set}],"failure":[{{"request_range":{{"key":"{key}"}}}}]}}}}]}}"#
        )
        .as_bytes(),
    );
    Ok(txn)
}

/// What etcd's answer to a [`fenced`] transaction says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The write was carried out: the answer to the call the client made,
    /// shaped as etcd would have answered it (a put's, a range delete's, a
    /// transaction's), with the transaction's header.
    Applied(Vec<u8>),
    /// etcd refused it: the fence key names a later term (its token, if
    /// readable).
    Refused { stored: Option<u64> },
    /// The lease had no fence key: etcd created it, naming this write's
    /// term, and applied nothing else. The same transaction, sent again,
    /// carries the write out.
    FenceCreated,
    /// Not an answer to that transaction.
    Unreadable(String),
}

/// A member of an answer, under its proto name or its JSON name.
fn member<'a>(
    value: &'a serde_json::Value,
    proto: &str,
    json: &str,
) -> Option<&'a serde_json::Value> {
    value.get(proto).or_else(|| value.get(json))
}

/// Whether a transaction's answer says it succeeded (proto3's JSON leaves
/// out a `false`).
fn succeeded(txn: &serde_json::Value) -> bool {
    txn.get("succeeded").and_then(serde_json::Value::as_bool) == Some(true)
}

fn responses(txn: &serde_json::Value) -> &[serde_json::Value] {
    txn.get("responses")
        .and_then(serde_json::Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// Reads etcd's answer `body` to the [`fenced`] transaction of a `call`.
pub fn answer(call: Call, body: &[u8]) -> Answer {
    let unreadable = |why: &str| Answer::Unreadable(why.to_owned());
    let Ok(outer) = serde_json::from_slice::<serde_json::Value>(body) else {
        return unreadable("etcd's answer is not JSON");
    };
    let header = outer.get("header").cloned();
    // The branch that ran: the outer one, or the first write's.
    let ran = if succeeded(&outer) {
        &outer
    } else {
        let Some(nested) = responses(&outer)
            .first()
            .and_then(|r| member(r, "response_txn", "responseTxn"))
        else {
            return unreadable("etcd's answer has no nested transaction");
        };
        if !succeeded(nested) {
            let stored = responses(nested)
                .first()
                .and_then(|r| member(r, "response_range", "responseRange"))
                .and_then(|r| r.get("kvs"))
                .and_then(|kvs| kvs.get(0))
                .and_then(|kv| kv.get("value"))
                .and_then(serde_json::Value::as_str)
                .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok())
                .and_then(|v| String::from_utf8(v).ok())
                .and_then(|v| v.parse().ok());
            return Answer::Refused { stored };
        }
        return Answer::FenceCreated;
    };
    let Some(write) = responses(ran).get(1) else {
        return unreadable("etcd's answer has no answer to the write");
    };
    let (proto, json) = match call {
        Call::Put => ("response_put", "responsePut"),
        Call::DeleteRange => ("response_delete_range", "responseDeleteRange"),
        _ => ("response_txn", "responseTxn"),
    };
    let Some(serde_json::Value::Object(fields)) = member(write, proto, json) else {
        return unreadable("etcd's answer to the write is not the call's");
    };
    let mut shaped = serde_json::Map::new();
    if let Some(header) = header {
        shaped.insert("header".into(), header);
    }
    shaped.extend(
        fields
            .iter()
            .filter(|(k, _)| *k != "header")
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    Answer::Applied(serde_json::Value::Object(shaped).to_string().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn key(s: &str) -> Touched {
        Touched::Key(s.as_bytes().to_vec())
    }

    #[test]
    fn a_write_becomes_a_transaction_on_the_fence_key() {
        let fk = b64("fencegate/fence/orders");
        let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, b64("o/1"), b64("v"));
        let txn: serde_json::Value = serde_json::from_slice(
            &fenced(Call::Put, body.as_bytes(), b"fencegate/fence/orders", 7).unwrap(),
        )
        .unwrap();
        let set =
            serde_json::json!({"request_put": {"key": fk, "value": b64("00000000000000000007")}});
        let write = serde_json::json!({"request_put": {"key": b64("o/1"), "value": b64("v")}});
        assert_eq!(
            txn,
            serde_json::json!({
                "compare": [{"key": fk, "target": "VALUE", "result": "LESS", "value": b64("00000000000000000008")}],
                "success": [set, write],
                "failure": [{"request_txn": {
                    "compare": [{"key": fk, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                    "success": [set],
                    "failure": [{"request_range": {"key": fk}}],
                }}],
            })
        );
        // Text order is number order, up to the largest token.
        assert!(token_text(9) < token_text(10));
        assert!(token_text(u64::MAX.into()) < token_text(u128::from(u64::MAX) + 1));
        assert_eq!(token_text(u128::from(u64::MAX) + 1).len(), 20);
        assert_eq!(txn_path("/v3beta/kv/put"), "/v3beta/kv/txn");
        assert_eq!(txn_path("/%763/kv/put"), "/v3/kv/txn");
    }

    #[test]
    fn etcds_answer_is_shaped_as_the_call_made() {
        let header = r#"{"revision": "9", "raft_term": "2"}"#;
        // Applied by the outer branch.
        let outer = format!(
            r#"{{"header": {header}, "succeeded": true, "responses": [
                {{"response_put": {{"header": {{"revision": "9"}}}}}},
                {{"response_put": {{"header": {{"revision": "9"}}, "prev_kv": {{"key": "bw=="}}}}}}]}}"#
        );
        let shaped = |a: Answer| match a {
            Answer::Applied(b) => serde_json::from_slice::<serde_json::Value>(&b).unwrap(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            shaped(answer(Call::Put, outer.as_bytes())),
            serde_json::json!({"header": {"revision": "9", "raft_term": "2"}, "prev_kv": {"key": "bw=="}})
        );
        // A client's transaction whose own compare failed (proto3 leaves
        // out the false).
        let own_failed = format!(
            r#"{{"header": {header}, "succeeded": true, "responses": [
                {{"response_put": {{}}}},
                {{"response_txn": {{"responses": [{{"response_range": {{"count": "1"}}}}]}}}}]}}"#
        );
        assert_eq!(
            shaped(answer(Call::Txn, own_failed.as_bytes())),
            serde_json::json!({"header": {"revision": "9", "raft_term": "2"}, "responses": [{"response_range": {"count": "1"}}]})
        );
        // A lease's first write: the fence key made, nothing else done.
        let first = format!(
            r#"{{"header": {header}, "responses": [{{"response_txn": {{"succeeded": true, "responses": [
                {{"response_put": {{}}}}]}}}}]}}"#
        );
        assert_eq!(answer(Call::Put, first.as_bytes()), Answer::FenceCreated);
        // Refused: the fence key names token 12.
        let refused = format!(
            r#"{{"header": {header}, "responses": [{{"response_txn": {{"responses": [
                {{"response_range": {{"kvs": [{{"value": "{}"}}]}}}}]}}}}]}}"#,
            b64("00000000000000000012")
        );
        assert_eq!(
            answer(Call::Put, refused.as_bytes()),
            Answer::Refused { stored: Some(12) }
        );
        for unreadable in ["", "[]", r#"{"header": {}}"#, r#"{"succeeded": true}"#] {
            assert!(
                matches!(
                    answer(Call::Put, unreadable.as_bytes()),
                    Answer::Unreadable(_)
                ),
                "{unreadable}"
            );
        }
    }

    #[test]
    fn calls_are_known_by_their_path() {
        for (path, call) in [
            ("/v3/kv/put", Some(Call::Put)),
            ("/v3beta/kv/put", Some(Call::Put)),
            ("/v3alpha/kv/deleterange", Some(Call::DeleteRange)),
            ("/v3/kv/txn", Some(Call::Txn)),
            ("/v3/kv/range", Some(Call::Read)),
            ("/v3/watch", Some(Call::Read)),
            ("/v3/lease/grant", Some(Call::Read)),
            ("/v3/lease/revoke", Some(Call::Unfenceable)),
            ("/v3/kv/lease/revoke", Some(Call::Unfenceable)),
            ("/v3/kv/compaction", Some(Call::Unfenced)),
            ("/v3/auth/enable", Some(Call::Unfenced)),
            ("/v3/maintenance/defragment", Some(Call::Unfenced)),
            ("/v3/election/campaign", Some(Call::Unfenceable)),
            ("/v3/kv/unknown", Some(Call::Unfenceable)),
            ("/v3/lock/lock", Some(Call::Unfenceable)),
            ("/v3/kv/put/", Some(Call::Unfenceable)),
            ("/v3/kv/%70ut", Some(Call::Put)),
            ("/v3/kv/put:", Some(Call::Put)),
            ("/v3beta/kv/txn%3A", Some(Call::Txn)),
            ("/v3/kv/deleterange:", Some(Call::DeleteRange)),
            ("/v3/kv/put::", Some(Call::Unfenceable)),
            ("/v3/kv/put:x", Some(Call::Unfenceable)),
            ("/%763/kv/txn", Some(Call::Txn)),
            ("/v3/kv%2Fdeleterange", Some(Call::DeleteRange)),
            ("/v2/keys/a", None),
            ("/kv/put", None),
        ] {
            assert_eq!(Call::of(path), call, "{path}");
        }
    }

    #[test]
    fn writes_name_the_keys_they_touch() {
        let body = format!(
            r#"{{"key": "{}", "value": "{}"}}"#,
            b64("/app/o/1"),
            b64("v")
        );
        assert_eq!(
            touched(Call::Put, body.as_bytes()),
            Ok(vec![key("/app/o/1")])
        );
        let body = format!(r#"{{"key": "{}"}}"#, b64("/app/o/1"));
        assert_eq!(
            touched(Call::DeleteRange, body.as_bytes()),
            Ok(vec![key("/app/o/1")])
        );
        let body = format!(
            r#"{{"key": "{}", "rangeEnd": "{}"}}"#,
            b64("/app/o/"),
            b64("/app/o0")
        );
        assert_eq!(
            touched(Call::DeleteRange, body.as_bytes()),
            Ok(vec![Touched::Range {
                from: b"/app/o/".to_vec(),
                to: b"/app/o0".to_vec()
            }])
        );
        let body = format!(r#"{{"key": "{}", "range_end": "AA=="}}"#, b64("/app/o/"));
        assert_eq!(
            touched(Call::DeleteRange, body.as_bytes()),
            Ok(vec![Touched::From(b"/app/o/".to_vec())])
        );
        // A transaction, nested, under both spellings; compares and range
        // reads touch nothing.
        let body = format!(
            r#"{{"compare": [{{"key": "{k1}", "target": "VERSION", "result": "EQUAL", "version": "0"}}],
               "success": [{{"request_put": {{"key": "{k1}", "value": "{v}"}}}},
                           {{"requestRange": {{"key": "{k2}"}}}},
                           {{"request_txn": {{"success": [{{"requestDeleteRange": {{"key": "{k2}"}}}}]}}}}],
               "failure": [{{"requestPut": {{"key": "{k3}", "value": "{v}"}}}}]}}"#,
            k1 = b64("/app/o/1"),
            k2 = b64("/app/o/2"),
            k3 = b64("/app/o/3"),
            v = b64("v"),
        );
        assert_eq!(
            touched(Call::Txn, body.as_bytes()),
            Ok(vec![key("/app/o/1"), key("/app/o/2"), key("/app/o/3")])
        );
        let reads = format!(
            r#"{{"success": [{{"request_range": {{"key": "{}"}}}}]}}"#,
            b64("/x")
        );
        assert_eq!(touched(Call::Txn, reads.as_bytes()), Ok(vec![]));
    }

    /// Whatever etcd might read otherwise than fencegate is refused: a
    /// field named twice (under one name or both), a field fencegate does
    /// not know, bytes that are not standard base64, too deep, too many.
    #[test]
    fn what_etcd_might_read_otherwise_is_refused() {
        let k = b64("/app/o/1");
        let many_ops: String = (0..=MAX_OPS)
            .map(|_| format!(r#"{{"request_put": {{"key": "{k}"}}}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let mut nested = format!(r#"{{"request_put": {{"key": "{k}"}}}}"#);
        for _ in 0..MAX_NESTING {
            nested = format!(r#"{{"request_txn": {{"success": [{nested}]}}}}"#);
        }
        for (call, body) in [
            (Call::Put, format!(r#"{{"key": "{k}", "key": "{k}"}}"#)),
            (
                Call::DeleteRange,
                format!(r#"{{"key": "{k}", "range_end": "AA==", "rangeEnd": "AA=="}}"#),
            ),
            (Call::Put, format!(r#"{{"key": "{k}", "keys": "{k}"}}"#)),
            (Call::Put, r#"{"key": "L2FwcC9vLzE"}"#.to_owned()),
            (Call::Put, r#"{"key": "L2FwcC9vLzE_"}"#.to_owned()),
            (Call::Put, r#"{"value": "dg=="}"#.to_owned()),
            (Call::Put, format!(r#"[{{"key": "{k}"}}]"#)),
            (
                Call::Txn,
                format!(
                    r#"{{"success": [{{"request_put": {{"key": "{k}"}}, "request_range": {{"key": "{k}"}}}}]}}"#
                ),
            ),
            (Call::Txn, r#"{"success": [{}]}"#.to_owned()),
            (Call::Txn, format!(r#"{{"success": [{many_ops}]}}"#)),
            (Call::Txn, format!(r#"{{"success": [{nested}]}}"#)),
            (
                Call::Txn,
                format!(r#"{{"compare": [{{"key": "{k}", "bogus": 1}}]}}"#),
            ),
            (Call::Txn, r#"{"success": {"request_put": {}}}"#.to_owned()),
            (Call::Txn, "{".to_owned()),
        ] {
            assert!(touched(call, body.as_bytes()).is_err(), "{body}");
        }
    }
}
