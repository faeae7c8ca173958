//! The common shape of an event line, read without a JSON parser: one flat object whose
//! values are strings without escapes, integers and nulls.
//!
//! [`object`] either fills the cells exactly as the serde visitor of
//! [`super::decode`] would for that line, or declines (returns false) and leaves the line
//! to it. It declines at the first thing outside the common shape — an escape, a
//! control character or invalid UTF-8 in the line, a fraction, an exponent, `-0`, more
//! than 18 digits, `true`/`false`, a nested value, a repeated field, anything after the
//! object — so every error message, and every value of an unusual line, stays serde's.
//! Only the common line is faster: no per-field visitor calls, strings scanned 16 bytes at
//! a time, and each key compared first with the schema's field after the last one.

use std::borrow::Cow;

use super::validate::Cell;

/// JSON's insignificant whitespace.
fn ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The high bit of each byte of `w` that may be `"`, `\\` or below 0x20 (the classic
/// zero-byte tests): the lowest flagged byte is always one of them, a higher flag may be
/// wrong only above a byte that truly is, and no such byte goes unflagged.
fn special_bits(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero = |x: u64| x.wrapping_sub(ONES) & !x;
    let quote = w ^ (ONES * u64::from(b'"'));
    let slash = w ^ (ONES * u64::from(b'\\'));
    let control = w.wrapping_sub(ONES * 0x20) & !w;
    (zero(quote) | zero(slash) | control) & HIGH
}

/// Whether a byte ends the fast reading of a string: its closing quote, an escape, or a
/// control character (which JSON does not allow unescaped).
fn ends_string(c: u8) -> bool {
    c == b'"' || c == b'\\' || c < 0x20
}

/// One bit per byte of `block` that is `"`, `\\` or below 0x20 (bit i for byte i), with
/// SSE2's byte compares: three compares and a mask a 16-byte block.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[target_feature(enable = "sse2")]
fn block_specials(block: &[u8; 16]) -> u32 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_max_epu8, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
        _mm_set_epi64x,
    };
    let [lo, hi] = [0, 8].map(|at| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&block[at..at + 8]);
        i64::from_le_bytes(w)
    });
    let v = _mm_set_epi64x(hi, lo);
    let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8));
    let slash = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8));
    // Unsigned `byte <= 0x1f` as `max(byte, 0x1f) == 0x1f`.
    let low = _mm_set1_epi8(0x1f);
    let control = _mm_cmpeq_epi8(_mm_max_epu8(v, low), low);
    _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(quote, slash), control)) as u32
}

/// The offset of the first byte of `b` that is `"`, `\\` or below 0x20, if any: 16
/// bytes at a time (SSE2, on x86-64), then 8, then one. A string's bytes were scanned
/// 8 at a time and then byte by byte inside the line's parse, whose loop state lived on
/// the stack: ≈ 7 ns a 36-byte id on its own, ≈ 4 ns this way.
fn first_special(b: &[u8]) -> Option<usize> {
    let mut at = 0;
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        let mut blocks = b.chunks_exact(16);
        for block in &mut blocks {
            if let Ok(block) = <&[u8; 16]>::try_from(block) {
                // SAFETY: SSE2 is part of the x86-64 baseline (and the cfg above checks
                // the build enables it), so every CPU this runs on has it.
                let found = unsafe { block_specials(block) };
                if found != 0 {
                    return Some(at + found.trailing_zeros() as usize);
                }
            }
            at += 16;
        }
    }
    let mut words = b[at..].chunks_exact(8);
    for word in &mut words {
        if let Ok(word) = <[u8; 8]>::try_from(word) {
            let found = special_bits(u64::from_le_bytes(word));
            if found != 0 {
                return Some(at + (found.trailing_zeros() / 8) as usize);
            }
        }
        at += 8;
    }
    let rest = words.remainder();
    rest.iter().position(|&c| ends_string(c)).map(|i| at + i)
}

/// Whether two field names are equal, compared a word at a time: names are a few bytes,
/// for which a call into libc's `memcmp` cost more than the comparison (it was ≈ 2 % of
/// the throughput benchmark's CPU time, one call per field of every line).
fn same_name(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let w8 = |s: &[u8], at: usize| s.get(at..at + 8).and_then(|w| <[u8; 8]>::try_from(w).ok());
    let w4 = |s: &[u8], at: usize| s.get(at..at + 4).and_then(|w| <[u8; 4]>::try_from(w).ok());
    match n {
        // The first and the last word overlap to cover every byte.
        8..=16 => w8(a, 0) == w8(b, 0) && w8(a, n - 8) == w8(b, n - 8),
        4..=7 => w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4),
        0..=3 => a.iter().zip(b).all(|(x, y)| x == y),
        _ => a == b,
    }
}

/// A cursor over one line, checked to be UTF-8 as a whole.
struct Cursor<'de> {
    b: &'de [u8],
    text: &'de str,
    at: usize,
}

impl<'de> Cursor<'de> {
    fn skip_ws(&mut self) {
        while self.at < self.b.len() && ws(self.b[self.at]) {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    /// A string whose opening quote is at the cursor: its text, when it holds no escape
    /// and no control character (the line is valid UTF-8, and quotes are ASCII: its
    /// bounds are character boundaries).
    fn string(&mut self) -> Option<&'de str> {
        let start = self.at + 1;
        let end = start + first_special(self.b.get(start..)?)?;
        if self.b[end] != b'"' {
            return None;
        }
        self.at = end + 1;
        self.text.get(start..end)
    }

    /// An integer of at most 18 digits (always within i64), in JSON's grammar; `-0` is
    /// declined. A fraction or exponent after the digits is left at the cursor, where
    /// [`object`] declines it as it does anything but `,` or `}` after a value.
    fn integer(&mut self) -> Option<i64> {
        let neg = self.peek() == Some(b'-');
        let start = self.at + usize::from(neg);
        let mut i = start;
        let mut v: i64 = 0;
        while let Some(c) = self.b.get(i).filter(|c| c.is_ascii_digit()) {
            if i - start == 18 {
                return None;
            }
            v = v * 10 + i64::from(c - b'0');
            i += 1;
        }
        let digits = &self.b[start..i];
        let leading_zero = digits.len() > 1 && digits[0] == b'0';
        if digits.is_empty() || leading_zero || (neg && v == 0) {
            return None;
        }
        self.at = i;
        Some(if neg { -v } else { v })
    }

    /// `null` (anything glued on after it is declined by [`object`], as after any value).
    fn null(&mut self) -> bool {
        let end = self.at + 4;
        if self.b.get(self.at..end) == Some(b"null") {
            self.at = end;
            true
        } else {
            false
        }
    }

    /// A value of the common shape.
    fn value(&mut self) -> Option<Cell<'de>> {
        match self.peek()? {
            b'"' => self.string().map(|s| Cell::Str(Cow::Borrowed(s))),
            b'-' | b'0'..=b'9' => self.integer().map(Cell::Int),
            b'n' => self.null().then_some(Cell::Null),
            _ => None,
        }
    }
}

/// Read `line` as one flat object into `cells` (one per name of `names`, all
/// [`Cell::Missing`] on entry). False when the line is not of the common shape; `cells`
/// may then be partly filled, and the caller reads the line again the full way.
pub(super) fn object<'de>(line: &'de [u8], names: &[&str], cells: &mut [Cell<'de>]) -> bool {
    // One check of the whole line instead of one per string (invalid UTF-8 anywhere is
    // serde's to report).
    let Ok(text) = std::str::from_utf8(line) else {
        return false;
    };
    let mut c = Cursor {
        b: line,
        text,
        at: 0,
    };
    c.skip_ws();
    if c.peek() != Some(b'{') {
        return false;
    }
    c.at += 1;
    c.skip_ws();
    if c.peek() == Some(b'}') {
        c.at += 1;
    } else {
        // Fields usually come in the schema's order: the one after the last is tried
        // first.
        let mut next = 0;
        loop {
            if c.peek() != Some(b'"') {
                return false;
            }
            let Some(key) = c.string() else {
                return false;
            };
            c.skip_ws();
            if c.peek() != Some(b':') {
                return false;
            }
            c.at += 1;
            c.skip_ws();
            let Some(value) = c.value() else {
                return false;
            };
            // Unknown fields are ignored, as by the full reader; a repeated one is its
            // to reject.
            let key = key.as_bytes();
            let at = match names.get(next) {
                Some(n) if same_name(n.as_bytes(), key) => Some(next),
                _ => names.iter().position(|n| same_name(n.as_bytes(), key)),
            };
            if let Some(i) = at {
                if cells[i] != Cell::Missing {
                    return false;
                }
                cells[i] = value;
                next = i + 1;
            }
            c.skip_ws();
            match c.peek() {
                Some(b',') => {
                    c.at += 1;
                    c.skip_ws();
                }
                Some(b'}') => {
                    c.at += 1;
                    break;
                }
                _ => return false,
            }
        }
    }
    c.skip_ws();
    c.at == line.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: [&str; 3] = ["a", "b", "c"];

    fn read(line: &str) -> Option<Vec<Cell<'_>>> {
        let mut cells = vec![Cell::Missing; NAMES.len()];
        object(line.as_bytes(), &NAMES, &mut cells).then_some(cells)
    }

    #[test]
    fn names_compare_equal_exactly_when_their_bytes_do() {
        let names = [
            "",
            "a",
            "ab",
            "abc",
            "abcd",
            "abcde",
            "abcdefg",
            "abcdefgh",
            "abcdefghi",
            "abcdefghijklmnop",
            "abcdefghijklmnopq",
            "event_id",
            "event_ts",
            "amount_cents",
        ];
        for a in names {
            for b in names {
                assert_eq!(same_name(a.as_bytes(), b.as_bytes()), a == b, "{a} {b}");
            }
            // One byte changed anywhere.
            for i in 0..a.len() {
                let mut c = a.as_bytes().to_vec();
                c[i] ^= 1;
                assert!(!same_name(a.as_bytes(), &c), "{a} at {i}");
            }
        }
    }

    #[test]
    fn the_common_shape_is_read() {
        let cells = read(r#" { "a" : "xéy" ,"b":-12,"zz":"ignored", "c":null } "#).unwrap();
        assert_eq!(
            cells,
            vec![Cell::Str("x\u{e9}y".into()), Cell::Int(-12), Cell::Null]
        );
        assert_eq!(read("{}").unwrap(), vec![Cell::Missing; 3]);
        assert_eq!(read(r#"{"b":0}"#).unwrap()[1], Cell::Int(0));
        assert_eq!(
            read(r#"{"b":999999999999999999}"#).unwrap()[1],
            Cell::Int(999_999_999_999_999_999)
        );
    }

    /// The word test flags exactly the words holding a quote, a backslash or a control
    /// character, wherever it lies and whatever the other bytes are.
    #[test]
    fn the_word_test_finds_every_special_byte() {
        let fillers = [
            b'a', b' ', b'~', 0x7f, 0x80, 0xc3, 0xff, b'!', b'#', b'[', b']',
        ];
        for pos in 0..8 {
            for filler in fillers {
                for b in 0..=255u8 {
                    let mut word = [filler; 8];
                    word[pos] = b;
                    let want = ends_string(b);
                    let bits = special_bits(u64::from_le_bytes(word));
                    assert_eq!(bits != 0, want, "{word:?}");
                    if want {
                        assert_eq!(bits.trailing_zeros() / 8, pos as u32, "{word:?}");
                    }
                }
            }
        }
        // Strings longer than a word, with the quote at every offset.
        for len in 0..40 {
            let text = format!("{{\"a\":\"{}\"}}", "x".repeat(len));
            assert_eq!(read(&text).unwrap()[0], Cell::Str("x".repeat(len).into()));
            let escaped = format!("{{\"a\":\"{}\\n\"}}", "x".repeat(len));
            assert!(read(&escaped).is_none(), "{escaped}");
        }
    }

    /// The scan finds the first special byte wherever it lies — in a 16-byte block, an
    /// 8-byte word or the bytes after them — whatever byte it is, whatever follows it.
    #[test]
    fn the_scan_finds_the_first_special_byte_of_any_length() {
        let fillers = [b'a', 0x7f, 0x80, 0xff, b'!', b'#'];
        for len in 0..=40 {
            for filler in fillers {
                let plain = vec![filler; len];
                assert_eq!(first_special(&plain), None, "{plain:?}");
                for pos in 0..len {
                    for b in 0..=255u8 {
                        let mut bytes = plain.clone();
                        bytes[pos] = b;
                        // A second special byte later never hides the first.
                        if pos + 3 < len {
                            bytes[pos + 3] = b'"';
                        }
                        let want = if ends_string(b) {
                            Some(pos)
                        } else {
                            (pos + 3 < len).then_some(pos + 3)
                        };
                        assert_eq!(first_special(&bytes), want, "{bytes:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn anything_else_is_declined() {
        for line in [
            r#"{"a":"x\"y"}"#,
            "{\"a\":\"tab\there\"}",
            r#"{"b":1.5}"#,
            r#"{"b":1e3}"#,
            r#"{"b":-0}"#,
            r#"{"b":01}"#,
            r#"{"b":1234567890123456789}"#,
            r#"{"b":-}"#,
            r#"{"b":true}"#,
            r#"{"b":nul}"#,
            r#"{"b":nullx}"#,
            r#"{"b":[1]}"#,
            r#"{"b":{}}"#,
            r#"{"a":"x","a":"y"}"#,
            r#"{"a":"x",}"#,
            r#"{"a":"x"} x"#,
            r#"{"a":"x""#,
            r#"{"a" "x"}"#,
            r#"[1]"#,
            "",
            r#"{"a":"x"}{}"#,
            r#"{"b":12"#,
        ] {
            assert!(read(line).is_none(), "{line}");
        }
        // Invalid UTF-8 inside a string.
        let mut cells = vec![Cell::Missing; 3];
        assert!(!object(b"{\"a\":\"\xff\"}", &NAMES, &mut cells));
    }
}
