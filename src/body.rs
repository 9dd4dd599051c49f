//! The one body type that flows through fencegate's services, and helpers.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};

/// Any error a body can fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed, streaming HTTP body. Unsync so hyper's incoming body and the
/// upstream client's bodies both fit without copying.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// The boxed future of a service's answer, for the services that box
/// theirs (the app, the fence's inner service, the cluster member).
pub type ResponseFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<http::Response<Body>, std::convert::Infallible>>
            + Send,
    >,
>;

/// A body of exactly these bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// Boxes any body with byte chunks.
pub fn boxed<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// A failure of the client's request body (cut off, or chunked framing
/// hyper refused), as opposed to a failure of the backend.
#[derive(Debug)]
pub struct ClientBodyError(pub BoxError);

impl std::fmt::Display for ClientBodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the client's request body failed: {}", self.0)
    }
}

impl std::error::Error for ClientBodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A client's request body whose failures say they are the client's.
pub fn from_client<B>(body: B) -> impl http_body::Body<Data = Bytes, Error = ClientBodyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    body.map_err(|e| ClientBodyError(e.into()))
}

/// Whether `err` (or its source chain) is a body-limit overflow.
pub fn is_length_limit(err: &(dyn std::error::Error + 'static)) -> bool {
    in_chain::<http_body_util::LengthLimitError>(err)
}

/// Whether `err` (or its source chain) is a failure of the client's body.
pub fn is_client_body_error(err: &(dyn std::error::Error + 'static)) -> bool {
    in_chain::<ClientBodyError>(err)
}

fn in_chain<E: std::error::Error + 'static>(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<E>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Why a body could not be read in full.
#[derive(Debug)]
pub enum ReadError {
    /// The body is longer than the limit.
    TooLarge,
    /// The stream failed (client gone, bad framing).
    Failed(BoxError),
    /// Nothing arrived for the idle time.
    Stalled,
}

/// Reads a whole body of at most `limit` bytes. A limit already imposed
/// upstream (the app's body limit) reports as [`ReadError::TooLarge`] too.
pub async fn collect(body: Body, limit: usize) -> Result<Bytes, ReadError> {
    collect_idle(body, limit, None).await
}

/// [`collect`], failing with [`ReadError::Stalled`] when nothing arrives for
/// `idle` (a sender that stopped; one that sends slowly goes on).
pub async fn collect_idle(
    mut body: Body,
    limit: usize,
    idle: Option<std::time::Duration>,
) -> Result<Bytes, ReadError> {
    let mut buf = bytes::BytesMut::new();
    loop {
        let next = match idle {
            Some(idle) => tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| ReadError::Stalled)?,
            None => body.frame().await,
        };
        let Some(frame) = next else { break };
        let frame = frame.map_err(|e| {
            if is_length_limit(&*e) {
                ReadError::TooLarge
            } else {
                ReadError::Failed(e)
            }
        })?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(ReadError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.freeze())
}
