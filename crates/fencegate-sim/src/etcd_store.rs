//! The simulated etcd behind an `etcd-v3` route (SPEC §11): a key-value
//! store that runs the transactions fencegate's core builds
//! (`fencegate_core::body_keys::etcd::fenced`) as etcd does: each
//! comparison on a key's value (bytes, compared as etcd does) or creation
//! revision, then the branch it picks: puts, reads, nested transactions.
//!
//! The world sends each write of one lease here too, built by the core
//! around a put of the write's key, and applies it when the storage
//! applies the write, however late; the checker then asks whether etcd
//! applied a write of a term after it applied one of a later term of the
//! same lease. With the comparison in place it never does; with it dropped
//! (the `etcd-compare-dropped` mutant) a late write lands.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde_json::Value;

/// What a transaction did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ran {
    /// The keys it put, in order.
    pub puts: Vec<Vec<u8>>,
}

/// The keys and their values; a key's creation revision is non-zero once
/// it exists.
#[derive(Debug, Default)]
pub struct EtcdStore {
    kv: BTreeMap<Vec<u8>, Vec<u8>>,
}

fn bytes(v: Option<&Value>) -> Vec<u8> {
    v.and_then(Value::as_str)
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
        .unwrap_or_default()
}

impl EtcdStore {
    /// Runs the transaction `txn` (etcd's JSON gateway's form).
    pub fn run(&mut self, txn: &[u8]) -> Ran {
        let txn: Value = serde_json::from_slice(txn).expect("the core builds JSON");
        let mut ran = Ran::default();
        self.txn(&txn, &mut ran);
        ran
    }

    fn txn(&mut self, txn: &Value, ran: &mut Ran) {
        let holds = txn
            .get("compare")
            .and_then(Value::as_array)
            .is_none_or(|all| all.iter().all(|c| self.compare(c)));
        let branch = if holds { "success" } else { "failure" };
        for op in txn
            .get(branch)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(put) = op.get("request_put") {
                let key = bytes(put.get("key"));
                self.kv.insert(key.clone(), bytes(put.get("value")));
                ran.puts.push(key);
            } else if let Some(nested) = op.get("request_txn") {
                self.txn(nested, ran);
            }
            // Reads change nothing.
        }
    }

    /// One comparison, as etcd evaluates it: a value comparison on a
    /// missing key is false; a missing key's creation revision is 0.
    fn compare(&self, c: &Value) -> bool {
        let stored = self.kv.get(&bytes(c.get("key")));
        let result = c.get("result").and_then(Value::as_str).unwrap_or("EQUAL");
        let order = match c.get("target").and_then(Value::as_str) {
            Some("VALUE") => match stored {
                None => return false,
                Some(v) => v.as_slice().cmp(&bytes(c.get("value"))),
            },
            Some("CREATE") => {
                let revision = u64::from(stored.is_some());
                let wanted: u64 = c
                    .get("create_revision")
                    .and_then(Value::as_str)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                revision.cmp(&wanted)
            }
            other => panic!("a comparison the core does not build: {other:?}"),
        };
        match result {
            "EQUAL" => order.is_eq(),
            "LESS" => order.is_lt(),
            "GREATER" => order.is_gt(),
            "NOT_EQUAL" => order.is_ne(),
            other => panic!("a comparison the core does not build: {other}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencegate_core::body_keys::etcd::{fenced, Call};

    fn put(key: &str) -> Vec<u8> {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        format!(r#"{{"key": "{}", "value": "{}"}}"#, b64(key), b64("v")).into_bytes()
    }

    #[test]
    fn the_cores_transactions_run_as_etcd_runs_them() {
        let mut etcd = EtcdStore::default();
        let fk = b"fencegate/fence/l2";
        let write = |token| fenced(Call::Put, &put("/l2/k0"), fk, token).unwrap();
        // The first write only makes the fence key; sent again, it lands.
        assert_eq!(etcd.run(&write(5)).puts, vec![fk.to_vec()]);
        assert_eq!(
            etcd.run(&write(5)).puts,
            vec![fk.to_vec(), b"/l2/k0".to_vec()]
        );
        // A later term's write lands; then an earlier one's does not, and
        // tokens compare as numbers (9 < 10).
        assert_eq!(etcd.run(&write(10)).puts.len(), 2);
        assert_eq!(etcd.run(&write(9)).puts, Vec::<Vec<u8>>::new());
        assert_eq!(etcd.run(&write(10)).puts.len(), 2);
    }
}
