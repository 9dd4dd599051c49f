//! fencegate's lean HTTP/1.1 client, for both connection modes: one
//! exchange at a time on an upstream connection fencegate owns (a client
//! connection's own, or one of its client's pool: `pool.rs`), with no task
//! of its own.
//!
//! The upstream is the user's own storage, a trusted peer, and the request
//! arrives already parsed and checked by hyper's server: its head is
//! written from those parts in one write together with the first piece of
//! its body, and the answer's head is parsed with `httparse` and relayed,
//! its body streamed to the client as it comes, the connection going back
//! home (a [`Home`]: its client connection's slot, or the pool) once the
//! body ended. Lengths, codings and chunked bodies are read with the codec
//! the framing guard uses ([`crate::h1`]). The rules are hyper's client's
//! (`hyper::proto::h1::role::Client`); `tests/upstream_h1.rs` sends both
//! the same corpus of answers (hyper's through
//! `Upstream::call_with_hyper`) and compares what each relays and what the
//! backend received:
//! - the request: `Content-Length` as the client sent it, else the body's
//!   exact size, else chunked (no body for a `GET`, `HEAD` or `CONNECT` of
//!   unknown length); an HTTP/1.0 request never chunks and never keeps the
//!   connection;
//! - the answer's body (RFC 9112 §6.3): none for `HEAD`, 1xx, 204 and 304;
//!   chunked when `Transfer-Encoding` ends in `chunked`, to the close when
//!   it does not; else `Content-Length` (several equal values are one; an
//!   invalid one, or one over hyper's maximum, fails the exchange); else to
//!   the close;
//! - interim answers (100, 102-199) are skipped; 101 (and a 2xx to
//!   `CONNECT`) ends the exchange with no body and the connection;
//! - the connection is reused after an HTTP/1.1 answer without
//!   `Connection: close`, or an HTTP/1.0 one with `Connection: keep-alive`,
//!   once its body was read to the end with nothing after it.
//!
//! Differences, on purpose:
//! - an answer the upstream sends while the request body is still being
//!   written is read once that write is done or failed (a backend that
//!   answers early and closes is relayed; one that answers early and
//!   neither reads nor closes meets the upstream timeout);
//! - the first piece of the request body is awaited before a connection is
//!   taken, and goes out in the same write as the head;
//! - after an HTTP/1.0 answer with `Connection: keep-alive`, hyper sends
//!   the connection's later requests as HTTP/1.0; this client goes on with
//!   HTTP/1.1 (a server that answers in HTTP/1.0 reads those too, or
//!   closes the connection).

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::body::{Body, BoxError};
use crate::h1::{self as codec, Chunked, Piece, MAX_HEADERS};

/// A first body piece up to this size goes in the same write as the head.
const COALESCE: usize = 16 * 1024;

/// Header lines a request gets beyond its own, in order.
pub(crate) type Added = smallvec::SmallVec<[(HeaderName, HeaderValue, Put); 5]>;

/// How an added line meets the request's own lines of its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Put {
    /// It takes their place.
    Replace,
    /// It follows them.
    Append,
}

/// Puts `added` into a header map (for hyper's client, which writes the
/// map as it is: `Upstream::call_with_hyper`).
pub(crate) fn apply(headers: &mut HeaderMap, added: Added) {
    for (name, value, put) in added {
        match put {
            Put::Replace => {
                headers.insert(name, value);
            }
            Put::Append => {
                headers.append(name, value);
            }
        }
    }
}

/// A request ready to go: its framing decided (its headers to match) and
/// the first piece of its body in hand, so that an upstream connection is
/// taken only once there is something to write on it.
pub(crate) struct Outgoing {
    parts: http::request::Parts,
    body: Body,
    first: Option<Bytes>,
    /// Whether `first` is all of the body.
    ended: bool,
    sending: Sending,
    http10: bool,
}

impl Outgoing {
    /// The request's head.
    pub(crate) fn parts(&self) -> &http::request::Parts {
        &self.parts
    }

    /// Whether it may go once more on a fresh connection if a reused one
    /// fails before any byte of the answer: a `GET` or `HEAD` with no body
    /// (safe, and whole in its head).
    fn replayable(&self) -> bool {
        matches!(self.parts.method, Method::GET | Method::HEAD)
            && self.sending == Sending::Length(0)
    }

    /// Waits for the first piece of `req`'s body (none for a body it
    /// sends empty). `Err`: the client's body failed.
    pub(crate) async fn new(req: Request<Body>) -> Result<Self, BoxError> {
        let (mut parts, mut body) = req.into_parts();
        let http10 = parts.version == Version::HTTP_10;
        let sending = if body.is_end_stream() {
            parts.headers.remove(TRANSFER_ENCODING);
            Sending::Length(0)
        } else {
            framing(&parts.method, &mut parts.headers, &body, http10)
        };
        let mut first = None;
        let mut ended = sending == Sending::Length(0);
        if !ended {
            match next_data(&mut body).await? {
                Some(data) => {
                    ended = body.is_end_stream();
                    first = Some(data);
                }
                None => ended = true,
            }
        }
        Ok(Self {
            parts,
            body,
            first,
            ended,
            sending,
            http10,
        })
    }
}

/// Where an idle connection waits for its client connection's next
/// request.
pub(crate) type IdleConn = Mutex<Option<Conn>>;

/// Where a connection goes back to once its exchange is over and it may be
/// reused: a client connection's slot ([`IdleConn`]), or the pooled mode's
/// pool (`super::pool`).
pub(crate) trait Home: Send + Sync + 'static {
    /// Takes `conn` back, idle from now (or drops it, closing it).
    fn put(&self, conn: Conn);
}

impl Home for IdleConn {
    fn put(&self, conn: Conn) {
        *self.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
    }
}

/// The connection to the upstream, plain or TLS.
pub(crate) enum Stream {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A connection's I/O under the deadline of its exchange: a kept timer
/// (one per connection, made at its first exchange) moved to each
/// exchange's deadline, instead of a timer per request around the
/// exchange. Armed from the request's first byte to the answer's head
/// (the answer's body is read without it); while armed, a read or write
/// that would wait past the deadline fails with [`Expired`], as does the
/// wait for the client's next piece of body.
pub(crate) struct Timed {
    io: Stream,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

/// The exchange's deadline passed (an `io::Error` of kind `TimedOut`
/// carries it): the answer is the upstream timeout's.
#[derive(Debug)]
pub(crate) struct Expired;

impl std::fmt::Display for Expired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the exchange's deadline passed")
    }
}

impl std::error::Error for Expired {}

/// Whether `err` is the exchange's deadline passing ([`Expired`]).
pub(crate) fn is_expired(err: &(dyn std::error::Error + 'static)) -> bool {
    err.downcast_ref::<io::Error>()
        .and_then(|e| e.get_ref())
        .is_some_and(|inner| inner.is::<Expired>())
}

impl Timed {
    fn new(io: Stream) -> Self {
        Self {
            io,
            timer: None,
            armed: false,
        }
    }

    /// Arms the deadline at `deadline`: the kept timer moves there (while
    /// it has not fired and the deadline is later, a compare-and-swap; else
    /// it is registered again). Disarmed, the timer stays in tokio's wheel
    /// until its old deadline, and then wakes the connection's task once
    /// for nothing.
    fn arm(&mut self, deadline: tokio::time::Instant) {
        self.timer = Some(crate::rt::moved_or_new(self.timer.take(), deadline));
        self.armed = true;
    }

    /// `Pending` while the deadline is ahead (or not armed), waking the
    /// task at it; `Ready` with the error once it passed. Whether tokio's
    /// driver fired the timer is read first: a stream that stays ready uses
    /// up the task's coop budget, and inside it the timer's own poll would
    /// answer `Pending` too, so such a stream would never be cut (tokio's
    /// `Timeout` polls its timer outside the budget for the same reason).
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        match self.timer.as_mut() {
            Some(timer) if self.armed => {
                if !timer.is_elapsed() {
                    std::task::ready!(timer.as_mut().poll(cx));
                }
                Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, Expired))
            }
            _ => Poll::Pending,
        }
    }

    /// `poll`, or the deadline's error once it passed while `poll` waits.
    fn or_expired<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut Stream, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match poll(&mut self.io, cx) {
            Poll::Pending => self.poll_expired(cx).map(Err),
            ready => ready,
        }
    }
}

impl AsyncRead for Timed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.get_mut()
            .or_expired(cx, |io, cx| Pin::new(io).poll_read(cx, buf))
    }
}

impl AsyncWrite for Timed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .or_expired(cx, |io, cx| Pin::new(io).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut()
            .or_expired(cx, |io, cx| Pin::new(io).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// An exchange that broke the protocol or ended early; its words are
/// hyper's, which the failure's kind (`upstream::failure_kind`) reads.
#[derive(Debug)]
pub(crate) struct Broken(pub &'static str);

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Broken {}

fn closed_early() -> BoxError {
    Box::new(Broken(CLOSED_EARLY))
}

const CLOSED_EARLY: &str = "connection closed before message completed";

/// A reused connection that failed before any byte of the answer came (the
/// upstream closed or reset it as the request went out: it closes idle
/// connections on a timer of its own), with the request, a `GET` or `HEAD`
/// with no body: it never reached the upstream's application, and may go
/// once more on a fresh connection ([`unanswered`]).
#[derive(Debug)]
pub(crate) struct Unanswered {
    parts: http::request::Parts,
    http10: bool,
    /// What failed.
    cause: BoxError,
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a reused connection failed before the answer: {}",
            self.cause
        )
    }
}

impl std::error::Error for Unanswered {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.cause)
    }
}

/// The request to send again, if `err` is [`Unanswered`]; else `err`.
pub(crate) fn unanswered(err: BoxError) -> Result<Outgoing, BoxError> {
    let again = err.downcast::<Unanswered>()?;
    let Unanswered { parts, http10, .. } = *again;
    Ok(Outgoing {
        parts,
        body: crate::body::empty(),
        first: None,
        ended: true,
        sending: Sending::Length(0),
        http10,
    })
}

/// Whether an error of a read or write is the upstream closing or
/// resetting the connection (rather than, say, the deadline).
fn is_closed(err: &(dyn std::error::Error + 'static)) -> bool {
    if err
        .downcast_ref::<Broken>()
        .is_some_and(|b| b.0 == CLOSED_EARLY)
    {
        return true;
    }
    err.downcast_ref::<io::Error>().is_some_and(|e| {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
        )
    })
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing").finish_non_exhaustive()
    }
}

/// One upstream connection and its buffers.
pub(crate) struct Conn {
    io: Timed,
    /// Bytes read and not yet used.
    buf: BytesMut,
    /// The request head being written (kept for its capacity).
    out: Vec<u8>,
    /// The most an answer's head may take, and the most read at once.
    max_buf: usize,
    /// Since when it has been idle, back in its slot.
    idle: Option<crate::clock::Stopwatch>,
    /// Whether [`Conn::begin`] put the body's first piece in `out` with
    /// the head.
    coalesced: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("buffered", &self.buf.len())
            .finish()
    }
}

/// What the buffer holds of an answer's head.
enum Answer {
    /// A whole final head, how its body is read, and whether the
    /// connection may be reused after it.
    Head(Response<()>, Reading, bool),
    /// An interim (1xx) head, now consumed.
    Interim,
    /// Not a whole head yet.
    Partial,
}

/// How the request body is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sending {
    /// Exactly this many bytes (0: none, the body left unread).
    Length(u64),
    Chunked,
}

/// How the answer's body is read.
#[derive(Debug)]
enum Reading {
    Length(u64),
    Chunked(Chunked),
    /// To the end of the connection.
    Close,
    Done,
}

impl Conn {
    pub(crate) fn new(io: Stream, max_buf: usize) -> Self {
        Self {
            io: Timed::new(io),
            buf: BytesMut::new(),
            out: Vec::new(),
            max_buf,
            idle: None,
            coalesced: false,
        }
    }

    /// Whether an idle connection can take a request: it has been idle for
    /// less than `idle_timeout_ms` (an upstream that closes idle
    /// connections after a while of its own may be closing it right now,
    /// as the request goes out), and the upstream has neither closed it
    /// nor sent anything since the last answer. Never waits (it asks the
    /// socket, not the runtime).
    pub(crate) fn is_open(&mut self, idle_timeout_ms: u64) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        // Kept, not taken: a connection put back unused (a withdrawn
        // write's) keeps its age.
        if self
            .idle
            .is_some_and(|idle| idle.elapsed_ms() >= idle_timeout_ms)
        {
            return false;
        }
        let mut byte = [0u8; 1];
        let mut probe = ReadBuf::new(&mut byte);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        // Pending: nothing arrived; anything else is a close, a failure or
        // bytes nobody asked for.
        Pin::new(&mut self.io.io)
            .poll_read(&mut cx, &mut probe)
            .is_pending()
    }

    /// Whether the kernel holds nothing for this connection: no bytes and
    /// no close, asked of the socket itself with a non-blocking peek.
    /// [`Self::is_open`] asks tokio, whose readiness of a socket is updated
    /// only when its driver runs, so on a busy runtime it may not know yet
    /// of bytes that arrived; the pool asks here too before a connection
    /// serves another of its clients (one extra system call).
    pub(crate) fn is_quiet(&self) -> bool {
        let tcp = match &self.io.io {
            Stream::Tcp(tcp) => tcp,
            Stream::Tls(tls) => tls.get_ref().0,
        };
        let mut one = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(
            socket2::SockRef::from(tcp).peek(&mut one),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        )
    }

    /// Has the kernel acknowledge what arrived at once (`TCP_QUICKACK`) rather
    /// than with the next request: a storage that holds a small write back
    /// until the last one is acknowledged (Nagle's algorithm) then sends
    /// what it held now, where [`Self::is_quiet`] sees it before the
    /// connection serves another client. Best effort: an error changes
    /// nothing.
    pub(crate) fn ack_now(&self) {
        let tcp = match &self.io.io {
            Stream::Tcp(tcp) => tcp,
            Stream::Tls(tls) => tls.get_ref().0,
        };
        #[cfg(target_os = "linux")]
        let _ = socket2::SockRef::from(tcp).set_tcp_quickack(true);
        #[cfg(not(target_os = "linux"))]
        let _ = tcp;
    }

    /// Writes `out`'s head (its `added` lines with it) and, if small, the
    /// body's first piece, in one write: `Err` if that write fails
    /// outright, and then nothing of the request reached the upstream (the
    /// connection had been closed or reset as it sat idle), so it may go
    /// on another connection. Over TLS the bytes are only encoded here (a
    /// TLS write's failure proves nothing).
    pub(crate) fn begin(
        &mut self,
        out: &Outgoing,
        added: &Added,
        deadline: tokio::time::Instant,
    ) -> impl Future<Output = io::Result<()>> + Send + '_ {
        self.io.arm(deadline);
        self.out.clear();
        encode_head(&mut self.out, &out.parts, added, out.http10);
        let fits = |data: &Bytes| {
            data.len() <= COALESCE
                && !matches!(out.sending, Sending::Length(n) if data.len() as u64 > n)
        };
        self.coalesced = out.first.as_ref().is_some_and(fits);
        if let Some(data) = out.first.as_ref().filter(|_| self.coalesced) {
            put_data(&mut self.out, out.sending, data);
        }
        let whole = out.first.is_none() || self.coalesced;
        if whole && out.ended && out.sending == Sending::Chunked {
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        self.write_first()
    }

    async fn write_first(&mut self) -> io::Result<()> {
        if let Stream::Tcp(_) = &self.io.io {
            let n = self.io.write(&self.out).await?;
            self.out.drain(..n);
        }
        Ok(())
    }

    /// Sends the rest of `out` after [`Self::begin`], and reads the
    /// answer's head; the answer's body owns the connection and puts it
    /// back in `home` once read to its end (at once when there is none).
    /// `reused`: the connection was idle before this exchange; if it then
    /// fails before any byte of the answer, a `GET` or `HEAD` with no body
    /// comes back as [`Unanswered`], to go once more on a fresh one.
    pub(crate) async fn send<H: Home>(
        mut self,
        out: Outgoing,
        home: &Arc<H>,
        reused: bool,
    ) -> Result<Response<Body>, BoxError> {
        let replay = reused && out.replayable();
        let Outgoing {
            parts,
            body,
            mut first,
            ended,
            sending,
            http10,
        } = out;
        let method = parts.method.clone();
        // The head is kept only for a request that may go again, boxed: the
        // future of every other exchange stays as small as it was.
        let parts = replay.then(|| Box::new(parts));
        let unanswered = |cause: BoxError, parts: Option<Box<http::request::Parts>>| match parts {
            Some(parts) if is_closed(&*cause) => Box::new(Unanswered {
                parts: *parts,
                http10,
                cause,
            }) as BoxError,
            _ => cause,
        };
        let mut sent: u64 = 0;
        if let Some(data) = first.take() {
            sent += data.len() as u64;
            if matches!(sending, Sending::Length(n) if sent > n) {
                return Err(Box::new(Broken("request body longer than its length")));
            }
            // Unless it went with the head (see `begin`).
            if !self.coalesced {
                first = Some(data);
            }
        }
        let mut written = self.io.write_all(&self.out).await;
        if written.is_ok() {
            written = self
                .write_body(body, first, ended, sending, &mut sent)
                .await?;
        }
        if written.is_ok() {
            // TLS may hold the last record back until asked (TCP: nothing).
            written = self.io.flush().await;
        }
        if let Err(e) = written {
            if is_expired(&e) {
                // The deadline passed while the request went out: the
                // upstream timeout's answer, whatever the upstream said.
                return Err(e.into());
            }
            // An answer sent before the upstream closed (a 413 for a body
            // it would not take) is relayed; otherwise the write's error.
            return match self.read_head(&method, true).await {
                Ok((res, reading, _)) => Ok(self.answer(res, reading, false, home)),
                Err(_) => Err(unanswered(e.into(), parts)),
            };
        }
        if matches!(sending, Sending::Length(n) if sent < n) {
            return Err(Box::new(Broken("request body ended early")));
        }
        let (res, reading, keep_alive) = match self.read_head(&method, false).await {
            Ok(head) => head,
            // Nothing of an answer came: the upstream closed the connection
            // as the request went out.
            Err(e) if self.buf.is_empty() => return Err(unanswered(e, parts)),
            Err(e) => return Err(e),
        };
        Ok(self.answer(res, reading, keep_alive && !http10, home))
    }

    /// Writes the rest of the body after its first piece. `Err` of the
    /// outer result: the client's body failed (its error, for the caller to
    /// tell apart); of the inner one: the write failed.
    async fn write_body(
        &mut self,
        mut body: Body,
        first: Option<Bytes>,
        mut ended: bool,
        sending: Sending,
        sent: &mut u64,
    ) -> Result<io::Result<()>, BoxError> {
        if let Some(data) = first {
            if let Err(e) = self.write_data(sending, &data, ended).await {
                return Ok(Err(e));
            }
        }
        while !ended {
            match self.next_data(&mut body).await? {
                Some(data) => {
                    *sent += data.len() as u64;
                    if let Sending::Length(n) = sending {
                        if *sent > n {
                            return Err(Box::new(Broken("request body longer than its length")));
                        }
                    }
                    ended = body.is_end_stream();
                    if let Err(e) = self.write_data(sending, &data, ended).await {
                        return Ok(Err(e));
                    }
                }
                None => {
                    ended = true;
                    if sending == Sending::Chunked {
                        if let Err(e) = self.io.write_all(b"0\r\n\r\n").await {
                            return Ok(Err(e));
                        }
                    }
                }
            }
        }
        Ok(Ok(()))
    }

    /// The client's next piece of body, or the deadline's error once it
    /// passed while waiting for it.
    async fn next_data(&mut self, body: &mut Body) -> Result<Option<Bytes>, BoxError> {
        let mut next = std::pin::pin!(next_data(body));
        std::future::poll_fn(|cx| match next.as_mut().poll(cx) {
            Poll::Pending => self.io.poll_expired(cx).map(|e| Err(e.into())),
            ready => ready,
        })
        .await
    }

    /// Writes one piece of the body (and the last chunk, if it `ends` a
    /// chunked body).
    async fn write_data(&mut self, sending: Sending, data: &[u8], ends: bool) -> io::Result<()> {
        if sending == Sending::Length(0) {
            return Ok(());
        }
        let last: &[u8] = match (sending, ends) {
            (Sending::Chunked, true) => b"0\r\n\r\n",
            _ => b"",
        };
        if data.len() > COALESCE {
            if sending == Sending::Chunked {
                self.out.clear();
                codec::chunk_size_line(&mut self.out, data.len());
                self.io.write_all(&self.out).await?;
                self.io.write_all(data).await?;
                self.out.clear();
                self.out.extend_from_slice(b"\r\n");
                self.out.extend_from_slice(last);
                return self.io.write_all(&self.out).await;
            }
            return self.io.write_all(data).await;
        }
        // One write for the piece and its framing.
        self.out.clear();
        put_data(&mut self.out, sending, data);
        self.out.extend_from_slice(last);
        self.io.write_all(&self.out).await
    }

    /// Reads the answer's head, skipping interim ones. `salvage`: only what
    /// the upstream sent before a failed write, never waiting for more.
    async fn read_head(
        &mut self,
        method: &Method,
        salvage: bool,
    ) -> Result<(Response<()>, Reading, bool), BoxError> {
        // An interim answer shows the upstream's application had the
        // request: a failure after one is never [`Unanswered`].
        let mut interim = false;
        let after_interim = |interim: bool, e: BoxError| -> BoxError {
            if interim {
                Box::new(Broken("connection closed after an interim answer"))
            } else {
                e
            }
        };
        loop {
            match self.parse_head(method)? {
                Answer::Head(head, reading, keep_alive) => return Ok((head, reading, keep_alive)),
                Answer::Interim => {
                    interim = true;
                    continue;
                }
                Answer::Partial => {}
            }
            if self.buf.len() >= self.max_buf {
                return Err(Box::new(Broken("message head is too large")));
            }
            // Never past `max_buf`: a longer head fails, as hyper's does.
            let room = (self.max_buf - self.buf.len()).min(8192);
            self.buf.reserve(room);
            let n = if salvage {
                let buf = &mut self.buf;
                let io = &mut self.io;
                std::future::poll_fn(|cx| {
                    let mut limited = (&mut **buf).limit(room);
                    let read = std::pin::pin!(io.read_buf(&mut limited));
                    match read.poll(cx) {
                        Poll::Pending => Poll::Ready(Ok(0)),
                        other => other,
                    }
                })
                .await
            } else {
                self.io.read_buf(&mut (&mut self.buf).limit(room)).await
            };
            match n {
                Ok(0) => return Err(after_interim(interim, closed_early())),
                Ok(_) => {}
                Err(e) => return Err(after_interim(interim, e.into())),
            }
        }
    }

    /// Parses one head from the buffer.
    fn parse_head(&mut self, method: &Method) -> Result<Answer, BoxError> {
        if self.buf.is_empty() {
            return Ok(Answer::Partial);
        }
        let mut lines = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut res = httparse::Response::new(&mut []);
        let base = self.buf.as_ptr() as usize;
        let len = match httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut res, &self.buf, &mut lines)
        {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(Answer::Partial),
            Err(e) => return Err(Box::new(e)),
        };
        let code = res.code.unwrap_or(0);
        let status = StatusCode::from_u16(code).map_err(|_| Broken("invalid status code"))?;
        let version = if res.version == Some(1) {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        };
        // Copied, as hyper's client does: httparse gives a missing or
        // non-ASCII reason as a static "", which is not in the buffer.
        let reason = res
            .reason
            .filter(|r| Some(*r) != status.canonical_reason())
            .map(|r| Bytes::copy_from_slice(r.as_bytes()));
        // Where each line lies in the buffer, to slice it once frozen.
        let mut spans: smallvec::SmallVec<[(usize, usize, usize, usize); 24]> =
            smallvec::SmallVec::with_capacity(res.headers.len());
        for h in res.headers.iter() {
            spans.push((
                h.name.as_ptr() as usize - base,
                h.name.len(),
                h.value.as_ptr() as usize - base,
                h.value.len(),
            ));
        }
        let head = self.buf.split_to(len).freeze();
        if matches!(code, 100 | 102..=199) {
            return Ok(Answer::Interim);
        }
        // Room for the lines fencegate adds to an answer (its request id).
        let mut headers = HeaderMap::with_capacity(spans.len() + 2);
        let mut keep_alive = version == Version::HTTP_11;
        let mut saw_close = false;
        for (n, nl, v, vl) in spans {
            let name = HeaderName::from_bytes(&head[n..n + nl])
                .map_err(|_| Broken("invalid header name"))?;
            let value = HeaderValue::from_maybe_shared(head.slice(v..v + vl))
                .map_err(|_| Broken("invalid header value"))?;
            if name == CONNECTION {
                if saw_close || has_token(&value, "close") {
                    saw_close = true;
                    keep_alive = false;
                } else if !keep_alive {
                    keep_alive = has_token(&value, "keep-alive");
                }
            }
            headers.append(name, value);
        }
        let (reading, upgrade) = decoder(code, method, version, &headers)?;
        let mut res = Response::new(());
        *res.status_mut() = status;
        *res.version_mut() = version;
        *res.headers_mut() = headers;
        if let Some(Ok(phrase)) = reason.map(hyper::ext::ReasonPhrase::try_from) {
            res.extensions_mut().insert(phrase);
        }
        Ok(Answer::Head(res, reading, keep_alive && !upgrade))
    }

    /// The answer with its body; the connection goes home now if the
    /// answer has no body and may be reused.
    fn answer<H: Home>(
        mut self,
        head: Response<()>,
        reading: Reading,
        keep_alive: bool,
        home: &Arc<H>,
    ) -> Response<Body> {
        // The deadline ends with the head (the body is read without it).
        self.io.armed = false;
        let (parts, ()) = head.into_parts();
        let body = match reading {
            Reading::Done | Reading::Length(0) => {
                if keep_alive {
                    self.go_home(&**home);
                }
                crate::body::empty()
            }
            reading => {
                let home: Weak<H> = Arc::downgrade(home);
                let home: Weak<dyn Home> = home;
                crate::body::boxed(Incoming {
                    conn: Some(self),
                    reading,
                    trailers: BytesMut::new(),
                    keep_alive,
                    home,
                })
            }
        };
        Response::from_parts(parts, body)
    }

    /// Back home, if nothing unexpected is buffered (bytes after the
    /// answer's end are an answer nobody asked for: the connection is
    /// closed, never reused).
    fn go_home(mut self, home: &dyn Home) {
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
            self.idle = Some(crate::clock::Stopwatch::start());
            home.put(self);
        }
    }
}

/// How a request body of unknown framing is sent, and its headers to
/// match (hyper's `Client::set_length`).
fn framing(method: &Method, headers: &mut HeaderMap, body: &Body, http10: bool) -> Sending {
    let stated = content_length(headers);
    let exact = body.size_hint().exact();
    if http10 {
        headers.remove(TRANSFER_ENCODING);
        return match (stated, exact) {
            (Some(Some(n)), _) => Sending::Length(n),
            (_, Some(n)) => {
                headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
                Sending::Length(n)
            }
            _ => Sending::Length(0),
        };
    }
    if let Some(Some(n)) = stated {
        return Sending::Length(n);
    }
    match exact {
        Some(n) => {
            headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
            Sending::Length(n)
        }
        None if matches!(*method, Method::GET | Method::HEAD | Method::CONNECT) => {
            Sending::Length(0)
        }
        None => {
            headers.remove(CONTENT_LENGTH);
            headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
            Sending::Chunked
        }
    }
}

/// The head of a request, in HTTP/1.1's words.
fn encode_head(out: &mut Vec<u8>, parts: &http::request::Parts, added: &Added, http10: bool) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    match parts.uri.path_and_query() {
        Some(pq) => out.extend_from_slice(pq.as_str().as_bytes()),
        None => out.push(b'/'),
    }
    out.extend_from_slice(if http10 {
        b" HTTP/1.0\r\n"
    } else {
        b" HTTP/1.1\r\n"
    });
    let line = |out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue| {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    };
    for (name, value) in &parts.headers {
        if !added
            .iter()
            .any(|(n, _, put)| *put == Put::Replace && n == name)
        {
            line(out, name, value);
        }
    }
    for (name, value, _) in added {
        line(out, name, value);
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends a body piece in the request's framing.
fn put_data(out: &mut Vec<u8>, sending: Sending, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    if sending == Sending::Chunked {
        codec::chunk_size_line(out, data.len());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    } else {
        out.extend_from_slice(data);
    }
}

/// The next non-empty data of a request body (trailers are dropped, as
/// hyper's client drops those no `Trailer` header announced, and
/// `Trailer` is hop-by-hop).
async fn next_data(body: &mut Body) -> Result<Option<Bytes>, BoxError> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(frame) => {
                if let Ok(data) = frame?.into_data() {
                    if !data.is_empty() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }
}

/// `Content-Length`: `None` if absent, `Some(None)` if invalid (values
/// that are not all the same number).
fn content_length(headers: &HeaderMap) -> Option<Option<u64>> {
    codec::lengths(headers.get_all(CONTENT_LENGTH).iter().map(|v| v.as_bytes()))
}

/// Whether a `Connection` value lists `token`.
fn has_token(value: &HeaderValue, token: &str) -> bool {
    value
        .to_str()
        .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
}

/// How the answer's body is framed (RFC 9112 §6.3, as hyper's
/// `Client::decoder`), and whether it ends the connection as an upgrade.
fn decoder(
    code: u16,
    method: &Method,
    version: Version,
    headers: &HeaderMap,
) -> Result<(Reading, bool), BoxError> {
    match code {
        101 => return Ok((Reading::Done, true)),
        204 | 304 => return Ok((Reading::Done, false)),
        _ => {}
    }
    if *method == Method::HEAD {
        return Ok((Reading::Done, false));
    }
    if *method == Method::CONNECT && (200..300).contains(&code) {
        return Ok((Reading::Done, true));
    }
    if headers.contains_key(TRANSFER_ENCODING) {
        if version == Version::HTTP_10 {
            return Err(Box::new(Broken(
                "unexpected transfer-encoding parsed in an HTTP/1.0 answer",
            )));
        }
        let chunked = headers
            .get_all(TRANSFER_ENCODING)
            .iter()
            .next_back()
            .is_some_and(|v| codec::is_chunked(v.as_bytes()));
        return Ok((
            if chunked {
                Reading::Chunked(Chunked::new())
            } else {
                Reading::Close
            },
            false,
        ));
    }
    match content_length(headers) {
        Some(Some(n)) if n <= codec::MAX_LENGTH => Ok((Reading::Length(n), false)),
        Some(Some(_)) => Err(Box::new(Broken("content-length bigger than maximum"))),
        Some(None) => Err(Box::new(Broken("invalid content-length parsed"))),
        None => Ok((Reading::Close, false)),
    }
}

/// An answer's body, read from the connection as the client takes it.
struct Incoming {
    /// `None` once the body ended.
    conn: Option<Conn>,
    reading: Reading,
    /// The trailer section of a chunked body, as it arrives (the codec
    /// bounds it).
    trailers: BytesMut,
    keep_alive: bool,
    home: Weak<dyn Home>,
}

impl Incoming {
    /// The body ended: the connection goes home if it may be reused.
    fn end(&mut self) {
        self.reading = Reading::Done;
        if let Some(conn) = self.conn.take() {
            if self.keep_alive {
                if let Some(home) = self.home.upgrade() {
                    conn.go_home(&*home);
                }
            }
        }
    }

    /// Reads more into the buffer: `Ok(0)` at the end of the connection.
    fn poll_fill(&mut self, cx: &mut Context<'_>, want: u64) -> Poll<io::Result<usize>> {
        let Some(conn) = self.conn.as_mut() else {
            return Poll::Ready(Ok(0));
        };
        // At most `max_buf` at once, however much the buffer could hold.
        let room = (conn.max_buf as u64).min(want.max(1)) as usize;
        conn.buf.reserve(room);
        let mut limited = (&mut conn.buf).limit(room);
        let read = std::pin::pin!(conn.io.read_buf(&mut limited));
        read.poll(cx)
    }

    /// [`Self::poll_fill`] where the body has not ended: its end is an
    /// error.
    fn poll_more(&mut self, cx: &mut Context<'_>, want: u64) -> Poll<Result<(), BoxError>> {
        Poll::Ready(match std::task::ready!(self.poll_fill(cx, want)) {
            Ok(0) => Err(closed_early()),
            Ok(_) => Ok(()),
            Err(e) => Err(e.into()),
        })
    }

    /// The body failed: the connection is dropped (closed), never reused.
    fn fail(&mut self, e: BoxError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.conn = None;
        self.reading = Reading::Done;
        Poll::Ready(Some(Err(e)))
    }

    fn buf(&mut self) -> &mut BytesMut {
        &mut self
            .conn
            .as_mut()
            .expect("a body being read has its connection")
            .buf
    }

    /// The next frame of a chunked body: `Ok(None)` to read more first,
    /// `Ok(Some(None))` to go on.
    fn chunked(&mut self, mut body: Chunked) -> Result<Option<Option<Frame<Bytes>>>, BoxError> {
        let buf = self.buf();
        if buf.is_empty() {
            return Ok(None);
        }
        let (n, piece) = body.decode(buf)?;
        let frame = match piece {
            Piece::Data => Some(Frame::data(buf.split_to(n).freeze())),
            Piece::Framing => {
                buf.advance(n);
                None
            }
            Piece::Trailers => {
                let section = buf.split_to(n);
                self.trailers.extend_from_slice(&section);
                None
            }
        };
        self.reading = Reading::Chunked(body);
        if !body.is_done() {
            return Ok(Some(frame));
        }
        if self.trailers.is_empty() {
            self.end();
            return Ok(Some(None));
        }
        let block = std::mem::take(&mut self.trailers).freeze();
        let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let slots = &mut lines[..body.trailer_lines()];
        let Ok(httparse::Status::Complete((_, lines))) = httparse::parse_headers(&block, slots)
        else {
            return Err(Box::new(Broken("invalid chunk trailers")));
        };
        let mut map = HeaderMap::with_capacity(lines.len());
        for line in lines {
            let name = HeaderName::from_bytes(line.name.as_bytes())
                .map_err(|_| Broken("invalid trailer name"))?;
            let value = HeaderValue::from_maybe_shared(block.slice_ref(line.value))
                .map_err(|_| Broken("invalid trailer value"))?;
            map.append(name, value);
        }
        self.end();
        Ok(Some(Some(Frame::trailers(map))))
    }
}

impl http_body::Body for Incoming {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            match this.reading {
                Reading::Done => return Poll::Ready(None),
                Reading::Length(left) => {
                    let buf = this.buf();
                    if !buf.is_empty() {
                        let n = (buf.len() as u64).min(left) as usize;
                        let data = buf.split_to(n).freeze();
                        if left == n as u64 {
                            this.end();
                        } else {
                            this.reading = Reading::Length(left - n as u64);
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    if let Err(e) = std::task::ready!(this.poll_more(cx, left)) {
                        return this.fail(e);
                    }
                }
                Reading::Close => {
                    let buf = this.buf();
                    if !buf.is_empty() {
                        let data = buf.split().freeze();
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    match std::task::ready!(this.poll_fill(cx, u64::MAX)) {
                        Ok(0) => {
                            // The end of the connection is the end of the body.
                            this.conn = None;
                            this.reading = Reading::Done;
                            return Poll::Ready(None);
                        }
                        Ok(_) => {}
                        Err(e) => return this.fail(e.into()),
                    }
                }
                Reading::Chunked(state) => match this.chunked(state) {
                    Ok(Some(Some(frame))) => return Poll::Ready(Some(Ok(frame))),
                    Ok(Some(None)) => {}
                    Ok(None) => {
                        let want = match state.data_left() {
                            0 => 8192,
                            left => left,
                        };
                        if let Err(e) = std::task::ready!(this.poll_more(cx, want)) {
                            return this.fail(e);
                        }
                    }
                    Err(e) => return this.fail(e),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.reading, Reading::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.reading {
            Reading::Length(n) => SizeHint::with_exact(n),
            Reading::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deadline cuts a read that never has to wait: a peer keeps the
    /// socket full, each read is ready, and the reads use up the task's
    /// coop budget, in which the timer itself would answer `Pending` too.
    /// Seen failing (the test's 20 s ran out) with the timer polled inside
    /// that budget. Real time: the timer is tokio's over a real socket; a
    /// 200 ms deadline against 20 s.
    #[tokio::test]
    async fn a_deadline_cuts_reads_that_never_wait() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let flooder = std::thread::spawn(move || {
            use std::io::Write;
            let (mut sock, _) = listener.accept().unwrap();
            let block = vec![b'x'; 64 * 1024];
            while sock.write_all(&block).is_ok() {}
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut timed = Timed::new(Stream::Tcp(tcp));
        timed.arm(crate::clock::Stopwatch::start().deadline_after_ms(200));
        let read_until_cut = async {
            let mut small = [0u8; 64];
            loop {
                if let Err(e) = timed.read(&mut small).await {
                    return e;
                }
            }
        };
        let err = tokio::time::timeout(std::time::Duration::from_secs(20), read_until_cut)
            .await
            .expect("the deadline never cut the reads");
        assert!(is_expired(&err), "{err}");
        drop(timed);
        flooder.join().unwrap();
    }
}
