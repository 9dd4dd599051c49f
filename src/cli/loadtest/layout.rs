//! Where the load test writes and what it writes: the path template
//! (`--path`), the body template (`--body`) and the value that names a write.
//!
//! Every write has a key of its own, its write id (`{run}-w{writer}-{n}`),
//! or one of the two keys of its term that consecutive terms of a lease share
//! (`{run}-{lease}-h{token}`: a term writes its own and the one of the term
//! before it). The value names the write: `fencegate-loadtest.{write id}.t{token}.`,
//! made of letters, digits, `-` and `.` only, so it passes unchanged through
//! a form encoding, a JSON string or an XML text, and is found again in
//! whatever the storage answers a read with.

use super::LoadtestError;

/// What starts every value the load test writes.
const VALUE_PREFIX: &str = "fencegate-loadtest.";

/// The value of write `write_id` of the term with `token`.
pub fn value(write_id: &str, token: u64) -> String {
    format!("{VALUE_PREFIX}{write_id}.t{token}.")
}

/// The first value the load test wrote found in a read's body: its write id
/// and token.
pub fn find_value(body: &[u8]) -> Option<(String, u64)> {
    let text = String::from_utf8_lossy(body);
    let mut rest = text.as_ref();
    while let Some(at) = rest.find(VALUE_PREFIX) {
        rest = &rest[at + VALUE_PREFIX.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'))
            .unwrap_or(rest.len());
        if let Some(found) = parse_value(&rest[..end]) {
            return Some(found);
        }
    }
    None
}

/// `{write id}.t{token}.` back into its parts.
fn parse_value(text: &str) -> Option<(String, u64)> {
    let text = text.strip_suffix('.')?;
    let (id, token) = text.rsplit_once(".t")?;
    if id.is_empty() || id.contains('.') {
        return None;
    }
    Some((id.to_owned(), token.parse().ok()?))
}

/// The key term `token` of `lease` shares with the term after it (and the
/// first term the run saw of a lease, `token` 0, with the start).
pub fn handoff_key(run_id: &str, lease: &str, token: u64) -> String {
    format!("{run_id}-{lease}-h{token}")
}

/// `--path`: a request path with `{lease}` and `{key}` in it, each once, in
/// the path (not the query).
#[derive(Clone, Debug)]
pub struct PathTemplate(String);

impl PathTemplate {
    /// Checks `template`: it starts with `/`, names `{lease}` and `{key}` once
    /// each, in the path, and no other `{…}`.
    pub fn parse(template: &str) -> Result<Self, LoadtestError> {
        let fail = |why: &str| Err(LoadtestError::Usage(format!("--path {template:?}: {why}")));
        if !template.starts_with('/') {
            return fail("must start with /");
        }
        let path = template.split('?').next().unwrap_or_default();
        for part in ["{lease}", "{key}"] {
            if path.matches(part).count() != 1 {
                return fail(&format!("must name {part} once, in the path"));
            }
        }
        let rest = template.replace("{lease}", "").replace("{key}", "");
        if rest.contains(['{', '}']) {
            return fail("knows only {lease} and {key}");
        }
        if template.contains(|c: char| c.is_ascii_whitespace() || c.is_ascii_control()) {
            return fail("has a space or a control character");
        }
        Ok(Self(template.to_owned()))
    }

    /// Whether the path begins with a fixed first segment (a DynamoDB
    /// table's name), has more after it, and no query.
    pub fn names_a_table(&self) -> bool {
        let path = &self.0[1..];
        !path.contains('?')
            && path.split_once('/').is_some_and(|(table, rest)| {
                !table.is_empty() && !table.contains('{') && !rest.is_empty()
            })
    }

    /// The path of `key` of `lease`.
    pub fn render(&self, lease: &str, key: &str) -> String {
        self.0.replace("{lease}", lease).replace("{key}", key)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `--body`: the request body, with `{value}` where the write's value goes.
#[derive(Clone, Debug)]
pub struct BodyTemplate(String);

impl BodyTemplate {
    pub fn parse(template: &str) -> Result<Self, LoadtestError> {
        if template.matches("{value}").count() != 1 {
            return Err(LoadtestError::Usage(format!(
                "--body {template:?}: must name {{value}} once"
            )));
        }
        Ok(Self(template.to_owned()))
    }

    pub fn render(&self, value: &str) -> String {
        self.0.replace("{value}", value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_found_again_in_what_storages_answer() {
        let v = value("r0badf00d-w3-17", 42);
        let found = Some(("r0badf00d-w3-17".to_owned(), 42));
        // The body itself, a form field, etcd's v2 JSON, an XML text.
        assert_eq!(find_value(v.as_bytes()), found);
        for wrapped in [
            format!("value={v}"),
            format!(r#"{{"action":"get","node":{{"key":"/lt-0/x","value":"{v}"}}}}"#),
            format!("<Value>{v}</Value>"),
        ] {
            assert_eq!(find_value(wrapped.as_bytes()), found, "{wrapped}");
        }
        // A prefix of another write's id is not that write.
        assert_eq!(
            find_value(value("r1-w3-1", 7).as_bytes()),
            Some(("r1-w3-1".to_owned(), 7))
        );
        for bad in [
            "",
            "fencegate-loadtest.",
            "fencegate-loadtest.x.t.",
            "x.t1.",
        ] {
            assert_eq!(find_value(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn path_templates_name_the_lease_and_the_key_once() {
        let t = PathTemplate::parse("/dav/{lease}/{key}").unwrap();
        assert_eq!(t.render("lt-0", "r1-h2"), "/dav/lt-0/r1-h2");
        let t = PathTemplate::parse("/b/{lease}/{key}?x-id=PutObject").unwrap();
        assert_eq!(t.render("a", "k"), "/b/a/k?x-id=PutObject");
        for bad in [
            "kv/{lease}/{key}",
            "/kv/{key}",
            "/kv/{lease}/{lease}/{key}",
            "/kv/{lease}?k={key}",
            "/kv/{lease}/{key}/{other}",
            "/kv/{lease}/ {key}",
        ] {
            assert!(PathTemplate::parse(bad).is_err(), "{bad}");
        }
        assert!(BodyTemplate::parse("value={value}").is_ok());
        assert!(BodyTemplate::parse("value").is_err());
    }
}
