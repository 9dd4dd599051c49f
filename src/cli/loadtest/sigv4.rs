//! AWS Signature Version 4 for the load test's requests to S3 or DynamoDB
//! (`--aws-region`): the `Authorization`, `x-amz-date` and
//! `x-amz-content-sha256` headers of one request, signed with the
//! credentials from `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`.
//!
//! Signed: the method, the path and query, `Host`, those two headers and
//! DynamoDB's `X-Amz-Target`. Nothing else is, so fencegate's
//! `Fencing-Token` and `Fencing-Lease-Id` (which fencegate drops before
//! forwarding) do not break the signature.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::hex;

/// Credentials, region and service (`s3`, `dynamodb`).
#[derive(Clone)]
pub struct Signer {
    key_id: String,
    secret: String,
    region: String,
    service: &'static str,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("key_id", &self.key_id)
            .field("region", &self.region)
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

/// The headers to add to a request.
pub struct Signed {
    pub authorization: String,
    pub amz_date: String,
    pub content_sha256: String,
}

impl Signer {
    /// The signer for `service` (`s3`, `dynamodb`) in `region` with these
    /// credentials.
    pub fn new(key_id: &str, secret: &str, region: &str, service: &'static str) -> Self {
        Self {
            key_id: key_id.to_owned(),
            secret: secret.to_owned(),
            region: region.to_owned(),
            service,
        }
    }

    /// The signer for `service` in `region`, with the credentials from the
    /// environment.
    pub fn from_env(region: &str, service: &'static str) -> Result<Self, super::LoadtestError> {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .ok_or_else(|| {
                    super::LoadtestError::Usage(format!(
                        "--aws-region needs {name} in the environment"
                    ))
                })
        };
        Ok(Self {
            key_id: var("AWS_ACCESS_KEY_ID")?,
            secret: var("AWS_SECRET_ACCESS_KEY")?,
            region: region.to_owned(),
            service,
        })
    }

    /// Signs `method` of `path_and_query` at `host` (as the `Host` header
    /// says it) with `body` and the request's `X-Amz-Target` (DynamoDB's
    /// operation), at `unix_s` seconds since the epoch.
    pub fn sign(
        &self,
        method: &str,
        host: &str,
        path_and_query: &str,
        amz_target: Option<&str>,
        body: &[u8],
        unix_s: u64,
    ) -> Signed {
        let amz_date = amz_date(unix_s);
        let day = &amz_date[..8];
        let content_sha256 = hex::encode(&Sha256::digest(body));
        let (path, query) = path_and_query
            .split_once('?')
            .unwrap_or((path_and_query, ""));
        let mut params: Vec<String> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                if p.contains('=') {
                    p.to_owned()
                } else {
                    format!("{p}=")
                }
            })
            .collect();
        params.sort_unstable();
        let (signed_headers, target) = match amz_target {
            Some(t) => (
                "host;x-amz-content-sha256;x-amz-date;x-amz-target",
                format!("x-amz-target:{}\n", t.trim()),
            ),
            None => ("host;x-amz-content-sha256;x-amz-date", String::new()),
        };
        let canonical = format!(
            "{method}\n{path}\n{query}\nhost:{host}\nx-amz-content-sha256:{content_sha256}\n\
             x-amz-date:{amz_date}\n{target}\n{signed_headers}\n{content_sha256}",
            query = params.join("&"),
        );
        let scope = format!("{day}/{}/{}/aws4_request", self.region, self.service);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
            hex::encode(&Sha256::digest(canonical.as_bytes()))
        );
        let mut key = hmac(format!("AWS4{}", self.secret).as_bytes(), day.as_bytes());
        for part in [self.region.as_str(), self.service, "aws4_request"] {
            key = hmac(&key, part.as_bytes());
        }
        let signature = hex::encode(&hmac(&key, to_sign.as_bytes()));
        Signed {
            authorization: format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, Signature={signature}",
                self.key_id
            ),
            amz_date,
            content_sha256,
        }
    }
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// `YYYYMMDDTHHMMSSZ` of `unix_s` seconds since the epoch, in UTC.
fn amz_date(unix_s: u64) -> String {
    let (days, rest) = (unix_s / 86_400, unix_s % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert_eq!(amz_date(951_782_400), "20000229T000000Z");
        assert_eq!(amz_date(1_369_353_600), "20130524T000000Z");
        assert_eq!(amz_date(1_796_342_399), "20261203T235959Z");
    }

    /// A PUT signed by botocore's `S3SigV4Auth` (boto3 1.44.8) at the
    /// same time with the same credentials: the same signature.
    #[test]
    fn botocore_signs_the_same() {
        let s = Signer {
            key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            region: "garage".into(),
            service: "s3",
        };
        let signed = s.sign(
            "PUT",
            "127.0.0.1:8280",
            "/orders-bucket/lt-0/k1?x-id=PutObject",
            None,
            b"fencegate-loadtest.r1-w1-1.t5.",
            1_369_353_600,
        );
        assert_eq!(signed.amz_date, "20130524T000000Z");
        assert_eq!(
            signed.authorization,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/garage/s3/aws4_request, \
             SignedHeaders=host;x-amz-content-sha256;x-amz-date, \
             Signature=1ead43ba717174a7358ff2480bfafce7fa008f6be6ab90b0b773a734864daf8d"
        );
    }

    /// A GetItem signed by botocore's `SigV4Auth` for `dynamodb` (boto3
    /// 1.44.18, with the same `X-Amz-Content-SHA256` header set) at the
    /// same time with the same credentials: the same signature.
    #[test]
    fn botocore_signs_dynamodb_the_same() {
        let s = Signer {
            key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            region: "us-east-1".into(),
            service: "dynamodb",
        };
        let signed = s.sign(
            "POST",
            "127.0.0.1:8000",
            "/",
            Some("DynamoDB_20120810.GetItem"),
            br#"{"TableName":"jobs","Key":{"pk":{"S":"lt-0/k1"}},"ConsistentRead":true}"#,
            1_369_353_600,
        );
        assert_eq!(
            signed.authorization,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/dynamodb/aws4_request, \
             SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-target, \
             Signature=c11915b6aa7829f6234805a490c50f84198b1bdc99b10e1001ed6328959a98d2"
        );
    }
}
