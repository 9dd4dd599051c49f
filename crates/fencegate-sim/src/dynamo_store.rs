//! The simulated DynamoDB behind a `dynamodb` route (SPEC §11): items that
//! keep their writer's token, and the one condition fencegate requires of
//! every write (`attribute_not_exists(token) OR token <= :token`),
//! evaluated as DynamoDB evaluates it when it applies the write, however
//! late.
//!
//! The world sends each write of one lease here too, as the `PutItem` body
//! a client sends: most carry the token and its condition, as
//! `fencegate.boto3.fence` adds them; every fourth is a client's that
//! carries neither. The core's check (`fencegate_core::body_keys::
//! dynamodb::check`) decides which fencegate lets through: one it refuses
//! never reaches the table. The checker then asks whether the table
//! applied a write of a term to an item after one of a later term. With
//! the check in place it never does; with it skipped (the
//! `dynamo-condition-unchecked` mutant) an unconditioned late write lands.

use std::collections::BTreeMap;

use fencegate_core::body_keys::dynamodb::{self, Op, Table};

/// The table's items: the token each keeps.
#[derive(Debug, Default)]
pub struct DynamoStore {
    items: BTreeMap<String, u64>,
}

/// The table of the route: `jobs`, partition key `pk`, tokens in
/// `fencing_token`.
pub fn table() -> Table {
    Table {
        name: "jobs".into(),
        partition_key: "pk".into(),
        token_attribute: "fencing_token".into(),
    }
}

/// A client's `PutItem` of item `pk` under `token`, with the token and its
/// condition (`conditioned`) or without.
pub fn put_item(pk: &str, token: u64, conditioned: bool) -> String {
    if !conditioned {
        return format!(r#"{{"TableName": "jobs", "Item": {{"pk": {{"S": "{pk}"}}}}}}"#);
    }
    format!(
        r##"{{"TableName": "jobs",
            "Item": {{"pk": {{"S": "{pk}"}}, "fencing_token": {{"N": "{token}"}}}},
            "ConditionExpression": "{}",
            "ExpressionAttributeNames": {{"{}": "fencing_token"}},
            "ExpressionAttributeValues": {{"{}": {{"N": "{token}"}}}}}}"##,
        dynamodb::CONDITION,
        dynamodb::NAME,
        dynamodb::VALUE,
    )
}

impl DynamoStore {
    /// A `PutItem` of `pk` under `token` reaches the table: `None` if
    /// fencegate refuses it (the core's check), else whether the table
    /// applied it (a conditioned one only if the item keeps no later
    /// token).
    pub fn put(&mut self, pk: &str, token: u64, conditioned: bool) -> Option<bool> {
        let body = put_item(pk, token, conditioned);
        dynamodb::check(Op::PutItem, body.as_bytes(), &[table()], token).ok()?;
        let stored = self.items.get(pk).copied();
        if conditioned && stored.is_some_and(|s| s > token) {
            return Some(false);
        }
        self.items.insert(pk.to_owned(), token);
        Some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conditioned_put_is_refused_after_a_later_term() {
        let mut t = DynamoStore::default();
        assert_eq!(t.put("l2/k0", 5, true), Some(true));
        assert_eq!(t.put("l2/k0", 6, true), Some(true));
        assert_eq!(t.put("l2/k0", 5, true), Some(false));
        assert_eq!(t.put("l2/k0", 6, true), Some(true));
        // fencegate refuses a write without the token and its condition.
        assert_eq!(t.put("l2/k0", 4, false), None);
    }
}
