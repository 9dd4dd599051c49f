//! The accept loop: one HTTP/1.1 listener (plain or TLS), connection limits,
//! and graceful shutdown.
//!
//! Shutdown is an input: [`run`] serves until the `shutdown` future completes,
//! then stops accepting, lets in-flight requests finish for up to the grace
//! period, and returns.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower::{Service, ServiceExt};

use crate::backend::{ClientAddr, RequestContext};
use crate::body::Body;
use crate::framing::{head_buffer_bytes, Guarded, Heads};
use crate::rt::TimerSlot;

/// Connection-level settings.
#[derive(Clone, Copy, Debug)]
pub struct ServerOptions {
    /// Connections served at once; further clients wait in the backlog.
    pub max_connections: usize,
    /// Time a client has to send a complete request head.
    pub header_read_timeout_ms: u64,
    /// The request-head limit; hyper's read buffer is sized from it.
    pub max_header_bytes: usize,
    /// Time in-flight requests get to finish at shutdown.
    pub shutdown_grace_ms: u64,
    /// Time a client may accept no response bytes before its connection is
    /// reset (slow or stalled readers).
    pub send_timeout_ms: u64,
    /// The kernel send buffer of each client connection (`SO_SNDBUF`; the
    /// kernel doubles it), in bytes; 0: the system's own, which grows to
    /// several MiB for a client that stops reading.
    pub send_buffer_bytes: usize,
    /// How often a timer that does nothing fires while the server runs (0:
    /// never). tokio's timer wakes its driver through the I/O driver (an
    /// eventfd write, then one more `epoll_wait`) whenever a timer is set to
    /// fire before every timer it holds; hyper's head deadline, set anew
    /// for each request on a kept-alive connection, and the upstream
    /// exchange's deadline were such timers once per request. Both are now
    /// timers a connection keeps and moves later (`rt::TimerSlot`,
    /// `backend::h1::Timed`), which wake the driver only when moved
    /// earlier. A tick shorter than every such deadline is always earlier,
    /// so they are set without waking anything: one `write` and one
    /// `epoll_wait` fewer per request (strace, 2026-12-03, when the
    /// deadlines were still timers per request).
    pub timer_tick_ms: u64,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            header_read_timeout_ms: 10_000,
            max_header_bytes: 16 * 1024,
            shutdown_grace_ms: 10_000,
            send_timeout_ms: 30_000,
            send_buffer_bytes: 256 * 1024,
            timer_tick_ms: 500,
        }
    }
}

/// What a listener serves: a cloneable tower service of hyper's requests,
/// whose futures may move between threads.
pub trait Serves:
    Service<
        Request<Incoming>,
        Response = Response<Body>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> Serves for S where
    S: Service<
            Request<Incoming>,
            Response = Response<Body>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Serves `app` over plain HTTP on `listener` until `shutdown` completes.
pub async fn run<S>(
    listener: TcpListener,
    app: S,
    options: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()>
where
    S: Serves,
{
    run_with_tls(listener, None, app, options, shutdown).await
}

/// A timer that fires every `period_ms` and does nothing else (see
/// [`ServerOptions::timer_tick_ms`]).
async fn tick(period_ms: u64) {
    let mut every = tokio::time::interval(Duration::from_millis(period_ms));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `app` on `listener`, over TLS when `tls` is given, until
/// `shutdown` completes. The TLS handshake must finish within the header
/// read timeout.
pub async fn run_with_tls<S>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: S,
    options: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()>
where
    S: Serves,
{
    let permits = Arc::new(Semaphore::new(options.max_connections));
    accept_loop(listener, tls, app, options, permits, shutdown).await
}

/// [`run_with_tls`] on `threads` threads: this one and `threads - 1` more,
/// each with a current-thread runtime of its own, all accepting from the
/// same listening socket (a copy of its descriptor each, as nginx's workers
/// share theirs) and serving their connections start to finish, within one
/// `max_connections` for all, until `stop` turns true. Returns once every
/// thread has drained.
pub async fn run_on_threads<S>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: S,
    options: ServerOptions,
    threads: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()>
where
    S: Serves,
{
    // Every thread stops at `stop`, or at `abort` if another failed to start.
    let (abort, aborted) = tokio::sync::watch::channel(false);
    let until = |mut stop: tokio::sync::watch::Receiver<bool>,
                 mut aborted: tokio::sync::watch::Receiver<bool>| async move {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => {}
            _ = aborted.wait_for(|abort| *abort) => {}
        }
    };
    let permits = Arc::new(Semaphore::new(options.max_connections));
    let mut others = Vec::new();
    let mut started = Ok(());
    for k in 1..threads {
        let socket = match same_socket(&listener) {
            Ok(socket) => socket,
            Err(e) => {
                started = Err(e);
                break;
            }
        };
        let (ready, readied) = tokio::sync::oneshot::channel();
        let (done, finished) = tokio::sync::oneshot::channel();
        let (tls, app, permits) = (tls.clone(), app.clone(), permits.clone());
        let shutdown = until(stop.clone(), aborted.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("fencegate-{k}"))
            .spawn(move || {
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .and_then(|runtime| {
                        runtime.block_on(async move {
                            let listener = TcpListener::from_std(socket)?;
                            let _ = ready.send(());
                            accept_loop(listener, tls, app, options, permits, shutdown).await
                        })
                    });
                let _ = done.send(served);
            });
        if let Err(e) = spawned {
            started = Err(e);
            break;
        }
        // Serving, or failed (then `finished` says why).
        if readied.await.is_err() {
            started = Err(match finished.await {
                Ok(Err(e)) => e,
                _ => std::io::Error::other("a serving thread did not start"),
            });
            break;
        }
        others.push(finished);
    }
    let mut served = match started {
        Ok(()) => accept_loop(listener, tls, app, options, permits, until(stop, aborted)).await,
        Err(e) => {
            let _ = abort.send(true);
            Err(e)
        }
    };
    for finished in others {
        let theirs = finished
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("a serving thread panicked")));
        served = served.and(theirs);
    }
    served
}

/// Another descriptor of the listening socket, for another runtime.
#[cfg(unix)]
fn same_socket(listener: &TcpListener) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::AsFd;
    Ok(std::net::TcpListener::from(
        listener.as_fd().try_clone_to_owned()?,
    ))
}

#[cfg(not(unix))]
fn same_socket(_: &TcpListener) -> std::io::Result<std::net::TcpListener> {
    Err(std::io::Error::other(
        "runtime.scheduler = \"per-thread\" needs a Unix system",
    ))
}

/// The accept loop of one runtime, within `permits`.
async fn accept_loop<S>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: S,
    options: ServerOptions,
    permits: Arc<Semaphore>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()>
where
    S: Serves,
{
    // Heads between the configured limit and this buffer get fencegate's
    // 431 problem; larger ones get hyper's bare 431. The framing guard holds
    // no more of an incomplete head than this either.
    let head_buffer = head_buffer_bytes(options.max_header_bytes);
    let builder = http1_builder(&options, head_buffer);
    let handshake_timeout = Duration::from_millis(options.header_read_timeout_ms);
    let send_timeout = Duration::from_millis(options.send_timeout_ms);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    let local = listener.local_addr()?;
    tracing::info!(%local, "listening");
    let _tick =
        (options.timer_tick_ms > 0).then(|| AbortOnDrop(tokio::spawn(tick(options.timer_tick_ms))));
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Usually EMFILE or a reset during the handshake: keep serving.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        if options.send_buffer_bytes > 0 {
            let _ = socket2::SockRef::from(&stream).set_send_buffer_size(options.send_buffer_bytes);
        }
        let app = app.clone();
        let client = ClientAddr::new(peer, tls.is_some());
        // The framing guard notes which request head carried both framings;
        // the requests come to the service in the same order.
        let heads = Arc::new(Heads::default());
        let service = service_fn({
            let heads = heads.clone();
            move |mut req: Request<Incoming>| {
                let mut context = RequestContext::from_client(client.clone());
                context.framing_conflict = heads.next_request();
                req.extensions_mut().insert(context);
                app.clone().oneshot(req)
            }
        });
        // The connection's own timer for its header read timeout, kept
        // from one request to the next (see `rt::TimerSlot`).
        let mut builder = builder.clone();
        builder.timer(TimerSlot::default());
        let (tls, watcher) = (tls.clone(), graceful.watcher());
        tokio::spawn(async move {
            let _permit = permit;
            let served = match tls {
                None => {
                    let io = TokioIo::new(Guarded::new(stream, head_buffer, heads, send_timeout));
                    watcher.watch(builder.serve_connection(io, service)).await
                }
                Some(tls) => {
                    let Some(stream) = handshake(&tls, stream, peer, handshake_timeout).await
                    else {
                        return;
                    };
                    let io = TokioIo::new(Guarded::new(stream, head_buffer, heads, send_timeout));
                    watcher.watch(builder.serve_connection(io, service)).await
                }
            };
            if let Err(err) = served {
                tracing::debug!(%peer, error = %err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    drain(graceful, options.shutdown_grace_ms).await;
    Ok(())
}

/// HTTP/1.1 with keep-alive, the header read timeout (each connection
/// gives it a timer), and a read buffer of `head_buffer` bytes.
fn http1_builder(options: &ServerOptions, head_buffer: usize) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .header_read_timeout(Duration::from_millis(options.header_read_timeout_ms))
        .max_buf_size(head_buffer)
        .keep_alive(true);
    builder
}

/// The TLS handshake, within `timeout`; `None` (logged) if it failed.
async fn handshake(
    tls: &TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    timeout: Duration,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    match tokio::time::timeout(timeout, tls.accept(stream)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(err)) => {
            tracing::debug!(%peer, error = %err, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

/// Lets the open connections finish for up to `grace_ms`, then closes them.
async fn drain(graceful: GracefulShutdown, grace_ms: u64) {
    tracing::info!(grace_ms, "shutting down; draining connections");
    let grace = Duration::from_millis(grace_ms);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("grace period over; closing remaining connections");
    }
}
