//! The HTTP/1.1 codec both sides of the proxy share: plain functions and a
//! state machine over bytes, no I/O.
//!
//! The framing guard ([`crate::framing`]) reads clients' requests with it,
//! as hyper's server reads them, and the upstream client
//! ([`crate::backend`]'s `h1`) reads the storage's answers with it, as
//! hyper's client reads them. Both follow hyper 1's rules, so a message is
//! framed the same way wherever fencegate looks at it: chunked bodies with
//! [`Chunked`] (which takes each byte as hyper's decoder does: strict
//! CRLFs, the same extension and trailer limits), `Transfer-Encoding` with [`is_chunked`],
//! `Content-Length` with [`length`] and [`lengths`], and at most
//! [`MAX_HEADERS`] header lines per head.

use std::fmt;

/// The most header (or trailer) lines hyper accepts in one head (its
/// default).
pub const MAX_HEADERS: usize = 100;

/// The longest body hyper frames by `Content-Length`: a longer one fails
/// the message.
pub const MAX_LENGTH: u64 = u64::MAX - 2;

/// hyper's limit on chunk-extension bytes in one message.
const EXTENSIONS_LIMIT: u64 = 16 * 1024;

/// hyper's limit on the bytes of a chunked body's trailers.
const TRAILERS_LIMIT: usize = 16 * 1024;

/// Why a chunked body is malformed (hyper refuses it the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Malformed {}

/// Where in a chunked body the decoder is (hyper's `ChunkedState`); the
/// chunk's size, where there is one, is beside it in [`Chunked`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    Size,
    SizeLws,
    Extension,
    SizeLf,
    /// Inside a chunk's data.
    Data,
    DataCr,
    DataLf,
    Trailer,
    TrailerLf,
    EndCr,
    EndLf,
    /// The body is over.
    End,
}

/// What a run of bytes [`Chunked::decode`] consumed is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// Chunk sizes, extensions and line breaks: nothing to keep.
    Framing,
    /// Chunk data: the body's content.
    Data,
    /// Trailer lines, with the blank line that ends them (when there are
    /// any): parse them once the body ends, as hyper does, with
    /// `httparse::parse_headers` and [`Chunked::trailer_lines`] slots.
    Trailers,
}

/// A chunked body's decoder, fed the bytes that follow the head in any
/// pieces: it says what each run of bytes is and where the body ends. It
/// holds no bytes, only 16 bytes of state (small, as it lives in every
/// answer body's state and every connection's guard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunked {
    /// The chunk size being read, or the data left of the chunk.
    size: u64,
    state: State,
    /// Whether the body has trailers (hyper keeps them from their first
    /// byte).
    trailers: bool,
    /// Trailer lines seen, at most [`MAX_HEADERS`].
    trailer_lines: u8,
    /// Chunk-extension bytes seen in the message, under [`EXTENSIONS_LIMIT`].
    extensions: u16,
    /// Trailer bytes kept, under [`TRAILERS_LIMIT`].
    trailer_bytes: u16,
}

impl Default for Chunked {
    fn default() -> Self {
        Self::new()
    }
}

impl Chunked {
    /// A decoder at the start of a body.
    pub fn new() -> Self {
        Self {
            size: 0,
            state: State::Start,
            trailers: false,
            trailer_lines: 0,
            extensions: 0,
            trailer_bytes: 0,
        }
    }

    /// Whether the body is over (its last byte was decoded).
    pub fn is_done(&self) -> bool {
        self.state == State::End
    }

    /// The trailer lines seen that end in CRLF: hyper parses the trailers
    /// into this many slots (so a line that ends in a bare LF fails them).
    pub fn trailer_lines(&self) -> usize {
        usize::from(self.trailer_lines)
    }

    /// The bytes of chunk data that come next (0 outside a chunk's data).
    pub fn data_left(&self) -> u64 {
        match self.state {
            State::Data => self.size,
            _ => 0,
        }
    }

    /// Decodes the start of `input`: how many leading bytes form one run of
    /// the same [`Piece`], and which. Consumes at least one byte of a
    /// non-empty input unless the body is over, and never a byte past its
    /// end.
    pub fn decode(&mut self, input: &[u8]) -> Result<(usize, Piece), Malformed> {
        if self.state == State::Data {
            let take = usize::try_from(self.size)
                .unwrap_or(usize::MAX)
                .min(input.len());
            self.size -= take as u64;
            if self.size == 0 {
                self.state = State::DataCr;
            }
            return Ok((take, Piece::Data));
        }
        let Some(&first) = input.first() else {
            return Ok((0, Piece::Framing));
        };
        let piece = self.piece_of(first);
        let mut used = 0;
        while let Some(&b) = input.get(used) {
            if matches!(self.state, State::End | State::Data) || self.piece_of(b) != piece {
                break;
            }
            self.step(b, piece)?;
            used += 1;
        }
        Ok((used, piece))
    }

    /// What byte `b`, read next, is: hyper keeps a trailer section from
    /// its first byte to the blank line that ends it.
    fn piece_of(&self, b: u8) -> Piece {
        match self.state {
            State::Data => Piece::Data,
            State::Trailer | State::TrailerLf => Piece::Trailers,
            State::EndCr if b != b'\r' => Piece::Trailers,
            State::EndCr | State::EndLf if self.trailers => Piece::Trailers,
            _ => Piece::Framing,
        }
    }

    /// Takes one byte outside chunk data, as hyper's decoder takes it.
    /// `piece` is what the byte is ([`Self::piece_of`]).
    fn step(&mut self, b: u8, piece: Piece) -> Result<(), Malformed> {
        if piece == Piece::Trailers {
            // hyper's limit, counted as it counts: not on the first byte.
            if self.trailers {
                self.trailer_bytes += 1;
                if usize::from(self.trailer_bytes) >= TRAILERS_LIMIT {
                    return Err(Malformed("chunk trailers bytes over limit"));
                }
            } else {
                self.trailers = true;
                self.trailer_bytes = 1;
            }
        }
        let hex = (b as char).to_digit(16).map(u64::from);
        self.state = match (self.state, b) {
            (State::Start, _) => {
                self.size = hex.ok_or(Malformed("invalid chunk size line: no digit"))?;
                State::Size
            }
            (State::Size, _) if hex.is_some() => {
                self.size = self
                    .size
                    .checked_mul(16)
                    .and_then(|n| n.checked_add(hex?))
                    .ok_or(Malformed("invalid chunk size: overflow"))?;
                State::Size
            }
            (State::Size | State::SizeLws, b'\t' | b' ') => State::SizeLws,
            (State::Size | State::SizeLws, b';') => State::Extension,
            (State::Size | State::SizeLws | State::Extension, b'\r') => State::SizeLf,
            (State::Size | State::SizeLws, _) => return Err(Malformed("invalid chunk size line")),
            (State::Extension, b'\n') => {
                return Err(Malformed("invalid chunk extension: contains a newline"))
            }
            (State::Extension, _) => {
                self.extensions += 1;
                if u64::from(self.extensions) >= EXTENSIONS_LIMIT {
                    return Err(Malformed("chunk extensions over limit"));
                }
                State::Extension
            }
            (State::SizeLf, b'\n') if self.size == 0 => State::EndCr,
            (State::SizeLf, b'\n') => State::Data,
            (State::SizeLf, _) => return Err(Malformed("invalid chunk size LF")),
            (State::DataCr, b'\r') => State::DataLf,
            (State::DataCr, _) => return Err(Malformed("invalid chunk body CR")),
            (State::DataLf, b'\n') => State::Start,
            (State::DataLf, _) => return Err(Malformed("invalid chunk body LF")),
            (State::Trailer, b'\r') => State::TrailerLf,
            (State::Trailer, _) => State::Trailer,
            (State::TrailerLf, b'\n') => {
                if usize::from(self.trailer_lines) >= MAX_HEADERS {
                    return Err(Malformed("chunk trailers count overflow"));
                }
                self.trailer_lines += 1;
                State::EndCr
            }
            (State::TrailerLf, _) => return Err(Malformed("invalid trailer end LF")),
            (State::EndCr, b'\r') => State::EndLf,
            (State::EndCr, _) => State::Trailer,
            (State::EndLf, b'\n') => State::End,
            (State::EndLf, _) => return Err(Malformed("invalid chunk end LF")),
            (State::Data | State::End, _) => unreachable!("not a framing byte"),
        };
        Ok(())
    }
}

/// hyper's test for a chunked message, on the last `Transfer-Encoding`
/// line: `chunked` is its last coding (a value that is not visible ASCII
/// never is).
pub fn is_chunked(value: &[u8]) -> bool {
    let visible = value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b));
    visible
        && value
            .rsplit(|&b| b == b',')
            .next()
            .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// hyper's server-side `Content-Length` parse of one line: ASCII digits
/// only, no sign, no list, no overflow.
pub fn length(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |n, &b| match b {
        b'0'..=b'9' => n.checked_mul(10)?.checked_add(u64::from(b - b'0')),
        _ => None,
    })
}

/// hyper's client-side `Content-Length` parse of all the lines: each a
/// comma-separated list of the same number. `None` if there are no lines,
/// `Some(None)` if they do not state one length.
pub fn lengths<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Option<Option<u64>> {
    let mut found: Option<u64> = None;
    let mut any = false;
    for value in values {
        any = true;
        for part in value.split(|&b| b == b',') {
            let Some(n) = length(part.trim_ascii()) else {
                return Some(None);
            };
            if found.is_some_and(|m| m != n) {
                return Some(None);
            }
            found = Some(n);
        }
    }
    any.then_some(found)
}

/// Appends the size line of a chunk of `len` bytes.
pub fn chunk_size_line(out: &mut Vec<u8>, len: usize) {
    let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        out.push(b"0123456789ABCDEF"[(len >> (4 * i)) & 0xF]);
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `body` fed in pieces of `step` bytes: the data, the trailer
    /// bytes, and the bytes left after the body, or the error.
    fn decode(body: &[u8], step: usize) -> Result<(Vec<u8>, Vec<u8>, usize), Malformed> {
        let mut dec = Chunked::new();
        let (mut data, mut trailers) = (Vec::new(), Vec::new());
        let mut pos = 0;
        while pos < body.len() && !dec.is_done() {
            let end = (pos + step).min(body.len());
            let (n, piece) = dec.decode(&body[pos..end])?;
            assert!(n > 0, "no progress at {pos}");
            match piece {
                Piece::Data => data.extend_from_slice(&body[pos..pos + n]),
                Piece::Trailers => trailers.extend_from_slice(&body[pos..pos + n]),
                Piece::Framing => {}
            }
            pos += n;
        }
        assert!(dec.is_done(), "the body did not end");
        Ok((data, trailers, body.len() - pos))
    }

    #[test]
    fn decodes_in_any_pieces() {
        let body = b"3\r\nabc\r\nA;x=1\r\n0123456789\r\n0\r\nX-Sum: 4\r\n\r\nNEXT";
        for step in 1..body.len() {
            let (data, trailers, rest) = decode(body, step).unwrap();
            assert_eq!(data, b"abc0123456789");
            assert_eq!(trailers, b"X-Sum: 4\r\n\r\n");
            assert_eq!(rest, 4);
        }
        let (data, trailers, rest) = decode(b"0\r\n\r\n", 1).unwrap();
        assert_eq!((data.len(), trailers.len(), rest), (0, 0, 0));
    }

    #[test]
    fn refuses_what_hyper_refuses() {
        for bad in [
            &b"x\r\n"[..],
            b"3\nabc\r\n",
            b"3\r\nabcX\r\n",
            b"3 4\r\n",
            b"3;a\nb\r\n",
            b"0\r\nX: 1\rY\r\n",
            b"0\r\n\rX",
            b"10000000000000000\r\n",
        ] {
            let mut dec = Chunked::new();
            let mut pos = 0;
            let failed = loop {
                match dec.decode(&bad[pos..]) {
                    Err(_) => break true,
                    Ok((n, _)) => pos += n,
                }
                if pos == bad.len() || dec.is_done() {
                    break false;
                }
            };
            assert!(failed, "{:?} was accepted", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_state_stays_small() {
        assert_eq!(std::mem::size_of::<Chunked>(), 16);
    }

    #[test]
    fn limits_extensions_and_trailers() {
        let mut long = b"1;".to_vec();
        long.resize(2 + 16 * 1024, b'x');
        assert!(Chunked::new().decode(&long).is_err());
        let mut trailers = b"0\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            trailers.extend_from_slice(format!("t{i}: 1\r\n").as_bytes());
        }
        trailers.extend_from_slice(b"\r\n");
        assert!(decode(&trailers, 64).is_err());
    }

    #[test]
    fn lengths_as_hyper_reads_them() {
        assert_eq!(length(b"42"), Some(42));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"0x1",
            b"5, 5",
            b"18446744073709551616",
        ] {
            assert_eq!(length(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(lengths([&b"5, 5"[..], b"5"]), Some(Some(5)));
        assert_eq!(lengths([&b"5, 6"[..]]), Some(None));
        assert_eq!(lengths([&b"5,"[..]]), Some(None));
        assert_eq!(lengths(std::iter::empty()), None);
        assert!(is_chunked(b"gzip, chunked"));
        assert!(is_chunked(b"CHUNKED "));
        assert!(!is_chunked(b"chunked, gzip"));
        assert!(!is_chunked(b"chunked\xff"));
        let mut line = Vec::new();
        chunk_size_line(&mut line, 0x1a2);
        assert_eq!(line, b"1A2\r\n");
    }
}
