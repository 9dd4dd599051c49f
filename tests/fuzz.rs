//! A property-based fuzz pass over the parsers that see client input: paths
//! (routing and percent-decoding), fencing headers, and the lease API's JSON
//! bodies, all through the whole app. Whatever the input: no panic, an answer
//! below 500, a problem document for every error, and the storage untouched
//! unless the request was a valid fenced write.

mod support;

use proptest::prelude::*;
use support::{Harness, Held, Req};

fn path_segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("orders".to_owned()),
        Just("..".to_owned()),
        Just(".".to_owned()),
        Just(String::new()),
        "%[0-9a-fA-Fzg]{0,2}",
        "[a-zA-Z0-9._~%-]{1,12}",
        "[ -~]{0,8}".prop_map(|s| s.replace(
            [' ', '?', '#', '"', '<', '>', '\\', '^', '`', '{', '|', '}'],
            ""
        )),
    ]
}

fn path() -> impl Strategy<Value = String> {
    let prefix = prop_oneof![
        Just("kv"),
        Just("_fence"),
        Just("_fence/leases"),
        Just("other"),
        Just("")
    ];
    (prefix, proptest::collection::vec(path_segment(), 0..5))
        .prop_map(|(p, segs)| format!("/{p}/{}", segs.join("/")))
}

fn token_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("1".to_owned()),
        Just("0".to_owned()),
        Just("18446744073709551616".to_owned()),
        "[0-9]{1,22}",
        "[ -~]{0,10}",
    ]
}

fn json_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(br#"{"holder":"A","ttl_ms":1000}"#.to_vec()),
        Just(br#"{"ttl_ms":1000}"#.to_vec()),
        Just(br#"{"advance_ms":5}"#.to_vec()),
        "[ -~]{0,40}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..40),
        (any::<i64>(), "[a-z_]{1,10}")
            .prop_map(|(n, k)| format!(r#"{{"holder":"x","{k}":{n}}}"#).into_bytes()),
    ]
}

fn method() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("GET"),
        Just("PUT"),
        Just("POST"),
        Just("DELETE"),
        Just("PATCH"),
        Just("HEAD"),
        Just("MOVE"),
        Just("OPTIONS")
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn no_input_panics_or_escapes_the_contract(
        method in method(),
        path in path(),
        token in proptest::option::of(token_value()),
        lease_id in proptest::option::of(prop_oneof![Just(true), Just(false)]),
        body in json_body(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let h = Harness::new();
            let held: Held = h.acquire("orders", "A", 60_000).await;
            h.store.put("/kv/orders/x", "orig");
            let mut req = Req::new(method, &path).body(body);
            if let Some(t) = &token {
                req = req.header("fencing-token", t);
            }
            match lease_id {
                Some(true) => req = req.header("fencing-lease-id", &held.lease_id),
                Some(false) => req = req.header("fencing-lease-id", "x"),
                None => {}
            }
            let valid_write = token.as_deref() == Some("1") && lease_id == Some(true);
            let r = h.send(req).await;
            prop_assert!(r.status.as_u16() < 500 || r.status == 504, "{} {} -> {}", method, path, r.status);
            if r.status.is_client_error() && method != "HEAD" {
                let ct = r.headers.get("content-type").map(|v| v.to_str().unwrap_or_default().to_owned());
                prop_assert_eq!(ct.as_deref(), Some("application/problem+json"), "{} {} -> {}", method, path, r.status);
            }
            if !valid_write && !path.starts_with("/_fence") {
                prop_assert_eq!(h.store.get("/kv/orders/x").unwrap(), "orig", "{} {} changed the store", method, path);
            }
            Ok(())
        })?;
    }
}
