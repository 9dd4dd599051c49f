//! DynamoDB's API as the tests speak it to moto's server: calls shaped as
//! boto3 sends them, tables, and the writes fencegate fences (SPEC §11).

use serde_json::{json, Value};

use super::{HttpClient, Req};

/// The condition a fenced write carries.
pub const CONDITION: &str =
    "attribute_not_exists(#fencegate_token) OR #fencegate_token <= :fencegate_token";

/// A DynamoDB call as boto3 sends it (moto reads the service and region
/// from the credential scope; it checks no signature).
pub fn call(op: &str, body: Value) -> Req {
    Req::new("POST", "/")
        .header("x-amz-target", &format!("DynamoDB_20120810.{op}"))
        .header("content-type", "application/x-amz-json-1.0")
        .header(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=test/20261207/us-east-1/dynamodb/aws4_request, SignedHeaders=host;x-amz-date, Signature=00",
        )
        .body(body.to_string())
}

/// Creates table `name` (partition key `pk`, a string) straight at moto.
pub async fn create_table(direct: &HttpClient, name: &str) {
    let r = direct
        .send(call(
            "CreateTable",
            json!({
                "TableName": name,
                "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}],
                "AttributeDefinitions": [{"AttributeName": "pk", "AttributeType": "S"}],
                "BillingMode": "PAY_PER_REQUEST",
            }),
        ))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A PutItem of `pk` in `jobs` with `attrs` beside it, carrying `token` in
/// the item (`fencing_token`) and, if `conditioned`, the condition on it.
pub fn put(pk: &str, attrs: Value, token: u64, conditioned: bool) -> Value {
    let token = json!({"N": token.to_string()});
    let mut item = json!({"pk": {"S": pk}, "fencing_token": token});
    if let (Some(item), Value::Object(attrs)) = (item.as_object_mut(), attrs) {
        item.extend(attrs);
    }
    let mut body = json!({"TableName": "jobs", "Item": item});
    if conditioned {
        body["ConditionExpression"] = CONDITION.into();
        body["ExpressionAttributeNames"] = json!({"#fencegate_token": "fencing_token"});
        body["ExpressionAttributeValues"] = json!({":fencegate_token": token});
    }
    body
}

/// The item `pk` of `jobs` as moto holds it.
pub async fn item(direct: &HttpClient, pk: &str) -> Option<Value> {
    let r = direct
        .send(call(
            "GetItem",
            json!({"TableName": "jobs", "Key": {"pk": {"S": pk}}}),
        ))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json().get("Item").cloned()
}
