//! Routes: which lease guards which path.
//!
//! A route pattern is a list of `/`-separated segments: literals, `*` (any one
//! segment) and `{lease}` (any one segment, naming the guarding lease). A
//! pattern matches a path whose leading segments match it, so `/kv/{lease}`
//! guards `/kv/orders` and everything under `/kv/orders/`. A route without
//! `{lease}` names a fixed lease instead. The first matching route wins.
//!
//! Paths are checked before matching: percent-encoding must be well formed and
//! decode to UTF-8, no segment may decode to `.`, `..`, or contain `/`, `\`
//! or NUL, and no segment but the last may be empty (`//`). Such paths are
//! refused rather than normalised, because the backend might normalise them
//! differently (nginx merges slashes) and write to another lease's key.

use std::borrow::Cow;

use smallvec::SmallVec;

use crate::names::LeaseName;

/// One segment of a pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Any,
    Lease,
}

/// Where the lease of a route comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LeaseSource {
    /// The segment at this index.
    Segment(usize),
    /// Always this lease.
    Fixed(LeaseName),
}

/// One compiled route.
#[derive(Clone, Debug)]
pub struct Route {
    pattern: String,
    segments: Vec<Segment>,
    lease: LeaseSource,
    /// Whether reads on this route are fenced like writes.
    pub fence_reads: bool,
    /// The route's own upstream deadline, if it has one.
    pub timeout_ms: Option<u64>,
    /// Replaces the pattern's leading literal segments on the way upstream.
    upstream_prefix: Option<String>,
}

/// A path that matched a route.
#[derive(Debug, PartialEq, Eq)]
pub struct Matched<'r> {
    /// The guarding lease, or the path segment in its place that is not a
    /// lease name.
    pub lease: Result<LeaseName, String>,
    /// The route's pattern, for logs.
    pub pattern: &'r str,
    pub fence_reads: bool,
    pub timeout_ms: Option<u64>,
    /// `(literal segments to drop, prefix to put instead)`, if the route
    /// rewrites paths.
    pub rewrite: Option<(usize, &'r str)>,
}

impl Matched<'_> {
    /// The path and query to send upstream for `raw` (the request's own,
    /// percent-encoding kept as sent).
    pub fn upstream_path(&self, raw_path: &str, query: Option<&str>) -> Option<String> {
        let (drop, prefix) = self.rewrite?;
        let rest: Vec<&str> = raw_path.split('/').skip(1 + drop).collect();
        let mut out = String::with_capacity(raw_path.len() + prefix.len());
        out.push_str(prefix);
        for seg in rest {
            out.push('/');
            out.push_str(seg);
        }
        if out.is_empty() {
            out.push('/');
        }
        if let Some(q) = query {
            out.push('?');
            out.push_str(q);
        }
        Some(out)
    }
}

/// A request extension: the upstream deadline of the request's route, in
/// milliseconds. The upstream client answers 504 when it passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteTimeout(pub u64);

/// A path fencegate refuses to route.
#[derive(Debug, PartialEq, Eq)]
pub struct BadPath(pub &'static str);

impl Route {
    /// Compiles `pattern`; `lease` names a fixed lease for patterns without
    /// `{lease}`.
    pub fn new(pattern: &str, lease: Option<&str>, fence_reads: bool) -> Result<Self, String> {
        let Some(rest) = pattern.strip_prefix('/') else {
            return Err(format!("route pattern {pattern:?} must start with '/'"));
        };
        let segments: Vec<Segment> = rest
            .split('/')
            .map(|s| match s {
                "{lease}" => Segment::Lease,
                "*" => Segment::Any,
                lit => Segment::Literal(lit.to_owned()),
            })
            .collect();
        for s in &segments {
            if let Segment::Literal(lit) = s {
                if lit.is_empty() || lit.contains(['{', '}']) {
                    return Err(format!(
                        "route pattern {pattern:?}: segment {lit:?} is not a literal, '*' or '{{lease}}'"
                    ));
                }
            }
        }
        let captures: Vec<usize> = segments
            .iter()
            .enumerate()
            .filter(|(_, s)| **s == Segment::Lease)
            .map(|(i, _)| i)
            .collect();
        let lease = match (captures.as_slice(), lease) {
            ([i], None) => LeaseSource::Segment(*i),
            ([], Some(name)) => {
                let name = LeaseName::new(name)
                    .map_err(|e| format!("route {pattern:?}: {name:?}: {e}"))?;
                LeaseSource::Fixed(name)
            }
            ([], None) => {
                return Err(format!(
                    "route {pattern:?} has no {{lease}} segment and no fixed lease"
                ))
            }
            (_, _) => {
                return Err(format!(
                "route {pattern:?} must name its lease exactly once ({{lease}} or lease = \"…\")"
            ))
            }
        };
        Ok(Self {
            pattern: pattern.to_owned(),
            segments,
            lease,
            fence_reads,
            timeout_ms: None,
            upstream_prefix: None,
        })
    }

    /// Makes the route rewrite its leading literal segments to `prefix` on
    /// the way upstream (`/keys/{lease}` with `/v2/keys`: `/keys/a/b` goes
    /// upstream as `/v2/keys/a/b`).
    pub fn with_upstream_prefix(mut self, prefix: Option<&str>) -> Result<Self, String> {
        if let Some(p) = prefix {
            if !p.starts_with('/') || p.contains(['?', '#']) {
                return Err(format!(
                    "route {:?}: upstream_prefix {p:?} must be a path starting with '/'",
                    self.pattern
                ));
            }
            self.upstream_prefix = Some(p.trim_end_matches('/').to_owned());
        }
        Ok(self)
    }

    /// Gives the route its own upstream deadline.
    pub fn with_timeout_ms(mut self, timeout_ms: Option<u64>) -> Self {
        self.timeout_ms = timeout_ms;
        self
    }

    fn matches<S: AsRef<str>>(&self, path: &[S]) -> Option<Matched<'_>> {
        if path.len() < self.segments.len() {
            return None;
        }
        for (seg, part) in self.segments.iter().zip(path) {
            if let Segment::Literal(lit) = seg {
                if lit != part.as_ref() {
                    return None;
                }
            }
        }
        let lease = match &self.lease {
            LeaseSource::Segment(i) => {
                let segment = path[*i].as_ref();
                LeaseName::new(segment).map_err(|_| segment.to_owned())
            }
            LeaseSource::Fixed(name) => Ok(name.clone()),
        };
        let literal_prefix = self
            .segments
            .iter()
            .take_while(|s| matches!(s, Segment::Literal(_)))
            .count();
        Some(Matched {
            lease,
            pattern: &self.pattern,
            fence_reads: self.fence_reads,
            timeout_ms: self.timeout_ms,
            rewrite: self.upstream_prefix.as_deref().map(|p| (literal_prefix, p)),
        })
    }
}

/// The route table, in order.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    routes: Vec<Route>,
}

impl Routes {
    pub fn new(routes: Vec<Route>) -> Self {
        Self { routes }
    }

    /// The route guarding `raw_path` (as sent, percent-encoded), `Ok(None)` if
    /// none does, or an error for a path that must not be forwarded at all.
    pub fn resolve(&self, raw_path: &str) -> Result<Option<Matched<'_>>, BadPath> {
        check_no_empty_segments(raw_path)?;
        if raw_path.contains('%') {
            let segments = decode_path(raw_path)?;
            return Ok(self.routes.iter().find_map(|r| r.matches(&segments)));
        }
        // Nothing to decode (the common case): check and match the segments
        // as they are, without copying them.
        let Some(rest) = raw_path.strip_prefix('/') else {
            return Err(BadPath("the path must start with '/'"));
        };
        let mut segments: SmallVec<[&str; 8]> = SmallVec::new();
        for segment in rest.split('/') {
            check_decoded(segment)?;
            segments.push(segment);
        }
        Ok(self.routes.iter().find_map(|r| r.matches(&segments)))
    }
}

/// Decoded path segments; paths of up to eight segments need no allocation.
pub type Segments<'a> = SmallVec<[Cow<'a, str>; 8]>;

/// Splits a raw path into decoded segments, refusing anything ambiguous.
pub fn decode_path(raw_path: &str) -> Result<Segments<'_>, BadPath> {
    check_no_empty_segments(raw_path)?;
    let Some(rest) = raw_path.strip_prefix('/') else {
        return Err(BadPath("the path must start with '/'"));
    };
    let mut segments = Segments::new();
    for raw in rest.split('/') {
        segments.push(decode_segment(raw)?);
    }
    Ok(segments)
}

fn decode_segment(raw: &str) -> Result<Cow<'_, str>, BadPath> {
    if !raw.contains('%') {
        check_decoded(raw)?;
        return Ok(Cow::Borrowed(raw));
    }
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let ok = bytes.len() >= i + 3
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit();
            if !ok {
                return Err(BadPath("the path has a malformed percent-encoding"));
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    let decoded = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| BadPath("the path does not decode to UTF-8"))?;
    check_decoded(&decoded)?;
    Ok(decoded)
}

/// Refuses empty segments before the last (`//x`, `/a//b`): many backends
/// merge the slashes, so such a path could reach a key its route does not
/// name. A trailing slash (an empty last segment) names a collection.
fn check_no_empty_segments(raw_path: &str) -> Result<(), BadPath> {
    if raw_path.contains("//") {
        return Err(BadPath("the path has an empty segment ('//')"));
    }
    Ok(())
}

/// Refuses a decoded segment a backend could read as another path.
fn check_decoded(decoded: &str) -> Result<(), BadPath> {
    if decoded == "." || decoded == ".." {
        return Err(BadPath("the path has a '.' or '..' segment"));
    }
    if decoded.contains(['/', '\\', '\0']) {
        return Err(BadPath("a path segment decodes to '/', '\\' or NUL"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv() -> Routes {
        Routes::new(vec![
            Route::new("/kv/{lease}", None, false).unwrap(),
            Route::new("/jobs/*/state", Some("jobs"), true).unwrap(),
        ])
    }

    fn lease_of(path: &str) -> Option<String> {
        kv().resolve(path).unwrap().map(|m| match m.lease {
            Ok(name) => name.into(),
            Err(segment) => segment,
        })
    }

    #[test]
    fn paths_without_escapes_resolve_as_decoded_ones_do() {
        let routes = kv();
        for path in [
            "/kv/orders",
            "/kv/orders/42",
            "/kv/",
            "/kv",
            "/jobs/7/state",
            "/jobs/7/other",
            "/kv/./x",
            "/kv/../x",
            "/kv/a\\b",
            "/",
            "//",
            "/kv//x",
            "/other/orders",
        ] {
            let slow = decode_path(path).map(|segments| {
                routes
                    .routes
                    .iter()
                    .find_map(|r| r.matches(&segments))
                    .map(|m| m.lease)
            });
            let fast = routes.resolve(path).map(|m| m.map(|m| m.lease));
            assert_eq!(fast, slow, "{path}");
        }
    }

    #[test]
    fn default_route_guards_the_prefix() {
        assert_eq!(lease_of("/kv/orders"), Some("orders".into()));
        assert_eq!(lease_of("/kv/orders/42"), Some("orders".into()));
        assert_eq!(lease_of("/kv/orders/42/x/y"), Some("orders".into()));
        assert_eq!(lease_of("/kv/orders/"), Some("orders".into()));
        assert_eq!(lease_of("/kv/%6Frders/1"), Some("orders".into()));
        assert_eq!(lease_of("/kv"), None);
        assert_eq!(lease_of("/kv2/orders"), None);
        assert_eq!(lease_of("/other/orders"), None);
        assert_eq!(lease_of("/"), None);
        assert_eq!(lease_of("/jobs/7/state"), Some("jobs".into()));
        assert_eq!(lease_of("/jobs/7/other"), None);
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        for bad in [
            "/kv/../payments/1",
            "/kv/orders/%2e%2e/x",
            "/kv/a%2Fb/1",
            "/kv/orders/%zz",
            "/kv/orders/%4",
            "/kv/orders/%ff",
            "/kv/./x",
            "/kv/a%00",
            "/kv/a%5cb",
            "kv/orders",
            "//kv/orders/1",
            "/kv//orders",
            "/kv/orders//1",
            "//",
        ] {
            assert!(kv().resolve(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prefixes_are_rewritten_keeping_the_rest_as_sent() {
        let routes = Routes::new(vec![
            Route::new("/keys/{lease}", None, false)
                .unwrap()
                .with_upstream_prefix(Some("/v2/keys/"))
                .unwrap(),
            Route::new("/root/{lease}", None, false)
                .unwrap()
                .with_upstream_prefix(Some("/"))
                .unwrap(),
        ]);
        let m = routes.resolve("/keys/orders/a%20b").unwrap().unwrap();
        assert_eq!(
            m.upstream_path("/keys/orders/a%20b", Some("x=1"))
                .as_deref(),
            Some("/v2/keys/orders/a%20b?x=1")
        );
        let m = routes.resolve("/root/orders").unwrap().unwrap();
        assert_eq!(
            m.upstream_path("/root/orders", None).as_deref(),
            Some("/orders")
        );
        assert!(kv()
            .resolve("/kv/a")
            .unwrap()
            .unwrap()
            .upstream_path("/kv/a", None)
            .is_none());
        assert!(Route::new("/k/{lease}", None, false)
            .unwrap()
            .with_upstream_prefix(Some("v2"))
            .is_err());
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(Route::new("kv/{lease}", None, false).is_err());
        assert!(Route::new("/kv/{lease}/{lease}", None, false).is_err());
        assert!(Route::new("/kv", None, false).is_err());
        assert!(Route::new("/kv/{lease}", Some("x"), false).is_err());
        assert!(Route::new("/kv/{lea", None, false).is_err());
        assert!(Route::new("/kv//{lease}", None, false).is_err());
        assert!(Route::new("/fixed", Some("bad name"), false).is_err());
    }
}
