//! Routes: which lease guards which path, and which paths are never forwarded.
//!
//! A route pattern is a list of `/`-separated segments: literals, `*` (any one
//! segment) and `{lease}` (any one segment, naming the guarding lease). A
//! pattern matches a path whose leading segments match it, so `/kv/{lease}`
//! guards `/kv/orders` and everything under `/kv/orders/`. A route without
//! `{lease}` names a fixed lease instead. The first matching route wins.
//!
//! # What a path must not contain, and why
//!
//! fencegate decides on the path it sees; the storage acts on the path *it*
//! sees after its own normalisation. Where the two could differ, a write
//! admitted for one lease could land in another's keys. So a path is refused
//! (`400 invalid-request`, never forwarded) when any segment, once
//! percent-decoded, once more decoded (a backend or a proxy chain that decodes
//! twice), with its servlet path parameters dropped (`;` and everything after
//! it: Tomcat, Jetty), after Unicode NFKC normalisation (fullwidth `．` is
//! `.`) and with trailing dots and spaces removed (Windows file names):
//! - is empty (`//`, `/;x/`; a trailing slash is fine), or is `.` or `..` or
//!   only dots: `..;/`, `%2e%2e;x=1`, `.%2E`, `．．` and `...` are all dot
//!   segments somewhere;
//! - ends in `.` or a space (`orders.` is `orders` on Windows);
//! - holds `/`, `\`, NUL or a control character, or a character that code
//!   pages' "best fit" mappings turn into `/` or `\` (`¥`, `₩`, `∕`, `∖`,
//!   `⁄`, fullwidth `／` and `＼`);
//! - or has malformed percent-encoding, IIS's `%uXXXX`, or bytes that are
//!   not UTF-8 (overlong `%c0%ae`).
//!
//! Routes match the same normalised segments, so `/kv;x/orders/1` is guarded
//! by lease `orders` as `/kv/orders/1` is; the lease segment itself must be
//! exactly a lease name (`/kv/orders;x/1` names no lease). With
//! `fence.case_insensitive_paths` (storage on a file system that folds
//! case), literals match without regard to case (compared upper-cased, as
//! NTFS does) and a lease segment must be lower case, since `Orders` and
//! `orders` would be one set of keys there.
//!
//! Finally every request is checked against every route where it lands
//! **upstream** (after a route's `upstream_prefix` rewrite): a request that
//! reaches keys another route guards (an alias around the rewrite, such as
//! `/v2/keys/locks/job-7` beside a route `/locks/{lease}` rewritten to
//! `/v2/keys/locks`), or a parent of them (`/v2/keys?recursive=true`), is
//! refused unless it is that same lease's fenced request. A request no lease
//! admits is checked as it reads decoded twice too. Reads are held to this
//! only for routes that fence reads.

use std::borrow::Cow;

use smallvec::SmallVec;
use unicode_normalization::UnicodeNormalization;

use crate::names::{InvalidName, LeaseName};

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
    /// Whether its writes reach the storage with a precondition (SPEC §10).
    pub preconditions: Preconditions,
    /// Replaces the pattern's leading literal segments on the way upstream.
    upstream_prefix: Option<String>,
    /// The pattern as the upstream sees it (the prefix rewritten).
    upstream: Vec<Segment>,
    /// Where `{lease}` is in `upstream`.
    upstream_lease: LeaseSource,
}

/// A path that matched a route.
#[derive(Debug)]
pub struct Matched<'r> {
    /// The guarding lease, or the path segment in its place that is not a
    /// lease name, with what is wrong with it.
    pub lease: Result<LeaseName, NotALease>,
    /// The route's pattern, for logs.
    pub pattern: &'r str,
    pub fence_reads: bool,
    pub timeout_ms: Option<u64>,
    pub preconditions: Preconditions,
    /// `(literal segments to drop, prefix to put instead)`, if the route
    /// rewrites paths.
    pub rewrite: Option<(usize, &'r str)>,
    /// The route, in the table.
    route: &'r Route,
}

/// A path segment in a lease's place that names no lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotALease {
    /// The segment, as sent.
    pub segment: String,
    /// Set when the segment is a lease name but may not be used in a path
    /// (upper case with `fence.case_insensitive_paths`).
    pub why: Option<&'static str>,
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

/// How a route's writes are conditioned at the storage (SPEC §10): `off`
/// (the default), or on: every write the storage may execute as a change
/// to a key carries a precondition that operation evaluates, the client's
/// own or one naming the key's state as the storage's answers showed it.
/// Which API the storage speaks decides what its requests are
/// (`fencegate_core::precondition::Dialect`): `s3`, `azure`, or `etag` for
/// any other (no write is sorted as one that changes no key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preconditions {
    #[default]
    Off,
    /// A storage fencegate knows nothing of (WebDAV, the embedded store).
    Etag,
    /// Amazon S3 and the stores that copy its API.
    S3,
    /// Azure Blob Storage.
    Azure,
}

impl Preconditions {
    pub fn is_off(&self) -> bool {
        *self == Preconditions::Off
    }

    /// The storage's API, on a route with preconditions.
    pub fn dialect(&self) -> Option<fencegate_core::precondition::Dialect> {
        use fencegate_core::precondition::Dialect;
        match self {
            Preconditions::Off => None,
            Preconditions::Etag => Some(Dialect::Any),
            Preconditions::S3 => Some(Dialect::S3),
            Preconditions::Azure => Some(Dialect::Azure),
        }
    }
}

/// What a route's `pattern` is matched against: the request's path (the
/// default), or, for a store that names the key in the body (SPEC §11),
/// the keys its writes touch (`etcd-v3`: etcd's v3 JSON gateway).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouteKind {
    #[default]
    Path,
    #[serde(rename = "etcd-v3")]
    EtcdV3,
    #[serde(rename = "dynamodb")]
    DynamoDb,
}

impl RouteKind {
    pub fn is_path(&self) -> bool {
        *self == RouteKind::Path
    }
}

/// A path fencegate refuses to route.
#[derive(Debug, PartialEq, Eq)]
pub struct BadPath(pub Cow<'static, str>);

impl BadPath {
    fn new(why: &'static str) -> Self {
        Self(Cow::Borrowed(why))
    }
}

/// How paths are normalised before they are matched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PathRules {
    /// The storage folds case: literals match without regard to case, and
    /// a lease segment must be lower case.
    pub case_insensitive: bool,
}

/// One segment of a request path, as it is matched.
#[derive(Debug)]
struct Seg<'a> {
    /// The normalised form routes match (see the module docs).
    form: Cow<'a, str>,
    /// Whether `form` is the decoded segment unchanged (no parameters
    /// dropped, nothing normalised or folded): only such a segment can name
    /// a lease.
    exact: bool,
    /// The segment as sent, for messages.
    raw: &'a str,
    /// Its normalised form once decoded again (as a backend that decodes
    /// twice would see it), when that differs.
    again: Option<String>,
}

type Segs<'a> = SmallVec<[Seg<'a>; 8]>;

/// Why a route's pattern, lease or upstream prefix was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteError {
    /// The route's pattern, as configured.
    pub pattern: String,
    pub fault: RouteFault,
}

/// What is wrong with a route (see [`RouteError`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteFault {
    /// The pattern does not start with `/`.
    NotAbsolute,
    /// A segment is neither a literal, `*` nor `{lease}`.
    NotASegment(String),
    /// A literal segment no request path could match.
    Unmatchable(String),
    /// The fixed lease is not a lease name.
    BadLease(String, InvalidName),
    /// Neither a `{lease}` segment nor a fixed lease.
    NoLease,
    /// The lease is named more than once.
    LeaseTwice,
    /// The upstream prefix is not a path starting with `/`.
    PrefixNotAPath(String),
    /// A segment of the upstream prefix is not a plain path segment.
    PrefixSegment(String, String),
}

impl std::fmt::Display for RouteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.pattern;
        match &self.fault {
            RouteFault::NotAbsolute => write!(f, "route pattern {p:?} must start with '/'"),
            RouteFault::NotASegment(lit) => write!(
                f,
                "route pattern {p:?}: segment {lit:?} is not a literal, '*' or '{{lease}}'"
            ),
            RouteFault::Unmatchable(lit) => write!(
                f,
                "route pattern {p:?}: segment {lit:?} is not a path segment a request can match (see \"what a path must not contain\")"
            ),
            RouteFault::BadLease(name, e) => write!(f, "route {p:?}: {name:?}: {e}"),
            RouteFault::NoLease => {
                write!(f, "route {p:?} has no {{lease}} segment and no fixed lease")
            }
            RouteFault::LeaseTwice => write!(
                f,
                "route {p:?} must name its lease exactly once ({{lease}} or lease = \"…\")"
            ),
            RouteFault::PrefixNotAPath(prefix) => write!(
                f,
                "route {p:?}: upstream_prefix {prefix:?} must be a path starting with '/'"
            ),
            RouteFault::PrefixSegment(prefix, lit) => write!(
                f,
                "route {p:?}: upstream_prefix {prefix:?}: segment {lit:?} is not a plain path segment"
            ),
        }
    }
}

impl std::error::Error for RouteError {}

impl Route {
    /// Compiles `pattern`; `lease` names a fixed lease for patterns without
    /// `{lease}`.
    pub fn new(pattern: &str, lease: Option<&str>, fence_reads: bool) -> Result<Self, RouteError> {
        let refused = |fault| RouteError {
            pattern: pattern.to_owned(),
            fault,
        };
        let Some(rest) = pattern.strip_prefix('/') else {
            return Err(refused(RouteFault::NotAbsolute));
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
                    return Err(refused(RouteFault::NotASegment(lit.clone())));
                }
                // A literal no request could match would be a route that
                // silently never applies.
                match normalise(Cow::Borrowed(lit.as_str()), false, PathRules::default()) {
                    Ok(seg) if seg.exact => {}
                    _ => return Err(refused(RouteFault::Unmatchable(lit.clone()))),
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
                    .map_err(|e| refused(RouteFault::BadLease(name.to_owned(), e)))?;
                LeaseSource::Fixed(name)
            }
            ([], None) => return Err(refused(RouteFault::NoLease)),
            (_, _) => return Err(refused(RouteFault::LeaseTwice)),
        };
        Ok(Self {
            pattern: pattern.to_owned(),
            upstream: segments.clone(),
            upstream_lease: lease.clone(),
            segments,
            lease,
            fence_reads,
            timeout_ms: None,
            preconditions: Preconditions::Off,
            upstream_prefix: None,
        })
    }

    /// Makes the route rewrite its leading literal segments to `prefix` on
    /// the way upstream (`/keys/{lease}` with `/v2/keys`: `/keys/a/b` goes
    /// upstream as `/v2/keys/a/b`).
    pub fn with_upstream_prefix(mut self, prefix: Option<&str>) -> Result<Self, RouteError> {
        let Some(p) = prefix else {
            return Ok(self);
        };
        let refused = |fault| RouteError {
            pattern: self.pattern.clone(),
            fault,
        };
        if !p.starts_with('/') || p.contains(['?', '#']) {
            return Err(refused(RouteFault::PrefixNotAPath(p.to_owned())));
        }
        let trimmed = p.trim_end_matches('/');
        let mut upstream = Vec::new();
        for lit in trimmed.split('/').skip(1) {
            match normalise(Cow::Borrowed(lit), false, PathRules::default()) {
                Ok(seg) if seg.exact && !lit.contains('%') => {
                    upstream.push(Segment::Literal(lit.to_owned()));
                }
                _ => {
                    return Err(refused(RouteFault::PrefixSegment(
                        p.to_owned(),
                        lit.to_owned(),
                    )))
                }
            }
        }
        let literal_prefix = self.literal_prefix();
        let shift = upstream.len() as isize - literal_prefix as isize;
        upstream.extend(self.segments[literal_prefix..].iter().cloned());
        self.upstream_lease = match &self.lease {
            LeaseSource::Segment(i) => LeaseSource::Segment((*i as isize + shift) as usize),
            fixed => fixed.clone(),
        };
        self.upstream = upstream;
        self.upstream_prefix = Some(trimmed.to_owned());
        Ok(self)
    }

    /// Gives the route its own upstream deadline.
    pub fn with_timeout_ms(mut self, timeout_ms: Option<u64>) -> Self {
        self.timeout_ms = timeout_ms;
        self
    }

    /// Sets how the route's writes are conditioned at the storage.
    pub fn with_preconditions(mut self, preconditions: Preconditions) -> Self {
        self.preconditions = preconditions;
        self
    }

    /// How many leading segments of the pattern are literals.
    fn literal_prefix(&self) -> usize {
        self.segments
            .iter()
            .take_while(|s| matches!(s, Segment::Literal(_)))
            .count()
    }

    /// Lower-cases the literals, for storage that folds case.
    fn fold_case(&mut self) {
        for seg in self.segments.iter_mut().chain(self.upstream.iter_mut()) {
            if let Segment::Literal(lit) = seg {
                *lit = fold(lit);
            }
        }
    }

    fn matches(&self, path: &[Seg<'_>], rules: PathRules) -> Option<Matched<'_>> {
        if path.len() < self.segments.len() {
            return None;
        }
        for (seg, part) in self.segments.iter().zip(path) {
            if let Segment::Literal(lit) = seg {
                if lit != part.form.as_ref() {
                    return None;
                }
            }
        }
        let lease = match &self.lease {
            LeaseSource::Segment(i) => lease_of(&path[*i], rules),
            LeaseSource::Fixed(name) => Ok(name.clone()),
        };
        Some(Matched {
            lease,
            pattern: &self.pattern,
            fence_reads: self.fence_reads,
            timeout_ms: self.timeout_ms,
            preconditions: self.preconditions,
            rewrite: self
                .upstream_prefix
                .as_deref()
                .map(|p| (self.literal_prefix(), p)),
            route: self,
        })
    }

    /// Where `upstream` (a path as the storage sees it) lies relative to
    /// the keys this route guards there.
    fn reach<'a>(&'a self, upstream: &[&'a str]) -> Reach<'a> {
        let n = upstream.len().min(self.upstream.len());
        for (seg, part) in self.upstream[..n].iter().zip(upstream) {
            if let Segment::Literal(lit) = seg {
                if lit != part {
                    return Reach::Apart;
                }
            }
        }
        if upstream.len() < self.upstream.len() {
            return Reach::Above;
        }
        Reach::Inside(match &self.upstream_lease {
            LeaseSource::Segment(i) => upstream[*i],
            LeaseSource::Fixed(name) => name.as_str(),
        })
    }
}

/// Where a path lies relative to a route's keys at the storage.
#[derive(Debug, PartialEq, Eq)]
enum Reach<'a> {
    /// Among them: guarded by the lease of this name.
    Inside(&'a str),
    /// A parent of them (a recursive read or delete there reaches them).
    Above,
    /// Neither.
    Apart,
}

/// The lease a path segment names, if it names one.
fn lease_of(seg: &Seg<'_>, rules: PathRules) -> Result<LeaseName, NotALease> {
    let not = |why| NotALease {
        segment: seg.raw.to_owned(),
        why,
    };
    if !seg.exact {
        // Parameters dropped, normalised or folded: what the storage sees
        // is not what a lease of this name guards.
        let why = rules.case_insensitive.then_some(
            "with fence.case_insensitive_paths on, a lease named in a path must be lower case",
        );
        return Err(not(why));
    }
    LeaseName::new(&seg.form).map_err(|_| not(None))
}

/// The route table, in order.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    routes: Vec<Route>,
    rules: PathRules,
    /// Whether any route rewrites its prefix (else every request lands
    /// upstream where its route says, and the alias check is simpler).
    any_rewrite: bool,
    /// Whether any route fences reads (else reads need no reach check).
    any_fence_reads: bool,
}

impl Routes {
    pub fn new(routes: Vec<Route>) -> Self {
        Self::with_rules(routes, PathRules::default())
    }

    /// A table whose paths are normalised by `rules`.
    pub fn with_rules(mut routes: Vec<Route>, rules: PathRules) -> Self {
        if rules.case_insensitive {
            routes.iter_mut().for_each(Route::fold_case);
        }
        Self {
            any_rewrite: routes.iter().any(|r| r.upstream_prefix.is_some()),
            any_fence_reads: routes.iter().any(|r| r.fence_reads),
            routes,
            rules,
        }
    }

    /// The route guarding `raw_path` (as sent, percent-encoded) for a write
    /// or a read, `Ok(None)` if none does, or an error for a path that must
    /// not be forwarded at all: one whose segments are ambiguous (see the
    /// module docs), or one that would reach, at the storage, keys of a
    /// lease other than the one that admits it.
    ///
    /// A matched route whose lease segment names no lease is returned as it
    /// is (the fence refuses a write or fenced read of it), unless it is an
    /// unfenced read, which is checked like an unrouted one.
    pub fn resolve(&self, raw_path: &str, write: bool) -> Result<Option<Matched<'_>>, BadPath> {
        let segments = split(raw_path, self.rules)?;
        let matched = self
            .routes
            .iter()
            .find_map(|r| r.matches(&segments, self.rules));
        let admitting = match &matched {
            // An unrouted write is refused unless the config allows them,
            // and then checked by `check_unrouted_write`.
            None if write => return Ok(None),
            _ if !write && !self.any_fence_reads => return Ok(matched),
            Some(m) if write || m.fence_reads => match &m.lease {
                Ok(lease) => Some(lease.as_str()),
                Err(_) => return Ok(matched),
            },
            _ => None,
        };
        self.check_reach(&segments, matched.as_ref(), admitting, write)?;
        Ok(matched)
    }

    /// For a write no route guards (`fence.allow_unrouted_writes`): refuses
    /// it if, at the storage, it would reach keys a route guards or a parent
    /// of them.
    pub fn check_unrouted_write(&self, raw_path: &str) -> Result<(), BadPath> {
        self.check_at_storage(raw_path, None)
    }

    /// For a path the storage gets as it is, not rewritten (a WebDAV
    /// `Destination`): refuses it unless, at the storage, it names keys
    /// guarded by `lease` (none, for `None`) and no parent of other keys.
    pub fn check_at_storage(&self, raw_path: &str, lease: Option<&str>) -> Result<(), BadPath> {
        let segments = split(raw_path, self.rules)?;
        self.check_reach(&segments, None, lease, true)
    }

    /// Refuses a request that reaches, at the storage, keys guarded by a
    /// lease other than `admitting` (the lease that admits it; `None` for
    /// an unrouted request or an unfenced read), or a parent of such keys.
    fn check_reach(
        &self,
        segments: &[Seg<'_>],
        matched: Option<&Matched<'_>>,
        admitting: Option<&str>,
        write: bool,
    ) -> Result<(), BadPath> {
        let once: SmallVec<[&str; 8]> = segments.iter().map(|s| s.form.as_ref()).collect();
        self.check_landing(&once, matched, admitting, write, self.any_rewrite)?;
        // A backend (or a proxy before it) that decodes twice sees another
        // path, which must not reach guarded keys either. A request a lease
        // admits is not concerned: its literals and lease segment hold no
        // '%', and its other segments cannot turn into separators or dot
        // segments (they would have been refused).
        if admitting.is_none() && segments.iter().any(|s| s.again.is_some()) {
            let twice: SmallVec<[&str; 8]> = segments
                .iter()
                .map(|s| s.again.as_deref().unwrap_or(&s.form))
                .collect();
            // Whether a route holds it must be asked: it matched none.
            self.check_landing(&twice, matched, None, write, true)
                .map_err(|BadPath(why)| BadPath(Cow::Owned(format!("decoded twice, {why}"))))?;
        }
        Ok(())
    }

    /// [`Routes::check_reach`] for the path of these segment forms.
    fn check_landing(
        &self,
        forms: &[&str],
        matched: Option<&Matched<'_>>,
        admitting: Option<&str>,
        write: bool,
        find_guard: bool,
    ) -> Result<(), BadPath> {
        // The path as the storage sees it, less a trailing slash.
        let mut upstream: SmallVec<[&str; 8]> = SmallVec::new();
        match matched.map(|m| m.route) {
            Some(r) if r.upstream_prefix.is_some() => {
                // The prefix as the route's upstream pattern has it (folded,
                // when case is folded), then the rest of the path.
                let drop = r.literal_prefix();
                let prefix = r.upstream.len() - (r.segments.len() - drop);
                upstream.extend(r.upstream[..prefix].iter().filter_map(|s| match s {
                    Segment::Literal(lit) => Some(lit.as_str()),
                    _ => None,
                }));
                upstream.extend(forms[drop..].iter().copied());
            }
            _ => upstream.extend(forms.iter().copied()),
        }
        if upstream.last() == Some(&"") {
            upstream.pop();
        }
        let concerns = |r: &Route| write || r.fence_reads;
        // Who guards the keys this lands on: the first route whose
        // upstream pattern holds it, as for a request sent that way.
        // Without rewrites that is the route that matched, if any, unless
        // the path is not the one routes were matched on (`find_guard`).
        if find_guard {
            let guard = self.routes.iter().find_map(|r| match r.reach(&upstream) {
                Reach::Inside(lease) => Some((r, lease)),
                _ => None,
            });
            match guard {
                Some((r, lease)) => {
                    let same = admitting == Some(lease);
                    // An unfenced read through a route that does not fence
                    // reads lands on that route's own keys.
                    let own = admitting.is_none() && !r.fence_reads && !write;
                    if !same && !own && (admitting.is_some() || concerns(r)) {
                        return Err(reaches(r, "keys"));
                    }
                }
                // Admitted for a lease, it must land among that lease's keys
                // (a routed request always does; a path the storage gets
                // unrewritten may not).
                None if admitting.is_some() => {
                    return Err(BadPath::new(
                        "at the storage this path is not among the keys of its lease \
                         (a Destination is not rewritten by a route's upstream_prefix)",
                    ))
                }
                None => {}
            }
        }
        for r in &self.routes {
            if concerns(r) && r.reach(&upstream) == Reach::Above {
                return Err(reaches(r, "a parent of the keys"));
            }
        }
        Ok(())
    }
}

fn reaches(r: &Route, what: &str) -> BadPath {
    let upstream: Vec<String> = r
        .upstream
        .iter()
        .map(|s| match s {
            Segment::Literal(l) => l.clone(),
            Segment::Any => "*".into(),
            Segment::Lease => "{lease}".into(),
        })
        .collect();
    BadPath(Cow::Owned(format!(
        "at the storage this path is {what} that route {:?} guards (upstream /{}): \
         send requests for them through that route, with its lease's term",
        r.pattern,
        upstream.join("/")
    )))
}

/// Splits a raw path into normalised segments, refusing anything ambiguous.
fn split(raw_path: &str, rules: PathRules) -> Result<Segs<'_>, BadPath> {
    check_no_empty_segments(raw_path)?;
    let Some(rest) = raw_path.strip_prefix('/') else {
        return Err(BadPath::new("the path must start with '/'"));
    };
    let mut segments = Segs::new();
    let mut parts = rest.split('/').peekable();
    while let Some(raw) = parts.next() {
        let last = parts.peek().is_none();
        if is_plain(raw, rules) {
            // What `normalise` makes of it, without the work.
            segments.push(Seg {
                form: Cow::Borrowed(raw),
                exact: true,
                raw,
                again: None,
            });
            continue;
        }
        let mut seg = normalise(decode(raw)?, last, rules)?;
        seg.raw = raw;
        segments.push(seg);
    }
    Ok(segments)
}

/// Whether a raw segment is its own normal form with nothing to check: not
/// empty, only ASCII letters, digits, `-`, `_`, `~` and `.` (lower-case
/// letters when case is folded), and not ending in `.`. Such a segment has
/// nothing to decode (no `%`), no parameters (`;`), no separators, and is
/// not a dot segment; `normalise` would return it as it is, exact.
fn is_plain(raw: &str, rules: PathRules) -> bool {
    let b = raw.as_bytes();
    let Some(&end) = b.last() else {
        return false;
    };
    end != b'.'
        && b.iter().all(|&c| match c {
            b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'~' | b'.' => true,
            b'A'..=b'Z' => !rules.case_insensitive,
            _ => false,
        })
}

/// Decoded path segments; paths of up to eight segments need no allocation.
pub type Segments<'a> = SmallVec<[Cow<'a, str>; 8]>;

/// Splits a raw path into decoded segments (for fencegate's own endpoints,
/// which no storage sees): malformed percent-encoding, bytes that are not
/// UTF-8, `.` and `..` segments, empty segments before the last, and
/// segments holding `/`, `\` or NUL are refused.
pub fn decode_path(raw_path: &str) -> Result<Segments<'_>, BadPath> {
    check_no_empty_segments(raw_path)?;
    let Some(rest) = raw_path.strip_prefix('/') else {
        return Err(BadPath::new("the path must start with '/'"));
    };
    let mut segments = Segments::new();
    for raw in rest.split('/') {
        let decoded = decode(raw)?;
        if decoded == "." || decoded == ".." {
            return Err(BadPath::new("the path has a '.' or '..' segment"));
        }
        if decoded.contains(['/', '\\', '\0']) {
            return Err(BadPath::new("a path segment decodes to '/', '\\' or NUL"));
        }
        segments.push(decoded);
    }
    Ok(segments)
}

/// Percent-decodes one segment strictly: every `%` starts two hex digits,
/// and the result is UTF-8.
fn decode(raw: &str) -> Result<Cow<'_, str>, BadPath> {
    if !raw.contains('%') {
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
                return Err(BadPath::new(
                    "the path has a malformed percent-encoding (or IIS's %u form)",
                ));
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| BadPath::new("the path does not decode to UTF-8"))
}

/// Refuses empty segments before the last (`//x`, `/a//b`): many backends
/// merge the slashes, so such a path could reach a key its route does not
/// name. A trailing slash (an empty last segment) names a collection.
fn check_no_empty_segments(raw_path: &str) -> Result<(), BadPath> {
    if raw_path.contains("//") {
        return Err(BadPath::new("the path has an empty segment ('//')"));
    }
    Ok(())
}

/// Characters that Windows' "best fit" code-page mappings turn into `/` or
/// `\`, which NFKC leaves alone (the fullwidth forms NFKC maps itself).
const BEST_FIT_SEPARATORS: [char; 5] = ['\u{a5}', '\u{20a9}', '\u{2215}', '\u{2216}', '\u{2044}'];

/// The normalised form of a decoded segment (see the module docs), or why
/// no storage may be handed it. `last`: the segment ends the path, where
/// an empty one (a trailing slash) is allowed.
fn normalise(decoded: Cow<'_, str>, last: bool, rules: PathRules) -> Result<Seg<'_>, BadPath> {
    if decoded.is_empty() {
        return if last {
            Ok(Seg {
                form: decoded,
                exact: true,
                raw: "",
                again: None,
            })
        } else {
            Err(BadPath::new("the path has an empty segment ('//')"))
        };
    }
    let form = canonical(&decoded)?;
    // A backend that decodes twice sees the segment decoded once more.
    let mut again: Option<(String, Option<String>)> = None;
    for _ in 0..3 {
        let from = again.as_ref().map_or(decoded.as_ref(), |(a, _)| a.as_str());
        let Some(next) = decode_again(from) else {
            break;
        };
        let normal = canonical(&next)
            .map_err(|BadPath(why)| BadPath(Cow::Owned(format!("decoded once more, {why}"))))?;
        again = Some((next, normal));
    }
    let fold_if = |s: String| if rules.case_insensitive { fold(&s) } else { s };
    let again = again.map(|(next, normal)| fold_if(normal.unwrap_or(next)));
    let folded = match form {
        Some(form) => Some(fold_if(form)),
        None if rules.case_insensitive && !is_folded(&decoded) => Some(fold(&decoded)),
        None => None,
    };
    Ok(match folded {
        // Normalisation changed nothing: the segment is its own form.
        None => Seg {
            form: decoded,
            exact: true,
            raw: "",
            again,
        },
        Some(form) => {
            let exact = form == *decoded;
            Seg {
                form: Cow::Owned(form),
                exact,
                raw: "",
                again,
            }
        }
    })
}

/// Whether folding case leaves `s` as it is (checked without copying for
/// ASCII).
fn is_folded(s: &str) -> bool {
    if s.is_ascii() {
        !s.bytes().any(|b| b.is_ascii_uppercase())
    } else {
        fold(s) == s
    }
}

/// `s` as storage that folds case compares it: upper-cased as NTFS does
/// (so the dotless `ı` is `I`, the long `ſ` is `S`), then lower-cased.
fn fold(s: &str) -> String {
    s.to_uppercase().to_lowercase()
}

/// Checks a decoded, non-empty segment against the rules of the module
/// docs; `Some(form)` when normalising changes it, `None` when it is its
/// own normal form.
fn canonical(decoded: &str) -> Result<Option<String>, BadPath> {
    let mut ascii = true;
    let mut params = None;
    for (i, b) in decoded.bytes().enumerate() {
        match b {
            b'/' | b'\\' | 0..=0x1f | 0x7f => {
                return Err(BadPath::new(
                    "a path segment holds '/', '\\', NUL or a control character",
                ))
            }
            b';' if params.is_none() => params = Some(i),
            0x80.. => ascii = false,
            _ => {}
        }
    }
    let core = &decoded[..params.unwrap_or(decoded.len())];
    let normal: Option<String> = if ascii {
        None
    } else {
        if core.contains(BEST_FIT_SEPARATORS) {
            return Err(BadPath::new(
                "a path segment holds a character that some servers map to '/' or '\\'",
            ));
        }
        let nfkc: String = core.nfkc().collect();
        if nfkc
            .bytes()
            .any(|b| matches!(b, b'/' | b'\\' | 0..=0x1f | 0x7f))
        {
            return Err(BadPath::new(
                "a path segment normalises (NFKC) to one holding '/', '\\' or a control character",
            ));
        }
        // A normalised ';' starts parameters too.
        let cut = nfkc.find(';').unwrap_or(nfkc.len());
        (nfkc[..cut] != *core).then(|| nfkc[..cut].to_owned())
    };
    let form = normal.as_deref().unwrap_or(core);
    if form.trim_end_matches(['.', ' ']).is_empty() {
        return Err(BadPath::new(
            "the path has a segment that is empty, '.', '..' or only dots once its ';' parameters are dropped \
             (servlet containers and Windows read it as a dot segment)",
        ));
    }
    if form.ends_with(['.', ' ']) {
        return Err(BadPath::new(
            "a path segment may not end in '.' or ' ' (Windows drops them: 'orders.' is 'orders')",
        ));
    }
    Ok(match normal {
        Some(n) => Some(n),
        None if params.is_some() => Some(core.to_owned()),
        None => None,
    })
}

/// `segment` decoded once more, if it holds anything a second decoding
/// would change (`%XX`, or IIS's `%uXXXX`); bytes that are not UTF-8 come
/// out as U+FFFD.
fn decode_again(segment: &str) -> Option<String> {
    if !segment.contains('%') {
        return None;
    }
    let b = segment.as_bytes();
    let hex_at = |from: usize, n: usize| {
        b.get(from..from + n)
            .filter(|d| d.iter().all(u8::is_ascii_hexdigit))
            .map(|d| {
                u32::from_str_radix(std::str::from_utf8(d).expect("hex digits"), 16)
                    .expect("hex digits")
            })
    };
    let mut out: Vec<u8> = Vec::with_capacity(b.len());
    let mut changed = false;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            if let Some(v) = hex_at(i + 1, 2) {
                out.push(v as u8);
                (i, changed) = (i + 3, true);
                continue;
            }
            if matches!(b.get(i + 1), Some(b'u' | b'U')) {
                if let Some(c) = hex_at(i + 2, 4).and_then(char::from_u32) {
                    out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes());
                    (i, changed) = (i + 6, true);
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    changed.then(|| String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast path of `split` gives what `normalise` gives, for every
    /// segment of up to three characters over an alphabet that holds each
    /// kind of byte it treats apart (and it takes no segment `normalise`
    /// refuses or changes).
    #[test]
    fn plain_segments_are_their_own_normal_form() {
        let alphabet = [
            "a", "Z", "0", "-", "_", "~", ".", " ", ";", "%", "%41", "é", "\\",
        ];
        let mut words = vec![String::new()];
        for _ in 0..3 {
            let longer: Vec<String> = words
                .iter()
                .flat_map(|w| alphabet.iter().map(move |c| format!("{w}{c}")))
                .collect();
            words.extend(longer);
        }
        let mut plain = 0;
        for rules in [
            PathRules::default(),
            PathRules {
                case_insensitive: true,
            },
        ] {
            for raw in &words {
                if !is_plain(raw, rules) {
                    continue;
                }
                plain += 1;
                let slow = decode(raw).and_then(|d| normalise(d, false, rules));
                let seg = slow.unwrap_or_else(|e| panic!("{raw:?} is refused: {e:?}"));
                assert_eq!(seg.form, raw.as_str(), "{raw:?}");
                assert!(seg.exact && seg.again.is_none(), "{raw:?}");
            }
        }
        assert!(plain > 500, "{plain}");
    }

    fn kv() -> Routes {
        Routes::new(vec![
            Route::new("/kv/{lease}", None, false).unwrap(),
            Route::new("/jobs/*/state", Some("jobs"), true).unwrap(),
        ])
    }

    fn lease_of(path: &str) -> Option<String> {
        kv().resolve(path, true).unwrap().map(|m| match m.lease {
            Ok(name) => name.into(),
            Err(not) => not.segment,
        })
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
            "/kv/a\\b",
            "kv/orders",
            "//kv/orders/1",
            "/kv//orders",
            "/kv/orders//1",
            "//",
        ] {
            assert!(kv().resolve(bad, true).is_err(), "{bad}");
        }
    }

    /// Each rule of the path model (module docs), with the normalisation
    /// that makes it necessary. Seen failing before the model: every one of
    /// these from `..;` on was forwarded.
    #[test]
    fn every_normalisation_a_backend_does_is_refused() {
        for (bad, why) in [
            // Servlet path parameters, then dot segments (Tomcat, Jetty).
            ("/kv/orders/..;/payments/x", "servlet"),
            ("/kv/orders/%2e%2e;/payments/x", "servlet"),
            ("/kv/orders/..;x=1/payments/x", "servlet"),
            ("/kv/orders/.%2E;/payments/x", "servlet"),
            ("/kv/zz/..;/..;/outside/v5", "servlet"),
            ("/kv/orders/.;/x", "servlet"),
            ("/kv/orders/;x/y", "servlet: empty once parameters drop"),
            ("/kv/orders/..%3B/x", "decoded ';'"),
            // Decoded twice.
            ("/kv/orders/%252e%252e/x", "double decoding"),
            ("/kv/orders/%252F/x", "double decoding"),
            ("/kv/orders/%255c/x", "double decoding"),
            ("/kv/orders/%25u002e%25u002e/x", "double decoding, IIS %u"),
            // IIS's %u, overlong UTF-8.
            ("/kv/orders/%u002e%u002e/x", "IIS %u"),
            ("/kv/orders/%c0%ae%c0%ae/x", "overlong UTF-8"),
            // Unicode: NFKC maps these to '.', '..', '...', '/', '\', ';'.
            ("/kv/orders/%EF%BC%8E%EF%BC%8E/x", "fullwidth dots"),
            ("/kv/orders/\u{2025}/x", "two dot leader"),
            ("/kv/orders/\u{2026}/x", "ellipsis"),
            ("/kv/orders/a%EF%BC%8Fb/x", "fullwidth solidus"),
            ("/kv/orders/a%EF%BC%BCb/x", "fullwidth reverse solidus"),
            ("/kv/orders/..%EF%BC%9Bx/y", "fullwidth semicolon"),
            // Best fit.
            ("/kv/orders/a%C2%A5b/x", "yen: best fit to '\\'"),
            ("/kv/orders/a%E2%88%95b/x", "division slash"),
            // Windows: trailing dots and spaces.
            ("/kv/orders./x", "trailing dot"),
            ("/kv/orders/x%20/y", "trailing space"),
            ("/kv/orders/.../x", "only dots"),
            ("/kv/orders/.. /x", "dots and a space"),
            // Control characters.
            ("/kv/orders/a%09b", "tab"),
            ("/kv/orders/a%7F", "DEL"),
        ] {
            let routes = kv();
            let got = routes.resolve(bad, true);
            assert!(got.is_err(), "{bad} ({why}) was routed: {got:?}");
        }
        // What stays allowed: ';' inside a key, non-ASCII keys, dots inside.
        for ok in [
            "/kv/orders/a;b",
            "/kv/orders/caf%C3%A9",
            "/kv/orders/\u{65e5}\u{672c}",
            "/kv/orders/a.b.c",
            "/kv/orders/.hidden",
            "/kv/orders/100%2525",
        ] {
            assert_eq!(lease_of(ok), Some("orders".into()), "{ok}");
        }
    }

    #[test]
    fn routes_match_what_the_storage_will_see() {
        // Parameters on a literal do not leave the route: the servlet
        // container sees /kv/orders/1.
        assert_eq!(lease_of("/kv;x/orders/1"), Some("orders".into()));
        assert_eq!(lease_of("/%EF%BD%8Bv/orders/1"), Some("orders".into()));
        // A lease segment must be exactly a name.
        let routes = kv();
        let m = routes.resolve("/kv/orders;x/1", true).unwrap().unwrap();
        assert_eq!(m.lease.unwrap_err().segment, "orders;x");
        // Case folding, when the storage folds case.
        let folding = Routes::with_rules(
            vec![Route::new("/kv/{lease}", None, false).unwrap()],
            PathRules {
                case_insensitive: true,
            },
        );
        let m = folding.resolve("/KV/orders/1", true).unwrap().unwrap();
        assert_eq!(m.lease.unwrap().as_str(), "orders");
        let m = folding.resolve("/kv/Orders/1", true).unwrap().unwrap();
        assert!(m.lease.unwrap_err().why.is_some());
        // Without it, case matters, as it does for most storage.
        assert_eq!(lease_of("/KV/orders/1"), None);
        assert_eq!(lease_of("/kv/Orders/1"), Some("Orders".into()));
    }

    fn lease_per_key() -> Routes {
        Routes::new(vec![Route::new("/locks/{lease}", None, true)
            .unwrap()
            .with_upstream_prefix(Some("/v2/keys/locks"))
            .unwrap()])
    }

    /// Seen failing before the reach check: with the lease-per-key example
    /// these reads of fenced keys passed unfenced around the rewrite.
    #[test]
    fn reads_around_a_rewrite_of_fenced_keys_are_refused() {
        let routes = lease_per_key();
        for bad in [
            "/v2/keys/locks/job-7",
            "/v2/keys/locks/job-7/",
            "/v2/keys/locks/job-7;x",
            "/v2/keys/%6Cocks/job-7",
            "/v2/keys/locks",
            "/v2/keys/locks/",
            "/v2/keys",
            "/v2/keys/",
            "/v2",
            "/",
        ] {
            assert!(routes.resolve(bad, false).is_err(), "read {bad}");
            // An unrouted write: refused anyway unless unrouted writes are
            // allowed, and then because of where it lands.
            assert!(routes.resolve(bad, true).unwrap().is_none(), "{bad}");
            assert!(routes.check_unrouted_write(bad).is_err(), "write {bad}");
        }
        for ok in ["/v2/keys/other", "/v2/members", "/locks", "/health"] {
            assert!(routes.resolve(ok, false).unwrap().is_none(), "{ok}");
            assert!(routes.check_unrouted_write(ok).is_ok(), "{ok}");
        }
        let m = routes.resolve("/locks/job-7", false).unwrap().unwrap();
        assert_eq!(m.lease.unwrap().as_str(), "job-7");
    }

    /// Seen failing before (a review): a read that a double-decoding proxy
    /// turns into a fenced key was forwarded, and so was an unrouted write
    /// that such a proxy turns into a route's path.
    #[test]
    fn what_a_second_decoding_makes_of_a_path_is_checked_too() {
        let routes = lease_per_key();
        assert!(routes.resolve("/v2/keys/lock%2573/job-7", false).is_err());
        assert!(routes.resolve("/v2/keys/%256Cocks", false).is_err());
        assert!(routes
            .resolve("/v2/keys/other%2573", false)
            .unwrap()
            .is_none());
        let kv = kv();
        assert!(kv.check_unrouted_write("/k%2576/payments/x").is_err());
        assert!(kv.check_unrouted_write("/other%2573/x").is_ok());
        // A fenced write's own keys may hold an escaped '%'.
        assert!(kv.resolve("/kv/orders/100%2525", true).unwrap().is_some());
    }

    /// NTFS compares names upper-cased: the dotless `ı` is `I` there.
    #[test]
    fn case_folding_is_the_upper_case_comparison() {
        let folding = Routes::with_rules(
            vec![Route::new("/files/{lease}", None, false).unwrap()],
            PathRules {
                case_insensitive: true,
            },
        );
        let m = folding
            .resolve("/f%C4%B1les/orders/1", true)
            .unwrap()
            .unwrap();
        assert_eq!(m.lease.unwrap().as_str(), "orders");
    }

    #[test]
    fn two_routes_that_reach_the_same_keys_keep_their_leases_apart() {
        let routes = Routes::new(vec![
            Route::new("/special", Some("jobs"), false).unwrap(),
            Route::new("/kv/{lease}", None, false)
                .unwrap()
                .with_upstream_prefix(Some("/"))
                .unwrap(),
        ]);
        // /kv/special/x would land on /special/x, the keys of lease jobs.
        assert!(routes.resolve("/kv/special/x", true).is_err());
        assert!(routes.resolve("/kv/other/x", true).unwrap().is_some());
        // A fixed-lease route before a {lease} route, no rewrite: first
        // match wins on both sides, so each key has one lease.
        let routes = Routes::new(vec![
            Route::new("/kv/special", Some("jobs"), false).unwrap(),
            Route::new("/kv/{lease}", None, false).unwrap(),
        ]);
        let m = routes.resolve("/kv/special/x", true).unwrap().unwrap();
        assert_eq!(m.lease.unwrap().as_str(), "jobs");
        // A write to a parent of another route's keys could delete them.
        let routes = Routes::new(vec![
            Route::new("/jobs/*/state", Some("jobs"), false).unwrap(),
            Route::new("/jobs/{lease}", None, false).unwrap(),
        ]);
        assert!(routes.resolve("/jobs/7", true).is_err());
        assert!(routes.resolve("/jobs/7", false).unwrap().is_some());
        assert!(routes.resolve("/jobs/7/state", true).unwrap().is_some());
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
        let m = routes.resolve("/keys/orders/a%20b", true).unwrap().unwrap();
        assert_eq!(
            m.upstream_path("/keys/orders/a%20b", Some("x=1"))
                .as_deref(),
            Some("/v2/keys/orders/a%20b?x=1")
        );
        let m = routes.resolve("/root/orders", true).unwrap().unwrap();
        assert_eq!(
            m.upstream_path("/root/orders", None).as_deref(),
            Some("/orders")
        );
        assert!(kv()
            .resolve("/kv/a", true)
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
        assert!(Route::new("/kv./{lease}", None, false).is_err());
        assert!(Route::new("/kv;x/{lease}", None, false).is_err());
        assert!(Route::new("/kv/{lease}", None, false)
            .unwrap()
            .with_upstream_prefix(Some("/v2/../x"))
            .is_err());
    }
}
