//! DynamoDB's JSON API (SPEC §11): which operation a request is, by its
//! `X-Amz-Target`, the items a write touches, read from its body, and
//! whether the write carries the term's token so that DynamoDB itself
//! compares it.
//!
//! Every call is `POST /` with the operation in `X-Amz-Target`
//! (`DynamoDB_20120810.PutItem`) and the items in a JSON body that SigV4
//! signs, so fencegate cannot change it: the client writes the token
//! itself ([`check`]). A write of an item carries
//!
//! - the token in the item's token attribute (`PutItem`'s `Item`, an
//!   `UpdateItem`'s `SET #fencegate_token = :fencegate_token`), and
//! - the condition [`CONDITION`] as its `ConditionExpression`, or as one of
//!   the expression's top-level conjuncts (`(…) AND (attribute_not_exists(…)
//!   OR …)`), with `#fencegate_token` naming the token attribute and
//!   `:fencegate_token` the number of the request's token.
//!
//! So DynamoDB applies no write of a term to an item after it applied a
//! write of a later term to it. An item deleted keeps no token, so a late
//! write of an old term would land on its absence: `DeleteItem`, a
//! transaction's `Delete` and `BatchWriteItem` (which takes no condition)
//! are refused; write a tombstone instead.
//!
//! An item's key, for the routes, is `/{table}/{partition key value}`
//! (a string); the table's partition key attribute is configured per
//! table ([`Table`]). Bodies are read strictly: a member fencegate does not
//! know, or one named twice, is refused; so is a table named by its ARN.

use super::json::Json;
use super::Touched;

/// The most items a transaction holds (DynamoDB's own limit).
pub const MAX_TRANSACT_ITEMS: usize = 100;

/// The placeholder of the token attribute's name in the expressions.
pub const NAME: &str = "#fencegate_token";
/// The placeholder of the request's token in the expressions.
pub const VALUE: &str = ":fencegate_token";
/// The condition a write carries: the item has no token yet, or one no
/// later than the request's.
pub const CONDITION: &str =
    "attribute_not_exists(#fencegate_token) OR #fencegate_token <= :fencegate_token";
/// The action an update's `SET` carries.
pub const SET: &str = "#fencegate_token = :fencegate_token";

/// What a request to DynamoDB is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    PutItem,
    UpdateItem,
    DeleteItem,
    BatchWriteItem,
    TransactWriteItems,
    /// An operation that reads, or changes nothing.
    Read,
    /// An operation that changes data and names no item fencegate can
    /// fence (`DeleteTable`, PartiQL, a TTL setting, …).
    Unfenced,
}

impl Op {
    /// The operation `X-Amz-Target` names, if it is DynamoDB's.
    pub fn of(target: &str) -> Option<Op> {
        let name = target.strip_prefix("DynamoDB_20120810.")?;
        Some(match name {
            "PutItem" => Op::PutItem,
            "UpdateItem" => Op::UpdateItem,
            "DeleteItem" => Op::DeleteItem,
            "BatchWriteItem" => Op::BatchWriteItem,
            "TransactWriteItems" => Op::TransactWriteItems,
            "GetItem"
            | "BatchGetItem"
            | "Query"
            | "Scan"
            | "TransactGetItems"
            | "DescribeTable"
            | "ListTables"
            | "DescribeTimeToLive"
            | "DescribeLimits"
            | "DescribeEndpoints"
            | "ListTagsOfResource"
            | "DescribeContinuousBackups"
            | "DescribeContributorInsights"
            | "DescribeKinesisStreamingDestination"
            | "DescribeTableReplicaAutoScaling"
            | "DescribeGlobalTable"
            | "DescribeGlobalTableSettings"
            | "ListGlobalTables"
            | "ListBackups"
            | "DescribeBackup"
            | "ListExports"
            | "DescribeExport"
            | "ListImports"
            | "DescribeImport"
            | "ListContributorInsights"
            | "GetResourcePolicy" => Op::Read,
            _ => Op::Unfenced,
        })
    }

    /// Whether it writes items.
    pub fn writes(self) -> bool {
        !matches!(self, Op::Read | Op::Unfenced)
    }
}

/// A table the routes know: its partition key attribute (a string) and
/// the attribute its items keep their writer's token in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub name: String,
    pub partition_key: String,
    pub token_attribute: String,
}

/// Why a body cannot be read as DynamoDB would read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed(pub String);

fn bad(why: impl Into<String>) -> Malformed {
    Malformed(why.into())
}

/// Why a write does not carry the term's token as DynamoDB must compare
/// it: what to add (SPEC §11: `428 precondition-required`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unfenced(pub String);

/// One write of an item, as read from a body.
struct ItemWrite<'a> {
    kind: Kind,
    table: TableRef<'a>,
    /// The member that holds it (the body, or a transaction's item).
    doc: &'a Json,
}

/// The table a write names: the route's, if a route names it.
#[derive(Clone, Copy)]
struct TableRef<'a> {
    known: Option<&'a Table>,
    name: &'a str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Put,
    Update,
    Delete,
    /// A `BatchWriteItem`'s request.
    Batch,
}

const PUT_ITEM: &[&str] = &[
    "TableName",
    "Item",
    "ConditionExpression",
    "ExpressionAttributeNames",
    "ExpressionAttributeValues",
    "ReturnValues",
    "ReturnConsumedCapacity",
    "ReturnItemCollectionMetrics",
    "ReturnValuesOnConditionCheckFailure",
];
const UPDATE_ITEM: &[&str] = &[
    "TableName",
    "Key",
    "UpdateExpression",
    "ConditionExpression",
    "ExpressionAttributeNames",
    "ExpressionAttributeValues",
    "ReturnValues",
    "ReturnConsumedCapacity",
    "ReturnItemCollectionMetrics",
    "ReturnValuesOnConditionCheckFailure",
];
const DELETE_ITEM: &[&str] = &[
    "TableName",
    "Key",
    "ConditionExpression",
    "ExpressionAttributeNames",
    "ExpressionAttributeValues",
    "ReturnValues",
    "ReturnConsumedCapacity",
    "ReturnItemCollectionMetrics",
    "ReturnValuesOnConditionCheckFailure",
];
const BATCH_WRITE: &[&str] = &[
    "RequestItems",
    "ReturnConsumedCapacity",
    "ReturnItemCollectionMetrics",
];
const TRANSACT_WRITE: &[&str] = &[
    "TransactItems",
    "ReturnConsumedCapacity",
    "ReturnItemCollectionMetrics",
    "ClientRequestToken",
];
const TRANSACT_PUT: &[&str] = &[
    "TableName",
    "Item",
    "ConditionExpression",
    "ExpressionAttributeNames",
    "ExpressionAttributeValues",
    "ReturnValuesOnConditionCheckFailure",
];
const TRANSACT_UPDATE: &[&str] = &[
    "TableName",
    "Key",
    "UpdateExpression",
    "ConditionExpression",
    "ExpressionAttributeNames",
    "ExpressionAttributeValues",
    "ReturnValuesOnConditionCheckFailure",
];
const TRANSACT_DELETE: &[&str] = &[
    "TableName",
    "Key",
    "ConditionExpression",
    "ExpressionAttributeNames",
    "ExpressionAttributeValues",
    "ReturnValuesOnConditionCheckFailure",
];
const TRANSACT_CHECK: &[&str] = TRANSACT_DELETE;

/// `doc`, an object whose every member `known` names.
fn object<'a>(
    doc: &'a Json,
    what: &str,
    known: &[&str],
) -> Result<&'a [(String, Json)], Malformed> {
    let Json::Object(members) = doc else {
        return Err(bad(format!("{what} must be an object, not {}", doc.kind())));
    };
    if let Some((name, _)) = members.iter().find(|(n, _)| !known.contains(&n.as_str())) {
        return Err(bad(format!(
            "{what} has a member DynamoDB's fencing does not know: {name:?}"
        )));
    }
    Ok(members)
}

fn string<'a>(doc: &'a Json, name: &str, what: &str) -> Result<&'a str, Malformed> {
    match doc.get(name) {
        Some(Json::String(s)) => Ok(s),
        Some(other) => Err(bad(format!(
            "{what}'s {name} must be a string, not {}",
            other.kind()
        ))),
        None => Err(bad(format!("{what} has no {name}"))),
    }
}

fn table<'a>(doc: &'a Json, tables: &'a [Table], what: &str) -> Result<TableRef<'a>, Malformed> {
    let name = string(doc, "TableName", what)?;
    table_named(name, tables)
}

/// The table `name` names; a name that is not a table's own (an ARN, or
/// characters DynamoDB does not allow) is refused; a table no route knows
/// is none (its items are items no route guards).
fn table_named<'a>(name: &'a str, tables: &'a [Table]) -> Result<TableRef<'a>, Malformed> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if name.is_empty() || !name.chars().all(allowed) {
        return Err(bad(format!(
            "the table {name:?} is not named by its name (an ARN, or characters a table name cannot have)"
        )));
    }
    Ok(TableRef {
        known: tables.iter().find(|t| t.name == name),
        name,
    })
}

/// The key `/{table}/{partition key value}` of the item `attributes` (an
/// `Item` or a `Key`) names.
fn item_key(attributes: &Json, table: &Table, what: &str) -> Result<Vec<u8>, Malformed> {
    let Json::Object(_) = attributes else {
        return Err(bad(format!("{what} must be an object")));
    };
    let value = attributes.get(&table.partition_key).ok_or_else(|| {
        bad(format!(
            "{what} has no partition key {:?} (table {:?})",
            table.partition_key, table.name
        ))
    })?;
    let pk = match value {
        Json::Object(typed) if typed.len() == 1 && typed[0].0 == "S" => match &typed[0].1 {
            Json::String(s) => s,
            _ => return Err(bad(format!("{what}'s partition key must be a string (S)"))),
        },
        _ => {
            return Err(bad(format!(
                "{what}'s partition key {:?} must be one string value ({{\"S\": …}})",
                table.partition_key
            )))
        }
    };
    Ok(format!("/{}/{pk}", table.name).into_bytes())
}

/// Every item write in a body of `op`, and the tables they name.
fn writes<'a>(op: Op, doc: &'a Json, tables: &'a [Table]) -> Result<Vec<ItemWrite<'a>>, Malformed> {
    let mut out = Vec::new();
    match op {
        Op::PutItem => {
            object(doc, "a PutItem", PUT_ITEM)?;
            out.push(ItemWrite {
                kind: Kind::Put,
                table: table(doc, tables, "a PutItem")?,
                doc,
            });
        }
        Op::UpdateItem => {
            object(doc, "an UpdateItem", UPDATE_ITEM)?;
            out.push(ItemWrite {
                kind: Kind::Update,
                table: table(doc, tables, "an UpdateItem")?,
                doc,
            });
        }
        Op::DeleteItem => {
            object(doc, "a DeleteItem", DELETE_ITEM)?;
            out.push(ItemWrite {
                kind: Kind::Delete,
                table: table(doc, tables, "a DeleteItem")?,
                doc,
            });
        }
        Op::BatchWriteItem => {
            object(doc, "a BatchWriteItem", BATCH_WRITE)?;
            let Some(Json::Object(per_table)) = doc.get("RequestItems") else {
                return Err(bad("a BatchWriteItem's RequestItems must be an object"));
            };
            for (name, requests) in per_table {
                let table = table_named(name, tables)?;
                let Json::Array(requests) = requests else {
                    return Err(bad("a BatchWriteItem's requests must be an array"));
                };
                for request in requests {
                    let members = object(
                        request,
                        "a BatchWriteItem request",
                        &["PutRequest", "DeleteRequest"],
                    )?;
                    if members.len() != 1 {
                        return Err(bad(
                            "a BatchWriteItem request must be one PutRequest or DeleteRequest",
                        ));
                    }
                    out.push(ItemWrite {
                        kind: Kind::Batch,
                        table,
                        doc: &members[0].1,
                    });
                }
            }
        }
        Op::TransactWriteItems => {
            object(doc, "a TransactWriteItems", TRANSACT_WRITE)?;
            let Some(Json::Array(items)) = doc.get("TransactItems") else {
                return Err(bad("a TransactWriteItems's TransactItems must be an array"));
            };
            if items.len() > MAX_TRANSACT_ITEMS {
                return Err(bad(format!(
                    "a transaction holds more than {MAX_TRANSACT_ITEMS} items"
                )));
            }
            for item in items {
                let members = object(
                    item,
                    "a transaction item",
                    &["Put", "Update", "Delete", "ConditionCheck"],
                )?;
                let [(name, inner)] = members else {
                    return Err(bad(
                        "a transaction item must be one Put, Update, Delete or ConditionCheck",
                    ));
                };
                let (kind, known, what) = match name.as_str() {
                    "Put" => (Kind::Put, TRANSACT_PUT, "a transaction's Put"),
                    "Update" => (Kind::Update, TRANSACT_UPDATE, "a transaction's Update"),
                    "Delete" => (Kind::Delete, TRANSACT_DELETE, "a transaction's Delete"),
                    _ => {
                        // A check reads; its members must still be DynamoDB's.
                        object(inner, "a transaction's ConditionCheck", TRANSACT_CHECK)?;
                        continue;
                    }
                };
                object(inner, what, known)?;
                out.push(ItemWrite {
                    kind,
                    table: table(inner, tables, what)?,
                    doc: inner,
                });
            }
        }
        Op::Read | Op::Unfenced => {}
    }
    Ok(out)
}

impl ItemWrite<'_> {
    /// The key of the item it writes (`/{table}` alone for a table no
    /// route names: no route guards it).
    fn key(&self) -> Result<Vec<u8>, Malformed> {
        let Some(table) = self.table.known else {
            return Ok(format!("/{}", self.table.name).into_bytes());
        };
        let (member, what) = match self.kind {
            Kind::Put => ("Item", "a put's Item"),
            Kind::Update | Kind::Delete => ("Key", "a write's Key"),
            Kind::Batch => {
                return match (self.doc.get("Item"), self.doc.get("Key")) {
                    (Some(item), None) => {
                        object(self.doc, "a PutRequest", &["Item"])?;
                        item_key(item, table, "a PutRequest's Item")
                    }
                    (None, Some(key)) => {
                        object(self.doc, "a DeleteRequest", &["Key"])?;
                        item_key(key, table, "a DeleteRequest's Key")
                    }
                    _ => Err(bad("a BatchWriteItem request names an Item or a Key")),
                };
            }
        };
        let attributes = self
            .doc
            .get(member)
            .ok_or_else(|| bad(format!("{what} is missing")))?;
        item_key(attributes, table, what)
    }
}

/// A body read as DynamoDB's JSON, once, for [`touched_in`] and
/// [`check_in`].
pub fn parse(body: &[u8]) -> Result<Json, Malformed> {
    Json::parse(body).map_err(|e| bad(format!("the body is not JSON DynamoDB takes: {e}")))
}

/// What a write of `op` with `body` touches: the key of every item it
/// writes (none for a read).
pub fn touched(op: Op, body: &[u8], tables: &[Table]) -> Result<Vec<Touched>, Malformed> {
    if !op.writes() {
        return Ok(Vec::new());
    }
    touched_in(op, &parse(body)?, tables)
}

/// [`touched`], of a body already [`parse`]d.
pub fn touched_in(op: Op, doc: &Json, tables: &[Table]) -> Result<Vec<Touched>, Malformed> {
    writes(op, doc, tables)?
        .iter()
        .map(|w| w.key().map(Touched::Key))
        .collect()
}

/// Whether every item write of `op` in `body` carries `token` as
/// DynamoDB must compare it; if not, what to add.
pub fn check(op: Op, body: &[u8], tables: &[Table], token: u64) -> Result<(), Unfenced> {
    let doc = parse(body).map_err(|m| Unfenced(m.0))?;
    check_in(op, &doc, tables, token)
}

/// [`check`], of a body already [`parse`]d (one [`touched_in`] read).
pub fn check_in(op: Op, doc: &Json, tables: &[Table], token: u64) -> Result<(), Unfenced> {
    if crate::mutant::planted(crate::mutant::Mutant::DynamoConditionUnchecked) {
        return Ok(());
    }
    let writes = writes(op, doc, tables).map_err(|m| Unfenced(m.0))?;
    let token = token.to_string();
    for w in &writes {
        match w.kind {
            Kind::Delete => {
                return Err(Unfenced(
                    "a deleted item keeps no token, so a late write of an older term would land on its absence: write a tombstone instead (a PutItem or UpdateItem of the item with the token and a mark of your own)".into(),
                ))
            }
            Kind::Batch => {
                return Err(Unfenced(
                    "BatchWriteItem takes no condition, so DynamoDB cannot compare the token: send the writes with TransactWriteItems, or one by one".into(),
                ))
            }
            Kind::Put | Kind::Update => w.carries(&token)?,
        }
    }
    Ok(())
}

/// What every conditioned write must carry, said once.
fn add(table: &Table, token: &str) -> String {
    format!(
        "ConditionExpression \"{CONDITION}\" (alone, or as a top-level conjunct in parentheses), ExpressionAttributeNames {{\"{NAME}\": \"{}\"}} and ExpressionAttributeValues {{\"{VALUE}\": {{\"N\": \"{token}\"}}}}",
        table.token_attribute
    )
}

impl ItemWrite<'_> {
    fn carries(&self, token: &str) -> Result<(), Unfenced> {
        let Some(table) = self.table.known else {
            return Err(Unfenced(format!(
                "no route names the table {:?}",
                self.table.name
            )));
        };
        let missing =
            |what: &str| Unfenced(format!("{what}: the write needs {}", add(table, token)));
        // The names and values the expressions use.
        match self
            .doc
            .get("ExpressionAttributeNames")
            .and_then(|n| n.get(NAME))
        {
            Some(Json::String(name)) if *name == table.token_attribute => {}
            _ => {
                return Err(missing(&format!(
                    "{NAME} does not name {:?}",
                    table.token_attribute
                )))
            }
        }
        if !number_is(
            self.doc
                .get("ExpressionAttributeValues")
                .and_then(|v| v.get(VALUE)),
            token,
        ) {
            return Err(missing(&format!("{VALUE} is not the number {token}")));
        }
        match self.doc.get("ConditionExpression") {
            Some(Json::String(expr)) if requires(expr) => {}
            _ => return Err(missing("the condition does not require the token")),
        }
        match self.kind {
            Kind::Put => {
                let stored = self
                    .doc
                    .get("Item")
                    .and_then(|i| i.get(&table.token_attribute));
                if !number_is(stored, token) {
                    return Err(Unfenced(format!(
                        "the Item's {:?} is not {{\"N\": \"{token}\"}}: the item must keep the token it was written under",
                        table.token_attribute
                    )));
                }
            }
            Kind::Update => {
                let names = self.doc.get("ExpressionAttributeNames");
                match self.doc.get("UpdateExpression") {
                    Some(Json::String(expr)) if sets_token(expr, names, &table.token_attribute) => {
                    }
                    _ => {
                        return Err(Unfenced(format!(
                            "the UpdateExpression must SET {SET} (and no other action on {:?})",
                            table.token_attribute
                        )))
                    }
                }
            }
            Kind::Delete | Kind::Batch => {}
        }
        Ok(())
    }
}

/// Whether `value` is `{"N": token}`.
fn number_is(value: Option<&Json>, token: &str) -> bool {
    matches!(value, Some(Json::Object(typed))
        if typed.len() == 1 && typed[0].0 == "N" && typed[0].1 == Json::String(token.to_owned()))
}

/// An expression's tokens: names, placeholders, numbers and keywords as
/// words; parentheses, commas, brackets, dots and operators as symbols.
fn tokens(expr: &str) -> Option<Vec<&str>> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let start = i;
        if c.is_ascii_alphanumeric() || matches!(c, b'_' | b'#' | b':') {
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric()
                    || matches!(bytes[i], b'_' | b'#' | b':' | b'-'))
            {
                i += 1;
            }
        } else if matches!(c, b'<' | b'>') {
            i += 1;
            if i < bytes.len() && matches!(bytes[i], b'=' | b'>') {
                i += 1;
            }
        } else if matches!(
            c,
            b'(' | b')' | b',' | b'=' | b'[' | b']' | b'.' | b'+' | b'-'
        ) {
            i += 1;
        } else {
            return None;
        }
        out.push(&expr[start..i]);
    }
    Some(out)
}

fn keyword(token: &str, word: &str) -> bool {
    token.eq_ignore_ascii_case(word)
}

/// Whether the condition `expr` requires [`CONDITION`]: it is the whole
/// expression, or a top-level conjunct in parentheses (an `AND` at depth
/// 0, not a `BETWEEN`'s, with no `OR` at depth 0 anywhere).
pub fn requires(expr: &str) -> bool {
    let (Some(all), Some(wanted)) = (tokens(expr), tokens(CONDITION)) else {
        return false;
    };
    let same = |part: &[&str]| {
        part.len() == wanted.len()
            && part.iter().zip(&wanted).all(|(a, b)| {
                if keyword(b, "OR") {
                    keyword(a, "OR")
                } else {
                    a == b
                }
            })
    };
    if same(&all) {
        return true;
    }
    let mut depth = 0i32;
    let mut between = false;
    let mut start = 0;
    let mut conjuncts = Vec::new();
    for (i, t) in all.iter().enumerate() {
        match *t {
            "(" => depth += 1,
            ")" => depth -= 1,
            _ if depth != 0 => {}
            t if keyword(t, "OR") => return false,
            t if keyword(t, "BETWEEN") => between = true,
            t if keyword(t, "AND") && between => between = false,
            t if keyword(t, "AND") => {
                conjuncts.push(&all[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return false;
        }
    }
    conjuncts.push(&all[start..]);
    depth == 0
        && conjuncts.iter().any(|c| {
            c.len() == wanted.len() + 2
                && c[0] == "("
                && c[c.len() - 1] == ")"
                && same(&c[1..c.len() - 1])
        })
}

/// Whether the update `expr` has the action [`SET`] in its `SET` clause,
/// and no other action on `attribute` (by its name, or a placeholder of
/// `names` for it).
pub fn sets_token(expr: &str, names: Option<&Json>, attribute: &str) -> bool {
    let Some(all) = tokens(expr) else {
        return false;
    };
    let clause = |t: &str| {
        ["SET", "REMOVE", "ADD", "DELETE"]
            .iter()
            .any(|k| keyword(t, k))
    };
    let wanted = tokens(SET).unwrap_or_default();
    let names_it = |t: &str| {
        t == attribute
            || (t.starts_with('#')
                && matches!(names.and_then(|n| n.get(t)), Some(Json::String(s)) if s == attribute))
    };
    let mut found = false;
    let mut in_set = false;
    let mut depth = 0i32;
    // Each action starts after a clause keyword or a comma at depth 0; its
    // first token is the path it acts on.
    let mut action_start = None;
    let mut i = 0;
    while i < all.len() {
        let t = all[i];
        if depth == 0 && clause(t) {
            in_set = keyword(t, "SET");
            action_start = Some(i + 1);
        } else if depth == 0 && t == "," {
            action_start = Some(i + 1);
        } else if t == "(" {
            depth += 1;
        } else if t == ")" {
            depth -= 1;
        }
        if action_start == Some(i) && names_it(t) {
            let action = &all[i..(i + wanted.len()).min(all.len())];
            let ends = all
                .get(i + wanted.len())
                .is_none_or(|n| *n == "," || clause(n));
            if in_set && action == wanted.as_slice() && ends && !found {
                found = true;
            } else {
                return false;
            }
        }
        // Elsewhere the attribute is read in a value (`SET a =
        // #fencegate_token`): harmless.
        i += 1;
    }
    found && depth == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobs() -> Vec<Table> {
        vec![Table {
            name: "jobs".into(),
            partition_key: "pk".into(),
            token_attribute: "fencing_token".into(),
        }]
    }

    fn put(pk: &str, token: &str, condition: &str) -> String {
        format!(
            r##"{{"TableName": "jobs", "Item": {{"pk": {{"S": "{pk}"}}, "fencing_token": {{"N": "{token}"}}}},
                "ConditionExpression": "{condition}",
                "ExpressionAttributeNames": {{"#fencegate_token": "fencing_token"}},
                "ExpressionAttributeValues": {{":fencegate_token": {{"N": "{token}"}}}}}}"##
        )
    }

    #[test]
    fn operations_are_known_by_their_target() {
        assert_eq!(Op::of("DynamoDB_20120810.PutItem"), Some(Op::PutItem));
        assert_eq!(Op::of("DynamoDB_20120810.Query"), Some(Op::Read));
        assert_eq!(Op::of("DynamoDB_20120810.DeleteTable"), Some(Op::Unfenced));
        assert_eq!(
            Op::of("DynamoDB_20120810.ExecuteStatement"),
            Some(Op::Unfenced)
        );
        assert_eq!(Op::of("DynamoDB_20120810.putitem"), Some(Op::Unfenced));
        assert_eq!(Op::of("S3.PutObject"), None);
    }

    #[test]
    fn writes_name_their_items() {
        let t = jobs();
        let key = |k: &str| Touched::Key(k.as_bytes().to_vec());
        let body = put("orders/1", "7", CONDITION);
        assert_eq!(
            touched(Op::PutItem, body.as_bytes(), &t),
            Ok(vec![key("/jobs/orders/1")])
        );
        let body = r#"{"TransactItems": [
            {"Put": {"TableName": "jobs", "Item": {"pk": {"S": "a/1"}}}},
            {"ConditionCheck": {"TableName": "jobs", "Key": {"pk": {"S": "b/1"}}, "ConditionExpression": "x"}},
            {"Update": {"TableName": "jobs", "Key": {"pk": {"S": "a/2"}}, "UpdateExpression": "SET v = :v"}}]}"#;
        assert_eq!(
            touched(Op::TransactWriteItems, body.as_bytes(), &t),
            Ok(vec![key("/jobs/a/1"), key("/jobs/a/2")])
        );
        let body =
            r#"{"RequestItems": {"jobs": [{"DeleteRequest": {"Key": {"pk": {"S": "a/1"}}}}]}}"#;
        assert_eq!(
            touched(Op::BatchWriteItem, body.as_bytes(), &t),
            Ok(vec![key("/jobs/a/1")])
        );
        // A table no route names: its items are under no route.
        let body = r#"{"TableName": "other", "Item": {"pk": {"S": "a"}}}"#;
        assert_eq!(
            touched(Op::PutItem, body.as_bytes(), &t),
            Ok(vec![key("/other")])
        );
        for bad in [
            r#"{"TableName": "jobs", "Item": {"pk": {"N": "1"}}}"#,
            r#"{"TableName": "jobs", "Item": {"pk": {"S": "a", "N": "1"}}}"#,
            r#"{"TableName": "jobs", "Item": {"other": {"S": "a"}}}"#,
            r#"{"TableName": "arn:aws:dynamodb:us-east-1:1:table/jobs", "Item": {"pk": {"S": "a"}}}"#,
            r#"{"TableName": "jobs", "Item": {"pk": {"S": "a"}}, "Expected": {}}"#,
            r#"{"TableName": "jobs", "Item": {"pk": {"S": "a"}}, "tableName": "x"}"#,
            r#"{"TableName": "jobs", "TableName": "jobs", "Item": {"pk": {"S": "a"}}}"#,
        ] {
            assert!(touched(Op::PutItem, bad.as_bytes(), &t).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_write_must_carry_the_token_and_its_condition() {
        let t = jobs();
        let ok = |body: &str, op: Op| check(op, body.as_bytes(), &t, 7);
        assert_eq!(ok(&put("a/1", "7", CONDITION), Op::PutItem), Ok(()));
        let wrapped = format!("(attribute_exists(v)) AND ({CONDITION})");
        assert_eq!(ok(&put("a/1", "7", &wrapped), Op::PutItem), Ok(()));
        let between = format!("v BETWEEN :a AND :b and ({CONDITION})");
        assert_eq!(ok(&put("a/1", "7", &between), Op::PutItem), Ok(()));
        for bad in [
            put("a/1", "6", CONDITION),
            put("a/1", "07", CONDITION),
            put("a/1", "7", "attribute_not_exists(#fencegate_token)"),
            put("a/1", "7", &format!("attribute_exists(v) OR ({CONDITION})")),
            put("a/1", "7", &format!("NOT ({CONDITION})")),
            put("a/1", "7", &format!("v BETWEEN :a AND ({CONDITION})")),
            put("a/1", "7", &format!("attribute_exists(v) AND {CONDITION}")),
            put("a/1", "7", "#fencegate_token <= :fencegate_token"),
        ] {
            assert!(ok(&bad, Op::PutItem).is_err(), "{bad}");
        }
        let update = |set: &str| {
            format!(
                r##"{{"TableName": "jobs", "Key": {{"pk": {{"S": "a/1"}}}}, "UpdateExpression": "{set}",
                    "ConditionExpression": "{CONDITION}",
                    "ExpressionAttributeNames": {{"#fencegate_token": "fencing_token", "#t": "fencing_token"}},
                    "ExpressionAttributeValues": {{":fencegate_token": {{"N": "7"}}}}}}"##
            )
        };
        for good in [
            "SET #fencegate_token = :fencegate_token",
            "SET v = :v, #fencegate_token = :fencegate_token REMOVE w",
            "ADD n :one SET #fencegate_token = :fencegate_token, w = list_append(w, :l)",
        ] {
            assert_eq!(ok(&update(good), Op::UpdateItem), Ok(()), "{good}");
        }
        for bad in [
            "SET v = :v",
            "SET #fencegate_token = :fencegate_token + :one",
            "REMOVE #fencegate_token",
            "SET #fencegate_token = :fencegate_token REMOVE #t",
            "SET #fencegate_token = :fencegate_token, fencing_token = :x",
            "ADD #fencegate_token :fencegate_token",
        ] {
            assert!(ok(&update(bad), Op::UpdateItem).is_err(), "{bad}");
        }
        let delete = r#"{"TableName": "jobs", "Key": {"pk": {"S": "a/1"}}}"#;
        assert!(ok(delete, Op::DeleteItem).is_err());
        let batch = format!(
            r#"{{"RequestItems": {{"jobs": [{{"PutRequest": {}}}]}}}}"#,
            put("a/1", "7", CONDITION)
        );
        assert!(ok(&batch, Op::BatchWriteItem).is_err());
    }
}
