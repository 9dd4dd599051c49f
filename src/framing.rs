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
/// any split of a stream. It works in place: [`Scanner::scan`] marks heads
/// in the caller's buffer and says how much of it is complete.
#[derive(Debug)]
pub struct Scanner {
    state: State,
    /// How far into the incomplete head or line the search for its end has
    /// got, so a head that trickles in byte by byte is searched once.
    searched: usize,
}

impl Default for Scanner {
    fn default() -> Self {
        Self {
            state: State::Head,
            searched: 0,
        }
    }
}

fn find_line_end(buf: &[u8], from: usize) -> Option<usize> {
    memchr::memchr(b'\n', &buf[from..]).map(|i| from + i + 1)
}

/// The end of a head (after its blank line), accepting bare LF as hyper does;
/// the search starts at `from`, where an earlier search gave up.
fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    // Back up over a line break the earlier search saw without its follower.
    let mut i = from.saturating_sub(2);
    while let Some(rel) = memchr::memchr(b'\n', &buf[i..]) {
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
    /// Scans `data`, the bytes that follow everything scanned so far (an
    /// incomplete head or line returned earlier comes first again), marking
    /// heads in place. Returns how many leading bytes are complete and may be
    /// handed to the parser; the rest is an incomplete head or chunk line to
    /// pass again with the bytes that follow it.
    pub fn scan(&mut self, data: &mut [u8]) -> usize {
        let mut pos = 0;
        while pos < data.len() {
            let left = data.len() - pos;
            match self.state {
                State::Passthrough => return data.len(),
                State::Fixed(n) | State::ChunkData(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(left);
                    pos += take;
                    let rest = n - take as u64;
                    self.state = match (self.state, rest) {
                        (State::Fixed(_), 0) => State::Head,
                        (State::Fixed(_), _) => State::Fixed(rest),
                        (_, 0) => State::ChunkEnd,
                        _ => State::ChunkData(rest),
                    };
                }
                State::Head => {
                    let Some(end) = find_head_end(&data[pos..], self.searched) else {
                        if left > MAX_HEAD_BYTES {
                            self.state = State::Passthrough;
                            return data.len();
                        }
                        self.searched = left;
                        return pos;
                    };
                    self.searched = 0;
                    self.state = inspect_head(&mut data[pos..pos + end]);
                    pos += end;
                }
                State::ChunkSize | State::ChunkEnd | State::Trailers => {
                    let Some(end) = find_line_end(&data[pos..], self.searched) else {
                        if left > 64 * 1024 {
                            self.state = State::Passthrough;
                            return data.len();
                        }
                        self.searched = left;
                        return pos;
                    };
                    self.searched = 0;
                    let line = &data[pos..pos + end];
                    let blank = matches!(line, b"\r\n" | b"\n");
                    self.state = match self.state {
                        State::ChunkEnd if blank => State::ChunkSize,
                        State::ChunkEnd => State::Passthrough,
                        State::Trailers if blank => State::Head,
                        State::Trailers => State::Trailers,
                        _ => match httparse::parse_chunk_size(line) {
                            Ok(httparse::Status::Complete((_, 0))) => State::Trailers,
                            Ok(httparse::Status::Complete((_, n))) => State::ChunkData(n),
                            _ => State::Passthrough,
                        },
                    };
                    pos += end;
                }
            }
        }
        pos
    }

    /// The stream ended: whatever is held goes to the parser unchanged.
    fn end_of_stream(&mut self) {
        self.state = State::Passthrough;
    }
}

/// Looks at one complete head: marks a `Content-Length` beside
/// `Transfer-Encoding`, and says how the body that follows is framed.
///
/// A plain line scan, not a full parse: hyper parses (and validates) the
/// head after this; here only the three framing headers matter. A request
/// line that does not end in an HTTP/1 version ends the watch.
fn inspect_head(head: &mut [u8]) -> State {
    let mut lines = memchr::memchr_iter(b'\n', head).scan(0, |start, end| {
        let line = &head[*start..end];
        *start = end + 1;
        Some(line.strip_suffix(b"\r").unwrap_or(line))
    });
    let request_line = lines.by_ref().find(|l| !l.is_empty()).unwrap_or_default();
    if !(request_line.ends_with(b" HTTP/1.1") || request_line.ends_with(b" HTTP/1.0")) {
        return State::Passthrough;
    }
    let mut upgrade = request_line.starts_with(b"CONNECT ");
    let mut lengths = 0usize;
    let mut length = None;
    let mut chunked = None;
    for line in lines.take_while(|l| !l.is_empty()) {
        let Some((name, value)) = split_header(line) else {
            continue;
        };
        if name.eq_ignore_ascii_case(b"content-length") {
            lengths += 1;
            length = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<u64>().ok());
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            let last = value.rsplit(|&b| b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            upgrade = true;
        }
    }
    if upgrade {
        return State::Passthrough;
    }
    match chunked {
        Some(true) => {
            mark_lengths(head);
            State::ChunkSize
        }
        // Not chunked last: hyper refuses the request.
        Some(false) => State::Passthrough,
        None => match (lengths, length) {
            (0, _) => State::Head,
            (_, Some(0)) => State::Head,
            (_, Some(n)) => State::Fixed(n),
            (_, None) => State::Passthrough,
        },
    }
}

/// `name: value` of a header line, the value trimmed.
fn split_header(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let colon = memchr::memchr(b':', line)?;
    Some((&line[..colon], line[colon + 1..].trim_ascii()))
}

/// Renames every `Content-Length` header line of `head` (the rare
/// conflicting head) to [`CONFLICT_HEADER`], which has the same length.
fn mark_lengths(head: &mut [u8]) {
    let mut at = 0;
    while at < head.len() {
        let end = memchr::memchr(b'\n', &head[at..]).map_or(head.len(), |i| at + i + 1);
        let line = &head[at..end];
        if at > 0
            && split_header(line).is_some_and(|(n, _)| n.eq_ignore_ascii_case(b"content-length"))
        {
            head[at..at + CONFLICT_HEADER.len()].copy_from_slice(CONFLICT_HEADER.as_bytes());
        }
        at = end;
    }
}

/// A connection whose incoming bytes pass through a [`Scanner`].
///
/// Bytes are read straight into the parser's buffer and scanned there; only
/// an incomplete head (or chunk line) at the end of a read is taken back and
/// held until the rest arrives, so the common case copies nothing.
pub struct Guarded<S> {
    inner: S,
    scanner: Scanner,
    /// An incomplete head or line, waiting for more bytes.
    held: BytesMut,
    /// Scanned bytes not yet handed to the parser.
    ready: BytesMut,
    /// Read buffer for the held case, allocated on first use.
    buf: Vec<u8>,
}

impl<S> Guarded<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            scanner: Scanner::default(),
            held: BytesMut::new(),
            ready: BytesMut::new(),
            buf: Vec::new(),
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
            if this.held.is_empty() {
                // Read into the parser's buffer and scan the new bytes there.
                let start = out.filled().len();
                ready!(Pin::new(&mut this.inner).poll_read(cx, out))?;
                let end = out.filled().len();
                if end == start {
                    return Poll::Ready(Ok(())); // end of stream
                }
                let done = start + this.scanner.scan(&mut out.filled_mut()[start..end]);
                if done < end {
                    this.held.extend_from_slice(&out.filled()[done..end]);
                    out.set_filled(done);
                }
                if done > start {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            // An incomplete head is held: append to it and scan it again.
            if this.buf.is_empty() {
                this.buf = vec![0; 16 * 1024];
            }
            let mut rb = ReadBuf::new(&mut this.buf);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                // End of stream: release what is held so the parser sees it.
                this.scanner.end_of_stream();
                this.ready = this.held.split();
                continue;
            }
            this.held.extend_from_slice(&this.buf[..n]);
            let done = this.scanner.scan(&mut this.held);
            this.ready = this.held.split_to(done);
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
        let mut held = BytesMut::new();
        let mut out = BytesMut::new();
        for c in chunks {
            held.extend_from_slice(c);
            let done = s.scan(&mut held);
            out.extend_from_slice(&held.split_to(done));
        }
        out.extend_from_slice(&held);
        out.to_vec()
    }

    /// A reader that yields the given chunks one per read.
    struct Chunks(std::collections::VecDeque<Vec<u8>>);

    impl AsyncRead for Chunks {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if let Some(mut c) = self.0.pop_front() {
                let n = c.len().min(out.remaining());
                out.put_slice(&c[..n]);
                if n < c.len() {
                    self.0.push_front(c.split_off(n));
                }
            }
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn the_guarded_stream_gives_the_same_bytes_for_any_split_and_buffer() {
        use tokio::io::AsyncReadExt;
        for size in [1, 2, 3, 7, 16, 40, 1000] {
            for read_size in [5, 64, 4096] {
                let chunks = PIPELINE.chunks(size).map(|c| c.to_vec()).collect();
                let mut g = Guarded::new(Chunks(chunks));
                let mut got = Vec::new();
                let mut buf = vec![0u8; read_size];
                loop {
                    let n = g.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                assert_eq!(got, expected(), "chunks of {size}, reads of {read_size}");
            }
        }
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
