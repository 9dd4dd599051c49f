//! Backends: where admitted requests go.
//!
//! [`Backend`] is the storage fencegate fronts: the [`embedded`] in-memory
//! key-value store (the default) or an HTTP [`upstream`].

pub mod embedded;
mod h1;
pub mod upstream;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use crate::body::Body;
pub use embedded::EmbeddedStore;
pub use upstream::{
    BeforeSend, ClientAddr, ConnectionMode, RequestContext, Unready, Upstream, UpstreamError,
    UpstreamOptions, MIN_READ_BUFFER,
};

/// The storage behind the fence.
#[derive(Clone, Debug)]
pub enum Backend {
    Embedded(EmbeddedStore),
    Upstream(Upstream),
}

impl Service<Request<Body>> for Backend {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        match self {
            Backend::Embedded(store) => store.call(req),
            Backend::Upstream(upstream) => upstream.call(req),
        }
    }
}
