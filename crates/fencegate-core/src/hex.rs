//! Lowercase hexadecimal, for lease ids and SHA-256 digests. A leaf: it
//! imports nothing from the crate.

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Writes `bytes` as lowercase hex into `out`, which holds twice as many.
pub fn encode_into(bytes: &[u8], out: &mut [u8]) {
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
}

/// `bytes` as lowercase hex.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = vec![0u8; bytes.len() * 2];
    encode_into(bytes, &mut out);
    // Only ASCII digits and letters were written.
    String::from_utf8(out).unwrap_or_default()
}

/// 32 bytes from exactly 64 hex digits (either case); `None` otherwise.
pub fn decode32(text: &str) -> Option<[u8; 32]> {
    let text = text.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let digit = |c: u8| {
        char::from(c)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_strict_digits() {
        let bytes: [u8; 32] = std::array::from_fn(|i| (i * 37) as u8);
        let text = encode(&bytes);
        assert_eq!(text.len(), 64);
        assert_eq!(decode32(&text), Some(bytes));
        assert_eq!(decode32(&text.to_ascii_uppercase()), Some(bytes));
        assert_eq!(decode32(&text[..62]), None);
        // A sign is no digit (u8::from_str_radix would take "+f").
        assert_eq!(decode32(&format!("+f{}", &text[2..])), None);
        assert_eq!(decode32(&format!("zz{}", &text[2..])), None);
    }
}
