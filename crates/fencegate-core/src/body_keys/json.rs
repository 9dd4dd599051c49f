//! A JSON document read strictly, for the bodies fencegate must understand
//! exactly as the storage will: an object that names a member twice is
//! refused (which of the two a storage takes is its own), and so is any
//! value deeper than [`MAX_DEPTH`]. Strings stay as they are; numbers,
//! booleans and nulls are kept only as what they are.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

/// How deep a value may be (objects and arrays inside each other).
pub const MAX_DEPTH: usize = 32;

/// A JSON value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Json {
    /// An object's members, in order, each name once.
    Object(Vec<(String, Json)>),
    Array(Vec<Json>),
    String(String),
    /// A number, as written.
    Number(String),
    Bool(bool),
    Null,
}

impl Json {
    /// Reads `bytes` as one JSON document.
    pub fn parse(bytes: &[u8]) -> Result<Json, String> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let value = Depth(0).deserialize(&mut de).map_err(|e| e.to_string())?;
        de.end().map_err(|e| e.to_string())?;
        Ok(value)
    }

    /// The member `name` of an object.
    pub fn get(&self, name: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.iter().find(|(n, _)| n == name).map(|(_, v)| v),
            _ => None,
        }
    }

    /// What kind of value it is, in words.
    pub fn kind(&self) -> &'static str {
        match self {
            Json::Object(_) => "an object",
            Json::Array(_) => "an array",
            Json::String(_) => "a string",
            Json::Number(_) => "a number",
            Json::Bool(_) => "a boolean",
            Json::Null => "null",
        }
    }
}

/// Reads a value `0`-deep as [`Json`].
struct Depth(usize);

impl<'de> DeserializeSeed<'de> for Depth {
    type Value = Json;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        if self.0 > MAX_DEPTH {
            return Err(de::Error::custom(format!(
                "values nest deeper than {MAX_DEPTH}"
            )));
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Depth {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Number(v.to_string()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Number(v.to_string()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Number(v.to_string()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Depth(self.0 + 1))? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members: Vec<(String, Json)> = Vec::new();
        // Names seen, for an object too large to search in a line: a
        // hostile body of many members costs linear time, not quadratic.
        let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            let twice = if members.len() < 16 {
                members.iter().any(|(n, _)| *n == name)
            } else {
                if seen.is_empty() {
                    seen.extend(members.iter().map(|(n, _)| n.clone()));
                }
                !seen.insert(name.clone())
            };
            if twice {
                return Err(de::Error::custom(format!(
                    "the member {name:?} is named twice"
                )));
            }
            let value = map.next_value_seed(Depth(self.0 + 1))?;
            members.push((name, value));
        }
        Ok(Json::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_read_strictly() {
        let v = Json::parse(br#"{"a": [1, "x", true, null], "b": {"c": -2.5}}"#).unwrap();
        assert_eq!(
            v.get("b").and_then(|b| b.get("c")),
            Some(&Json::Number("-2.5".into()))
        );
        // A name twice among many, found in linear time.
        let many: Vec<String> = (0..100_000).map(|i| format!(r#""m{i}": 0"#)).collect();
        let doc = format!("{{{}}}", many.join(","));
        assert!(Json::parse(doc.as_bytes()).is_ok());
        let doc = format!(r#"{{{}, "m99999": 1}}"#, many.join(","));
        assert!(Json::parse(doc.as_bytes()).is_err());
        for bad in [
            &br#"{"a": 1, "a": 2}"#[..],
            br#"{"a": 1} x"#,
            br#"{"a": "#,
            b"",
            br#"{"a": "\ud800"}"#,
        ] {
            assert!(
                Json::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 2), "]".repeat(MAX_DEPTH + 2));
        assert!(Json::parse(deep.as_bytes()).is_err());
        let fine = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(Json::parse(fine.as_bytes()).is_ok());
    }
}
