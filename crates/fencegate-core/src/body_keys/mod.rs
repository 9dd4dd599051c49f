//! Stores that name the key in the body (SPEC §11): the one place that
//! turns such a request into the keys it writes ([`etcd`] for etcd's v3
//! JSON gateway), and the routes that map a key to the lease that guards
//! it ([`KeyRoutes`]).
//!
//! A write is fenced by one lease: every key it touches must belong to the
//! same lease, a range of keys must lie inside that lease's keys, and a key
//! no route guards is refused. What is refused is refused before the
//! storage sees a byte (the shell reads the whole body first, within the
//! body limit).
//!
//! Keys are matched as bytes, not as URL paths: `/app/orders/%41` is the
//! key with those seven bytes after `orders/`, and a key is split at `/`
//! only.

pub mod dynamodb;
pub mod etcd;
pub mod json;

use crate::names::LeaseName;

/// What a write touches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Touched {
    /// One key.
    Key(Vec<u8>),
    /// Every key from `from` (included) to `to` (excluded).
    Range { from: Vec<u8>, to: Vec<u8> },
    /// Every key from `from` on (etcd's `range_end` of one zero byte).
    From(Vec<u8>),
}

/// A pattern of keys: `/`-separated segments, each a literal, `*` (any one
/// segment) or `{lease}` (any one segment, naming the lease). It matches a
/// key whose leading segments match it: `/app/{lease}` matches `/app/orders`
/// and `/app/orders/42`. A pattern that starts with `/` matches keys that
/// do (`/registry/…`), one that does not matches keys that do not
/// (`app/{lease}` matches `app/orders/42`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyPattern {
    segments: Vec<Segment>,
    /// The lease every key it matches is guarded by, for a pattern without
    /// `{lease}`.
    fixed: Option<LeaseName>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(Vec<u8>),
    Any,
    Lease,
}

/// Why a key pattern cannot be used.
#[derive(Debug, PartialEq, Eq)]
pub struct BadPattern(pub &'static str);

impl KeyPattern {
    /// `pattern`, with `lease` for one without `{lease}`.
    pub fn new(pattern: &str, lease: Option<LeaseName>) -> Result<Self, BadPattern> {
        // A leading `/` is an empty first segment, which matches the empty
        // part before a key's leading `/`.
        let segments: Vec<Segment> = pattern
            .split('/')
            .map(|s| match s {
                "*" => Segment::Any,
                "{lease}" => Segment::Lease,
                s => Segment::Literal(s.as_bytes().to_vec()),
            })
            .collect();
        let empty = |s: &Segment| *s == Segment::Literal(Vec::new());
        if segments.len() == 1 && empty(&segments[0]) || segments[1..].iter().any(empty) {
            return Err(BadPattern("a key pattern has no empty segment"));
        }
        let leases = segments.iter().filter(|s| **s == Segment::Lease).count();
        match (leases, &lease) {
            (1, None) | (0, Some(_)) => Ok(Self {
                segments,
                fixed: lease,
            }),
            (0, None) => Err(BadPattern(
                "a key pattern names its lease: {lease} in it, or a lease of its own",
            )),
            _ => Err(BadPattern(
                "a key pattern has one {lease}, or a lease of its own, not both",
            )),
        }
    }

    /// The lease guarding `key`, and how long the key's part that the
    /// pattern matched is (the lease's keys are that part, and that part
    /// followed by `/`).
    fn matches(&self, key: &[u8]) -> Option<(LeaseName, usize)> {
        let mut parts = key.split(|b| *b == b'/');
        let mut lease = self.fixed.clone();
        let mut end = 0;
        for (i, segment) in self.segments.iter().enumerate() {
            let part = parts.next()?;
            end += usize::from(i > 0);
            match segment {
                Segment::Literal(l) if l.as_slice() == part => {}
                Segment::Literal(_) => return None,
                Segment::Any if !part.is_empty() => {}
                Segment::Any => return None,
                Segment::Lease => {
                    let name = std::str::from_utf8(part).ok()?;
                    lease = Some(LeaseName::new(name).ok()?);
                }
            }
            end += part.len();
        }
        lease.map(|l| (l, end))
    }

    /// Whether this pattern matches the key `base` (a whole number of
    /// segments) or any key under it (`base` followed by `/`): each of its
    /// segments it has a part for matches that part.
    fn reaches_under(&self, base: &[u8]) -> bool {
        self.segments
            .iter()
            .zip(base.split(|b| *b == b'/'))
            .all(|(segment, part)| match segment {
                Segment::Literal(l) => l.as_slice() == part,
                Segment::Any => !part.is_empty(),
                Segment::Lease => std::str::from_utf8(part)
                    .ok()
                    .is_some_and(|name| LeaseName::new(name).is_ok()),
            })
    }
}

/// The key routes of a store: the first pattern that matches a key names
/// its lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRoutes {
    patterns: Vec<KeyPattern>,
    /// The keys under this prefix are fencegate's own (the fence keys):
    /// no write of a client may touch them. Empty: none.
    reserved: Vec<u8>,
}

/// The lease that fences a write, and the route (its index among the
/// patterns) that named it for the write's first key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fenced {
    pub lease: LeaseName,
    pub route: usize,
}

/// Why a write cannot be fenced by one lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A key (shown, lossily) no route guards.
    Unrouted(String),
    /// Keys of more than one lease: the two first seen.
    SpansLeases(String, String),
    /// A range that reaches past one lease's keys (shown, lossily).
    RangeSpansLeases(String, String),
    /// A key, or a range that reaches a key, that is fencegate's own
    /// (described).
    Reserved(String),
    /// It touches nothing (a transaction of reads only): not a write.
    NoKey,
}

impl KeyRoutes {
    pub fn new(patterns: Vec<KeyPattern>) -> Self {
        Self {
            patterns,
            reserved: Vec::new(),
        }
    }

    /// The same routes, with the keys under `prefix` fencegate's own.
    pub fn with_reserved(mut self, prefix: &[u8]) -> Self {
        self.reserved = prefix.to_vec();
        self
    }

    /// Whether `t` touches a key under the reserved prefix.
    fn reaches_reserved(&self, t: &Touched) -> bool {
        let prefix = self.reserved.as_slice();
        if prefix.is_empty() {
            return false;
        }
        // The first key after every key under the prefix: the prefix with
        // its last byte below 0xff raised by one (none: the keyspace's end).
        let end = prefix.iter().rposition(|b| *b < 0xff).map(|i| {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        });
        let below_end = |k: &[u8]| end.as_deref().is_none_or(|e| k < e);
        match t {
            Touched::Key(k) => k.starts_with(prefix),
            Touched::Range { from, to } => below_end(from) && to.as_slice() > prefix,
            // Refused whatever it reaches: no lease's keys run to the end.
            Touched::From(_) => false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The lease guarding `key`, the index of the pattern that named it,
    /// and the length of the key's part the pattern matched.
    fn lease_of(&self, key: &[u8]) -> Option<(LeaseName, usize, usize)> {
        self.patterns
            .iter()
            .enumerate()
            .find_map(|(i, p)| p.matches(key).map(|(lease, end)| (lease, i, end)))
    }

    /// The one lease that guards everything `touched` names, or why there
    /// is none. A range must lie inside one lease's keys: from the part
    /// of its first key that a pattern matched, followed by `/`, up to
    /// that part followed by `0` (the byte after `/`), so that no key of a
    /// lease whose name merely starts alike (`orders-2` beside `orders`)
    /// falls inside it; and no earlier pattern may reach under that part
    /// (`/app/orders/special` listed before `/app/{lease}` names the lease
    /// of some of the keys under `/app/orders/`).
    pub fn one_lease(&self, touched: &[Touched]) -> Result<Fenced, Refusal> {
        let show = |k: &[u8]| String::from_utf8_lossy(k).into_owned();
        let mut found: Option<(Fenced, String)> = None;
        for t in touched {
            if self.reaches_reserved(t) {
                return Err(Refusal::Reserved(match t {
                    Touched::Key(k) => format!("the key {:?}", show(k)),
                    Touched::Range { from, to } => {
                        format!("the range from {:?} to {:?}", show(from), show(to))
                    }
                    Touched::From(from) => format!("the range from {:?} on", show(from)),
                }));
            }
            let (lease, route, shown) = match t {
                Touched::Key(key) => {
                    let (lease, route, _) = self
                        .lease_of(key)
                        .ok_or_else(|| Refusal::Unrouted(show(key)))?;
                    (lease, route, show(key))
                }
                Touched::Range { from, to } => {
                    let (lease, route, end) = self
                        .lease_of(from)
                        .ok_or_else(|| Refusal::Unrouted(show(from)))?;
                    let base = &from[..end];
                    let low = [base, b"/"].concat();
                    let high = [base, b"0"].concat();
                    if from.as_slice() < low.as_slice()
                        || to.as_slice() > high.as_slice()
                        || self.patterns[..route].iter().any(|p| p.reaches_under(base))
                    {
                        return Err(Refusal::RangeSpansLeases(show(from), show(to)));
                    }
                    (lease, route, show(from))
                }
                Touched::From(from) => {
                    return Err(Refusal::RangeSpansLeases(show(from), "the end".into()));
                }
            };
            match &found {
                None => found = Some((Fenced { lease, route }, shown)),
                Some((first, first_key)) if first.lease != lease => {
                    return Err(Refusal::SpansLeases(first_key.clone(), shown));
                }
                Some(_) => {}
            }
        }
        found.map(|(fenced, _)| fenced).ok_or(Refusal::NoKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes() -> KeyRoutes {
        KeyRoutes::new(vec![
            KeyPattern::new("/app/{lease}", None).unwrap(),
            KeyPattern::new("/jobs/*/{lease}/data", None).unwrap(),
            KeyPattern::new("/config", Some(LeaseName::new("cfg").unwrap())).unwrap(),
        ])
    }

    fn key(k: &str) -> Touched {
        Touched::Key(k.as_bytes().to_vec())
    }

    fn range(from: &str, to: &str) -> Touched {
        Touched::Range {
            from: from.as_bytes().to_vec(),
            to: to.as_bytes().to_vec(),
        }
    }

    #[test]
    fn keys_map_to_their_lease() {
        let r = routes();
        let lease = |t: &[Touched]| r.one_lease(t).map(|f| f.lease.as_str().to_owned());
        assert_eq!(lease(&[key("/app/orders/42")]), Ok("orders".into()));
        assert_eq!(lease(&[key("/app/orders")]), Ok("orders".into()));
        assert_eq!(
            lease(&[key("/app/orders/a"), key("/app/orders/b")]),
            Ok("orders".into())
        );
        assert_eq!(lease(&[key("/jobs/x/j1/data/7")]), Ok("j1".into()));
        assert_eq!(lease(&[key("/config/a")]), Ok("cfg".into()));
        // Matched as bytes: no percent-decoding, no dot segments.
        assert_eq!(lease(&[key("/app/orders/%2e%2e/x")]), Ok("orders".into()));
        assert!(matches!(
            lease(&[key("/app/%6Frders/1")]),
            Err(Refusal::Unrouted(_))
        ));
        for unrouted in [
            "/other/x",
            "app/orders/1",
            "/app",
            "/app//1",
            "/jobs/x/j1/meta",
        ] {
            assert!(
                matches!(lease(&[key(unrouted)]), Err(Refusal::Unrouted(_))),
                "{unrouted}"
            );
        }
        assert!(matches!(
            lease(&[key("/app/orders/1"), key("/app/users/1")]),
            Err(Refusal::SpansLeases(_, _))
        ));
        assert_eq!(lease(&[]), Err(Refusal::NoKey));
        // Not a lease name: unrouted.
        assert!(matches!(
            lease(&[key("/app/or ders/1")]),
            Err(Refusal::Unrouted(_))
        ));
    }

    #[test]
    fn ranges_stay_inside_one_lease() {
        let r = routes();
        let lease = |t: &[Touched]| r.one_lease(t).map(|f| f.lease.as_str().to_owned());
        // The prefix range of orders' keys, and ranges inside it.
        assert_eq!(
            lease(&[range("/app/orders/", "/app/orders0")]),
            Ok("orders".into())
        );
        assert_eq!(
            lease(&[range("/app/orders/a", "/app/orders/b")]),
            Ok("orders".into())
        );
        for (from, to) in [
            // Reaches orders-2's keys ('-' sorts before '/').
            ("/app/orders", "/app/orders0"),
            ("/app/orders/", "/app/orders1"),
            ("/app/orders/a", "/app/p"),
            ("/app/orders/a", "/app/users/a"),
        ] {
            assert!(
                matches!(
                    lease(&[range(from, to)]),
                    Err(Refusal::RangeSpansLeases(_, _))
                ),
                "{from}..{to}"
            );
        }
        assert!(matches!(
            lease(&[Touched::From(b"/app/orders/".to_vec())]),
            Err(Refusal::RangeSpansLeases(_, _))
        ));
        // An earlier pattern names the lease of some keys under the range's
        // lease: /app/orders/special/… is "special"'s.
        let r = KeyRoutes::new(vec![
            KeyPattern::new("/app/orders/special", Some(LeaseName::new("sp").unwrap())).unwrap(),
            KeyPattern::new("/app/{lease}", None).unwrap(),
        ]);
        let lease = |t: &[Touched]| r.one_lease(t).map(|f| f.lease.as_str().to_owned());
        assert_eq!(lease(&[key("/app/orders/special/1")]), Ok("sp".into()));
        assert_eq!(lease(&[key("/app/orders/1")]), Ok("orders".into()));
        assert!(matches!(
            lease(&[range("/app/orders/", "/app/orders0")]),
            Err(Refusal::RangeSpansLeases(_, _))
        ));
        assert_eq!(
            lease(&[range("/app/users/", "/app/users0")]),
            Ok("users".into())
        );
    }

    #[test]
    fn no_write_reaches_the_reserved_keys() {
        let r = KeyRoutes::new(vec![KeyPattern::new("{lease}", None).unwrap()])
            .with_reserved(b"fencegate/fence/");
        let reserved = |t: Touched| matches!(r.one_lease(&[t]), Err(Refusal::Reserved(_)));
        assert!(reserved(key("fencegate/fence/orders")));
        assert!(reserved(range("fencegate/", "fencegate0")));
        assert!(reserved(range("fencegate/fence/a", "fencegate/fence/b")));
        assert!(reserved(range("a", "fencegate/fence/\0")));
        // Beside the prefix: keys of lease "fencegate" like any other.
        for t in [
            key("fencegate/fencf"),
            key("fencegate/fence"),
            range("fencegate/a", "fencegate/fence/"),
            range("fencegate/fence0", "fencegate0"),
        ] {
            assert!(!reserved(t.clone()), "{t:?}");
        }
    }

    #[test]
    fn a_pattern_without_a_leading_slash_matches_keys_without_one() {
        let r = KeyRoutes::new(vec![
            KeyPattern::new("app/{lease}", None).unwrap(),
            KeyPattern::new("{lease}/jobs", None).unwrap(),
        ]);
        let lease = |t: &[Touched]| r.one_lease(t).map(|f| f.lease.as_str().to_owned());
        assert_eq!(lease(&[key("app/orders/42")]), Ok("orders".into()));
        assert_eq!(lease(&[key("nightly/jobs/1")]), Ok("nightly".into()));
        assert_eq!(
            lease(&[range("app/orders/", "app/orders0")]),
            Ok("orders".into())
        );
        for (from, to) in [
            ("app/orders", "app/orders0"),
            ("app/orders/", "app/orders1"),
        ] {
            assert!(
                matches!(
                    lease(&[range(from, to)]),
                    Err(Refusal::RangeSpansLeases(_, _))
                ),
                "{from}..{to}"
            );
        }
        for unrouted in ["/app/orders/1", "app", "nightly/other"] {
            assert!(
                matches!(lease(&[key(unrouted)]), Err(Refusal::Unrouted(_))),
                "{unrouted}"
            );
        }
    }

    #[test]
    fn bad_patterns_are_refused() {
        for (pattern, lease) in [
            ("", Some("x")),
            ("/", Some("x")),
            ("/app//{lease}", None),
            ("app/{lease}/", None),
            ("/app", None),
            ("/app/{lease}/{lease}", None),
            ("/app/{lease}", Some("x")),
        ] {
            let lease = lease.map(|l| LeaseName::new(l).unwrap());
            assert!(KeyPattern::new(pattern, lease).is_err(), "{pattern}");
        }
    }
}
