//! Backends: where admitted requests go.
//!
//! [`Backend`] is the storage fencegate fronts: the [`embedded`] in-memory
//! key-value store (the default) or an HTTP [`upstream`]. Besides serving
//! requests as a tower service, a backend takes an admitted write in the
//! two steps of an [`Exchange`], so that the fence can check the write
//! once more between them.

pub mod embedded;
mod h1;
mod pool;
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
    ClientAddr, ConnectionMode, RequestContext, Unready, Upstream, UpstreamError, UpstreamOptions,
    MIN_READ_BUFFER,
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

/// The two steps in which the fence hands an admitted write to a backend,
/// so that it can check the write once more right before its first byte
/// leaves, after whatever had to come first (reading the first piece of
/// its body, opening a connection) and may have taken time: step one,
/// [`Exchange::stage`], sends nothing; the fence then checks, and either
/// sends ([`Exchange::send`]) or withdraws ([`Exchange::withdraw`]); a
/// request [`Sent::Again`] is staged again ([`Exchange::restage`]) and
/// checked again. The backend never calls back into the fence or the
/// lease store.
pub trait Exchange: Service<Request<Body>, Response = Response<Body>, Error = Infallible> {
    /// A request ready to send.
    type Staged: Send + 'static;

    /// Step one: everything before the first byte leaves; nothing is sent.
    /// `Err`: the answer, and nothing was sent, whatever failed: the fence
    /// then holds no later term back for this write.
    fn stage(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Self::Staged, Response<Body>>> + Send + 'static;

    /// Step two: sends a staged request; what came of it.
    fn send(
        &mut self,
        staged: Self::Staged,
    ) -> impl Future<Output = Sent<Self::Staged>> + Send + 'static;

    /// Step one again, after [`Sent::Again`]: nothing is sent. `Err`: the
    /// answer (nothing was sent).
    fn restage(
        &mut self,
        staged: Self::Staged,
    ) -> impl Future<Output = Result<Self::Staged, Response<Body>>> + Send + 'static;

    /// A staged request not sent after all: what step one took goes back.
    fn withdraw(&mut self, staged: Self::Staged) {
        drop(staged);
    }
}

/// What came of step two of an [`Exchange`].
#[derive(Debug)]
pub enum Sent<S> {
    /// The storage's answer.
    Answered(Response<Body>),
    /// Fencegate's answer when the exchange failed after bytes of the
    /// request may have left (a lost connection, a timeout, an answer it
    /// could not relay): the storage may apply the write or not, now or
    /// later.
    Unknown(Response<Body>),
    /// Fencegate's answer when not a byte of the request left (the
    /// connection could not be had, or its first write failed outright).
    NotSent(Response<Body>),
    /// It may go again on a fresh connection, staged anew
    /// ([`Exchange::restage`]) and checked first: nothing of it left on a
    /// reused connection the storage had closed, or it is a `GET` or
    /// `HEAD` with no body whose reused connection failed before any byte
    /// of the answer (the storage's application never had it).
    Again(S),
}

/// A write [`Backend`] staged.
#[derive(Debug)]
pub enum Staged {
    /// The embedded store's: nothing comes before sending.
    Embedded(EmbeddedStore, Request<Body>),
    /// The upstream's: its first body piece read, a connection open.
    Upstream(upstream::Staged),
}

impl Exchange for Backend {
    type Staged = Staged;

    fn stage(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Staged, Response<Body>>> + Send + 'static {
        match self {
            Backend::Embedded(store) => Step::Embedded {
                fut: std::future::ready(Staged::Embedded(store.clone(), req)),
                wrap: Ok,
            },
            Backend::Upstream(upstream) => Step::Upstream {
                fut: upstream.stage(req),
                wrap: upstream_staged,
            },
        }
    }

    fn send(&mut self, staged: Staged) -> impl Future<Output = Sent<Staged>> + Send + 'static {
        match staged {
            Staged::Embedded(store, req) => Step::Embedded {
                fut: store.handle(req),
                wrap: Sent::Answered,
            },
            Staged::Upstream(staged) => Step::Upstream {
                fut: staged.send(),
                wrap: upstream_sent,
            },
        }
    }

    fn restage(
        &mut self,
        staged: Staged,
    ) -> impl Future<Output = Result<Staged, Response<Body>>> + Send + 'static {
        match staged {
            // Never given back: the embedded store sends at once.
            Staged::Embedded(store, req) => Step::Embedded {
                fut: std::future::ready(Staged::Embedded(store, req)),
                wrap: Ok,
            },
            Staged::Upstream(staged) => Step::Upstream {
                fut: staged.restage(),
                wrap: upstream_staged,
            },
        }
    }

    fn withdraw(&mut self, staged: Staged) {
        if let Staged::Upstream(staged) = staged {
            staged.withdraw();
        }
    }
}

/// The upstream's staged request, as the backend's.
// The error is the answer to a request not sent, moved once.
#[allow(clippy::result_large_err)]
fn upstream_staged(
    staged: Result<upstream::Staged, Response<Body>>,
) -> Result<Staged, Response<Body>> {
    staged.map(Staged::Upstream)
}

/// What came of sending the upstream's staged request, as the backend's.
fn upstream_sent(sent: Sent<upstream::Staged>) -> Sent<Staged> {
    match sent {
        Sent::Answered(res) => Sent::Answered(res),
        Sent::Unknown(res) => Sent::Unknown(res),
        Sent::NotSent(res) => Sent::NotSent(res),
        Sent::Again(staged) => Sent::Again(Staged::Upstream(staged)),
    }
}

pin_project_lite::pin_project! {
    /// A step of [`Backend`]'s exchange: the embedded store's or the
    /// upstream's future, its output wrapped. One future, not an `async`
    /// block around another: the upstream's is large, and each layer would
    /// copy it once more.
    #[project = StepProj]
    enum Step<E, U, T, A, B> {
        Embedded { #[pin] fut: E, wrap: fn(A) -> T },
        Upstream { #[pin] fut: U, wrap: fn(B) -> T },
    }
}

impl<E, U, T, A, B> Future for Step<E, U, T, A, B>
where
    E: Future<Output = A>,
    U: Future<Output = B>,
{
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match self.project() {
            StepProj::Embedded { fut, wrap } => fut.poll(cx).map(*wrap),
            StepProj::Upstream { fut, wrap } => fut.poll(cx).map(*wrap),
        }
    }
}

/// A backend with nothing to do before sending, as an [`Exchange`]: step
/// one keeps the request, step two calls the service with it (tests put
/// instrumented backends here).
#[derive(Clone, Debug)]
pub struct Unstaged<S>(pub S);

impl<S> Service<Request<Body>> for Unstaged<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        self.0.call(req)
    }
}

impl<S> Exchange for Unstaged<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Staged = Request<Body>;

    fn stage(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Request<Body>, Response<Body>>> + Send + 'static {
        std::future::ready(Ok(req))
    }

    fn send(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Sent<Request<Body>>> + Send + 'static {
        Step::<_, std::future::Ready<()>, _, _, ()>::Embedded {
            fut: self.0.call(req),
            wrap: answered,
        }
    }

    fn restage(
        &mut self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Request<Body>, Response<Body>>> + Send + 'static {
        // Never given back: `send` answers at once.
        std::future::ready(Ok(req))
    }
}

/// A service's answer, as step two's.
fn answered<S>(answer: Result<Response<Body>, Infallible>) -> Sent<S> {
    match answer {
        Ok(res) => Sent::Answered(res),
        Err(never) => match never {},
    }
}
