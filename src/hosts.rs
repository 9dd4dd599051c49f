//! Which bucket a client's `Host` names, where the storage gets that `Host`
//! (`proxy.preserve_host`): S3 and the stores that copy it read a request
//! to `<bucket>.<domain>` as one of that bucket, with the whole path as the
//! key (virtual-hosted style), and one to the domain itself, to an IP
//! address or to a name without a dot as path-style (`/<bucket>/<key>`).
//! fencegate routes, fences and names keys by the path the storage will act
//! on ([`virtual_path`]): a virtual-hosted request as `/<bucket><path>`, a
//! path-style one by its path, whatever address the client reached
//! fencegate at. A `Host` it cannot read one way only is refused.
//!
//! Without `preserve_host` the storage gets the upstream's own host, and
//! every request is path-style.

use http::header::HOST;
use http::Request;

/// How the storage reads the client's `Host`: the configuration's
/// `proxy.virtual_host_domains` and `proxy.path_style_hosts`.
#[derive(Clone, Debug, Default)]
pub struct Hosts {
    /// Domains under which a host's first label names a bucket (lower
    /// case, no leading dot).
    domains: Vec<String>,
    /// Hosts whose requests are path-style though they have a dot (lower
    /// case).
    path_style: Vec<String>,
}

/// Why a configured host list cannot be used.
#[derive(Debug)]
pub struct BadHost(pub String);

/// Why a request's `Host` cannot be read one way only.
#[derive(Debug, PartialEq, Eq)]
pub struct UnreadableHost(pub &'static str);

/// How the storage reads one `Host`.
#[derive(Debug, PartialEq, Eq)]
pub enum Style<'h> {
    /// The bucket is the path's first segment.
    Path,
    /// Virtual-hosted: the host's first label is the bucket, the path is
    /// the key.
    Virtual(&'h str),
}

impl Hosts {
    /// The hosts as configured: `domains` (S3's endpoint hosts, such as
    /// `s3.us-east-1.amazonaws.com` or `s3.local`) and `path_style`
    /// (dotted hosts whose requests are path-style).
    pub fn new(domains: &[String], path_style: &[String]) -> Result<Self, BadHost> {
        let clean = |list: &[String], what: &str| -> Result<Vec<String>, BadHost> {
            list.iter()
                .map(|h| {
                    let h = h.strip_prefix('.').unwrap_or(h).to_ascii_lowercase();
                    let valid = !h.is_empty()
                        && h.split('.').all(|l| {
                            !l.is_empty()
                                && l.bytes()
                                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                        });
                    if !valid {
                        Err(BadHost(format!("{what}: {h:?} is not a host name")))
                    } else if h.ends_with(".svc.cluster.local") {
                        // moto reads every such host path-style.
                        Err(BadHost(format!(
                            "{what}: {h:?}: storages read hosts under .svc.cluster.local path-style"
                        )))
                    } else {
                        Ok(h)
                    }
                })
                .collect()
        };
        Ok(Self {
            domains: clean(domains, "proxy.virtual_host_domains")?,
            path_style: clean(path_style, "proxy.path_style_hosts")?,
        })
    }

    /// How the storage reads `host` (a `Host` header's value, port and
    /// all).
    pub fn style<'h>(&self, host: &'h str) -> Result<Style<'h>, UnreadableHost> {
        let name = strip_port(host).ok_or(UnreadableHost("the Host header is not a host"))?;
        let is_ip = match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
            Some(v6) => {
                v6.parse::<std::net::Ipv6Addr>()
                    .map_err(|_| UnreadableHost("the Host header is not a host"))?;
                true
            }
            None => name.parse::<std::net::Ipv4Addr>().is_ok(),
        };
        if is_ip || !name.contains('.') {
            return Ok(Style::Path);
        }
        let lower = name.to_ascii_lowercase();
        if self.path_style.contains(&lower) || self.domains.contains(&lower) {
            return Ok(Style::Path);
        }
        for domain in &self.domains {
            let Some(label) = lower
                .strip_suffix(domain.as_str())
                .and_then(|l| l.strip_suffix('.'))
            else {
                continue;
            };
            // A bucket as S3 names one, one label: a dotted bucket
            // (`a.b.domain`) is `a.b` to S3 and `a` to others. Labels some
            // storages read otherwise are refused too: moto takes a host
            // that starts with `localhost` or `localstack` for path-style,
            // and drops a leading `www.`.
            let bucket = &name[..label.len()];
            let plain = !bucket.is_empty()
                && bucket
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !["localhost", "localstack"]
                    .iter()
                    .any(|p| bucket.starts_with(p))
                && bucket != "www";
            return if plain {
                Ok(Style::Virtual(bucket))
            } else {
                Err(UnreadableHost(
                    "the Host names a bucket under a virtual-hosted domain that is not one lower-case label",
                ))
            };
        }
        Err(UnreadableHost(
            "the Host is neither path-style (an IP address, a name without a dot, or one of proxy.path_style_hosts) nor a bucket under proxy.virtual_host_domains, so which bucket the storage reads from it is unknown",
        ))
    }
}

/// `host` without its port: `None` if it is not `name[:port]` or
/// `[v6][:port]`.
fn strip_port(host: &str) -> Option<&str> {
    if host.starts_with('[') {
        let end = host.find(']')?;
        let rest = &host[end + 1..];
        let port_ok = rest.is_empty() || rest.strip_prefix(':').is_some_and(is_port);
        return port_ok.then_some(&host[..=end]);
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if is_port(port) => name,
        Some(_) => return None,
        None => host,
    };
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    valid.then_some(name)
}

/// Whether `port` is a port number's digits.
fn is_port(port: &str) -> bool {
    !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
}

/// The path the storage will act on for `req`, if its `Host` makes it
/// other than the request's own: `/<bucket><path>` for a virtual-hosted
/// request (`None` for a path-style one, or for any when `hosts` is `None`:
/// the storage never gets the client's `Host`).
pub fn virtual_path<B>(
    req: &Request<B>,
    hosts: Option<&Hosts>,
) -> Result<Option<String>, UnreadableHost> {
    let Some(hosts) = hosts else {
        return Ok(None);
    };
    let mut values = req.headers().get_all(HOST).iter();
    let host = match (values.next(), values.next()) {
        (Some(_), Some(_)) => return Err(UnreadableHost("the request has more than one Host")),
        (Some(h), None) => h
            .to_str()
            .map_err(|_| UnreadableHost("the Host header is not text"))?,
        // No Host line (an absolute-form request may name an authority
        // all the same): the storage gets the upstream's own host, and
        // reads the request path-style.
        (None, _) => return Ok(None),
    };
    match hosts.style(host)? {
        Style::Path => Ok(None),
        Style::Virtual(bucket) => {
            let path = req.uri().path();
            let rest = if path == "/" { "" } else { path };
            Ok(Some(format!("/{bucket}{rest}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> Hosts {
        Hosts::new(
            &["s3.local".into(), ".S3.Example.com".into()],
            &["dav.example.org".into()],
        )
        .unwrap()
    }

    #[test]
    fn hosts_are_read_as_s3_reads_them() {
        let h = hosts();
        for (host, style) in [
            ("127.0.0.1:9000", Style::Path),
            ("[::1]:9000", Style::Path),
            ("[::1]", Style::Path),
            ("localhost", Style::Path),
            ("minio:9000", Style::Path),
            ("s3.local", Style::Path),
            ("s3.example.com:443", Style::Path),
            ("dav.example.org", Style::Path),
            ("DAV.example.org:80", Style::Path),
            (
                "orders-bucket.s3.local:9000",
                Style::Virtual("orders-bucket"),
            ),
            ("b1.S3.EXAMPLE.com", Style::Virtual("b1")),
        ] {
            assert_eq!(h.style(host), Ok(style), "{host}");
        }
        for host in [
            "fencegate.example.net",
            "a.b.s3.local",
            "Orders.s3.local",
            "x_y.s3.local",
            ".s3.local",
            "s3.local:port",
            "a b",
            "[::1",
            "[anything]",
            "host:1:2",
            "localhost-x.s3.local",
            "localstack.s3.local",
            "www.s3.local",
        ] {
            assert!(h.style(host).is_err(), "{host}");
        }
        assert!(Hosts::new(&["a..b".into()], &[]).is_err());
        assert!(Hosts::new(&[], &["".into()]).is_err());
        assert!(Hosts::new(&["s3.ns.svc.cluster.local".into()], &[]).is_err());
    }

    #[test]
    fn virtual_hosted_paths_put_the_bucket_first() {
        let h = hosts();
        let req = |host: Option<&str>, uri: &str| {
            let mut b = Request::builder().uri(uri);
            if let Some(host) = host {
                b = b.header("host", host);
            }
            b.body(()).unwrap()
        };
        let path = |r: &Request<()>, h: Option<&Hosts>| virtual_path(r, h).unwrap();
        let r = req(Some("orders-bucket.s3.local"), "/M/x?tagging");
        assert_eq!(path(&r, Some(&h)).as_deref(), Some("/orders-bucket/M/x"));
        let r = req(Some("orders-bucket.s3.local"), "/");
        assert_eq!(path(&r, Some(&h)).as_deref(), Some("/orders-bucket"));
        let r = req(Some("127.0.0.1:8080"), "/orders-bucket/M/x");
        assert_eq!(path(&r, Some(&h)), None);
        // The storage never sees the Host: path-style, whatever it says.
        let r = req(Some("other.s3.local"), "/orders-bucket/M/x");
        assert_eq!(path(&r, None), None);
        let r = req(Some("fencegate.example.net"), "/b/k");
        assert!(virtual_path(&r, Some(&h)).is_err());
        let mut r = req(Some("a.s3.local"), "/k");
        r.headers_mut()
            .append("host", "b.s3.local".parse().unwrap());
        assert!(virtual_path(&r, Some(&h)).is_err());
        // The storage gets the upstream's Host, not the URI's authority
        // (seen failing when the authority was read: fenced as bucket b2,
        // written path-style to bucket k).
        let r = req(None, "http://b2.s3.local/k/x");
        assert_eq!(path(&r, Some(&h)), None);
    }
}
