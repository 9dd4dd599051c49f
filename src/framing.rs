//! A guard on the raw bytes of each connection, below hyper's parser.
//!
//! hyper follows RFC 9112 §6.1 for a request that carries both
//! `Content-Length` and `Transfer-Encoding`: it frames the body by the
//! transfer coding, silently drops `Content-Length`, and closes the connection
//! afterwards. fencegate's contract is stricter: such a request is refused,
//! never repaired and forwarded, because it is the classic request-smuggling
//! shape. By the time a request reaches a service the evidence is gone, so
//! this guard watches the byte stream: it finds each request head (following
//! `Content-Length` and chunked bodies to know where the next head starts),
//! and in a head with both headers renames `Content-Length` to
//! [`CONFLICT_HEADER`] (same length, so nothing else moves). hyper then frames
//! by the transfer coding as before, and the app refuses the request with a
//! 400 problem because it sees the marker.
//!
//! Anything the guard cannot follow (a malformed head, bad chunking, an
//! upgrade, a head over [`MAX_HEAD_BYTES`]) ends its watch for the connection
//! and the bytes pass through untouched: hyper rejects malformed input itself.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The name `Content-Length` is renamed to in a head that also carries
/// `Transfer-Encoding`.
pub const CONFLICT_HEADER: &str = "x-conflict-len";

/// Heads larger than this are passed through unwatched (hyper refuses them).
pub const MAX_HEAD_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Collecting a request head.
    Head,
    /// Passing `n` more body bytes.
    Fixed(u64),
    /// Collecting a chunk-size line.
    ChunkSize,
    /// Passing `n` chunk bytes.
    ChunkData(u64),
    /// Collecting the line break after chunk data.
    ChunkEnd,
    /// Collecting trailer lines until an empty one.
    Trailers,
    /// No longer watching: everything passes.
    Passthrough,
}

/// The byte-stream scanner behind [`Guarded`]; pure, so it can be tested on
/// any split of a stream.
#[derive(Debug)]
pub struct Scanner {
    state: State,
    /// Bytes of an incomplete head or line, held back until complete.
    held: BytesMut,
}

impl Default for Scanner {
    fn default() -> Self {
        Self {
            state: State::Head,
            held: BytesMut::new(),
        }
    }
}

fn find_line_end(buf: &[u8]) -> Option<usize> {
    buf.iter().position(|&b| b == b'\n').map(|i| i + 1)
}

/// The end of a head (after its blank line), accepting bare LF as hyper does.
fn find_head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(rel) = buf[i..].iter().position(|&b| b == b'\n') {
        let nl = i + rel;
        let rest = &buf[nl + 1..];
        if rest.starts_with(b"\n") {
            return Some(nl + 2);
        }
        if rest.starts_with(b"\r\n") {
            return Some(nl + 3);
        }
        i = nl + 1;
    }
    None
}

impl Scanner {
    /// Takes `input` from the socket and appends what may be handed to the
    /// parser to `out` (possibly rewritten).
    pub fn feed(&mut self, mut input: &[u8], out: &mut BytesMut) {
        while !input.is_empty() {
            match self.state {
                State::Passthrough => {
                    out.extend_from_slice(&self.held.split());
                    out.extend_from_slice(input);
                    return;
                }
                State::Fixed(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(input.len());
                    out.extend_from_slice(&input[..take]);
                    input = &input[take..];
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        State::Head
                    } else {
                        State::Fixed(left)
                    };
                }
                State::ChunkData(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(input.len());
                    out.extend_from_slice(&input[..take]);
                    input = &input[take..];
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        State::ChunkEnd
                    } else {
                        State::ChunkData(left)
                    };
                }
                State::Head | State::ChunkSize | State::ChunkEnd | State::Trailers => {
                    self.held.extend_from_slice(input);
                    input = &[];
                    self.drain_held(out);
                    match self.state {
                        // Still collecting: the rest stays held.
                        State::Head | State::ChunkSize | State::ChunkEnd | State::Trailers => {}
                        // Body bytes (or unwatched bytes) follow what was
                        // consumed: run them through again.
                        _ => {
                            let rest = self.held.split();
                            self.feed(&rest, out);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Processes complete heads or lines in `held`, until it needs more
    /// bytes or reaches a body.
    fn drain_held(&mut self, out: &mut BytesMut) {
        loop {
            match self.state {
                State::Head => {
                    let Some(end) = find_head_end(&self.held) else {
                        if self.held.len() > MAX_HEAD_BYTES {
                            self.state = State::Passthrough;
                        }
                        return;
                    };
                    let mut head = self.held.split_to(end);
                    self.state = inspect_head(&mut head);
                    out.extend_from_slice(&head);
                }
                State::ChunkSize | State::ChunkEnd | State::Trailers => {
                    let Some(end) = find_line_end(&self.held) else {
                        if self.held.len() > 64 * 1024 {
                            self.state = State::Passthrough;
                        }
                        return;
                    };
                    let line = self.held.split_to(end);
                    out.extend_from_slice(&line);
                    let blank = matches!(&line[..], b"\r\n" | b"\n");
                    self.state = match self.state {
                        State::ChunkEnd if blank => State::ChunkSize,
                        State::ChunkEnd => State::Passthrough,
                        State::Trailers if blank => State::Head,
                        State::Trailers => State::Trailers,
                        _ => match httparse::parse_chunk_size(&line) {
                            Ok(httparse::Status::Complete((_, 0))) => State::Trailers,
                            Ok(httparse::Status::Complete((_, n))) => State::ChunkData(n),
                            _ => State::Passthrough,
                        },
                    };
                }
                _ => return,
            }
        }
    }
}

/// Looks at one complete head: marks a `Content-Length` beside
/// `Transfer-Encoding`, and says how the body that follows is framed.
fn inspect_head(head: &mut BytesMut) -> State {
    let mut headers = [httparse::EMPTY_HEADER; 256];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = req.parse(head) else {
        return State::Passthrough;
    };
    let mut length_names = Vec::new();
    let mut length = None;
    let mut chunked = None;
    let mut upgrade = req.method == Some("CONNECT");
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            length_names.push(h.name.as_ptr() as usize - head.as_ptr() as usize);
            length = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let last = h.value.rsplit(|&b| b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    if upgrade {
        return State::Passthrough;
    }
    match chunked {
        Some(true) => {
            for at in length_names {
                head[at..at + CONFLICT_HEADER.len()].copy_from_slice(CONFLICT_HEADER.as_bytes());
            }
            State::ChunkSize
        }
        // Not chunked last: hyper refuses the request.
        Some(false) => State::Passthrough,
        None => match (length_names.len(), length) {
            (0, _) => State::Head,
            (_, Some(0)) => State::Head,
            (_, Some(n)) => State::Fixed(n),
            (_, None) => State::Passthrough,
        },
    }
}

/// A connection whose incoming bytes pass through a [`Scanner`].
pub struct Guarded<S> {
    inner: S,
    scanner: Scanner,
    ready: BytesMut,
    buf: Box<[u8]>,
}

impl<S> Guarded<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            scanner: Scanner::default(),
            ready: BytesMut::new(),
            buf: vec![0; 16 * 1024].into_boxed_slice(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(out.remaining());
                out.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut this.buf);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                // End of stream: release anything held so the parser sees it.
                let rest = this.scanner.held.split();
                if rest.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                this.scanner.state = State::Passthrough;
                this.ready.extend_from_slice(&rest);
                continue;
            }
            this.scanner.feed(&this.buf[..n], &mut this.ready);
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> Vec<u8> {
        let mut s = Scanner::default();
        let mut out = BytesMut::new();
        for c in chunks {
            s.feed(c, &mut out);
        }
        out.extend_from_slice(&s.held);
        out.to_vec()
    }

    const PIPELINE: &[u8] = b"PUT /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcPUT /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nxyz\r\n0\r\nT: 1\r\n\r\nPUT /c HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nGET /d HTTP/1.1\r\nContent-Length: 9\r\nX: Transfer-Encoding: chunked\r\n\r\n123456789";

    fn expected() -> Vec<u8> {
        let text = String::from_utf8(PIPELINE.to_vec()).unwrap();
        // Only the third request's length is renamed; the body bytes of the
        // fourth (which look like a header) are not touched.
        text.replacen(
            "Content-Length: 2\r\nTransfer",
            "x-conflict-len: 2\r\nTransfer",
            1,
        )
        .into_bytes()
    }

    #[test]
    fn marks_only_heads_with_both_framings_whole() {
        assert_eq!(scan(&[PIPELINE]), expected());
    }

    #[test]
    fn any_split_of_the_stream_gives_the_same_bytes() {
        for size in 1..40 {
            let chunks: Vec<&[u8]> = PIPELINE.chunks(size).collect();
            assert_eq!(scan(&chunks), expected(), "chunks of {size}");
        }
    }

    #[test]
    fn malformed_input_passes_through_untouched() {
        let bad =
            b"PUT /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nContent-Length: 1\r\n\r\n";
        assert_eq!(scan(&[bad]), bad.to_vec());
        let garbage =
            b"\x00\x01 not http\r\n\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(scan(&[garbage]), garbage.to_vec());
    }
}
