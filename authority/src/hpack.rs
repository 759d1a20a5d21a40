//! HPACK (RFC 7541): the decoder that follows a client's header compression,
//! and the plainest encoder for handing the same fields on.
//!
//! Written here because no crate offered a decoder that is safe on untrusted
//! input: `hpack` is unmaintained and panics on one byte (RUSTSEC-2023-0085),
//! `fluke-hpack` and `loona-hpack` before 0.4.3 carry the same panic
//! (bearcove/loona#247), and `httlib-hpack` indexes past the end of a
//! truncated integer; h2's own decoder is private. `loona-hpack` 0.4.3 is
//! fixed, but bounds no decoded list and drops the never-indexed flag an
//! intermediary must keep: it is the independent reference the `hpack` fuzz
//! target and its tests compare this decoder with (the `fuzzing` module). Every
//! error here is a value, never a panic, and every size is bounded (the
//! dynamic table by the size h2 advertises, a decoded list by the caller's
//! limit).

use std::{collections::VecDeque, sync::LazyLock};

use bytes::{BufMut, Bytes, BytesMut};

/// Per-entry overhead in table and header-list sizes (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

/// The largest integer accepted: more would only serve to exhaust memory.
const MAX_INTEGER: u64 = 1 << 28;

/// Why a header block could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HpackError {
    /// The block ends inside a representation.
    #[error("header block truncated")]
    Truncated,
    /// An integer above [`MAX_INTEGER`] or with too many octets.
    #[error("integer too large")]
    Integer,
    /// An index that names no table entry.
    #[error("index {0} is not in the header table")]
    Index(usize),
    /// A Huffman string with an invalid code, EOS or bad padding.
    #[error("invalid Huffman string")]
    Huffman,
    /// A table size update above what the server allows.
    #[error("table size update to {size} exceeds the limit {limit}")]
    TableSize {
        /// Requested size.
        size: usize,
        /// The largest allowed.
        limit: usize,
    },
    /// A table size update after a header field (RFC 7541 §4.2).
    #[error("table size update after a header field")]
    MisplacedSizeUpdate,
    /// The decoded list is larger than the caller allows.
    #[error("header list larger than {0} bytes")]
    ListTooLarge(usize),
}

/// One decoded header field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Field {
    /// Name, as sent (pseudo-headers start with `:`).
    pub(crate) name: Bytes,
    /// Value.
    pub(crate) value: Bytes,
    /// Sent as "never indexed": an intermediary must keep it so (§6.2.3).
    pub(crate) never_indexed: bool,
}

/// Mirrors a peer's encoder: one per connection and direction, fed every
/// header block in order.
pub(crate) struct Decoder {
    /// Dynamic table, newest entry first.
    table: VecDeque<(Bytes, Bytes)>,
    /// Sum of the entries' sizes.
    size: usize,
    /// The table's current maximum (changed by size updates).
    max_size: usize,
    /// The largest maximum the peer may choose: our
    /// `SETTINGS_HEADER_TABLE_SIZE`.
    limit: usize,
}

impl Decoder {
    /// A decoder whose peer may use a table of up to `limit` bytes.
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max_size: limit,
            limit,
        }
    }

    /// Decodes one complete header block; the decoded list (names, values
    /// and 32 bytes per field) may not exceed `max_list` bytes.
    ///
    /// # Errors
    /// The block is malformed or too large. The table may then hold part of
    /// the block's insertions: the connection cannot go on (RFC 7541 §2.4
    /// makes every decoding error a connection error).
    pub(crate) fn decode(
        &mut self,
        block: &[u8],
        max_list: usize,
    ) -> Result<Vec<Field>, HpackError> {
        let mut fields = Vec::new();
        let mut list_size = 0usize;
        let mut src = block;
        while let Some(&first) = src.first() {
            let field = if first & 0x80 != 0 {
                let index = integer(&mut src, 7)?;
                let (name, value) = self.entry(index)?;
                Field {
                    name,
                    value,
                    never_indexed: false,
                }
            } else if first & 0xc0 == 0x40 {
                let (name, value) = self.literal(&mut src, 6)?;
                self.insert(name.clone(), value.clone());
                Field {
                    name,
                    value,
                    never_indexed: false,
                }
            } else if first & 0xe0 == 0x20 {
                if !fields.is_empty() {
                    return Err(HpackError::MisplacedSizeUpdate);
                }
                let size = integer(&mut src, 5)?;
                if size > self.limit {
                    return Err(HpackError::TableSize {
                        size,
                        limit: self.limit,
                    });
                }
                self.max_size = size;
                self.evict();
                continue;
            } else {
                let (name, value) = self.literal(&mut src, 4)?;
                Field {
                    name,
                    value,
                    never_indexed: first & 0x10 != 0,
                }
            };
            list_size =
                list_size.saturating_add(field.name.len() + field.value.len() + ENTRY_OVERHEAD);
            if list_size > max_list {
                return Err(HpackError::ListTooLarge(max_list));
            }
            fields.push(field);
        }
        Ok(fields)
    }

    /// A literal's name (indexed with a `prefix`-bit index, or literal) and value.
    fn literal(&self, src: &mut &[u8], prefix: u8) -> Result<(Bytes, Bytes), HpackError> {
        let index = integer(src, prefix)?;
        let name = if index == 0 {
            string(src)?
        } else {
            self.entry(index)?.0
        };
        Ok((name, string(src)?))
    }

    /// Entry `index` of the static table followed by the dynamic one (1-based).
    fn entry(&self, index: usize) -> Result<(Bytes, Bytes), HpackError> {
        match index {
            0 => Err(HpackError::Index(0)),
            i if i <= STATIC_TABLE.len() => {
                let (name, value) = STATIC_TABLE[i - 1];
                Ok((Bytes::from_static(name), Bytes::from_static(value)))
            }
            i => self
                .table
                .get(i - STATIC_TABLE.len() - 1)
                .cloned()
                .ok_or(HpackError::Index(i)),
        }
    }

    /// Checks the table's bookkeeping; panics naming what is wrong. The
    /// fuzz target (`fuzz/fuzz_targets/hpack.rs`) and the property tests
    /// call it after every block: the size is the sum of the entries'
    /// sizes, and within the maximum, itself within the limit.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn check(&self) {
        let sum: usize = self
            .table
            .iter()
            .map(|(name, value)| name.len() + value.len() + ENTRY_OVERHEAD)
            .sum();
        assert_eq!(self.size, sum, "the table's size is not its entries'");
        assert!(
            self.size <= self.max_size,
            "{} over the maximum {}",
            self.size,
            self.max_size
        );
        assert!(
            self.max_size <= self.limit,
            "maximum {} over the limit {}",
            self.max_size,
            self.limit
        );
    }

    /// Adds an entry, evicting the oldest ones to make room (§4.4).
    fn insert(&mut self, name: Bytes, value: Bytes) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            // Larger than the whole table: it empties the table (§4.4).
            self.table.clear();
            self.size = 0;
            return;
        }
        self.size += size;
        self.table.push_front((name, value));
        self.evict();
    }

    /// Drops the oldest entries until the table fits its maximum.
    fn evict(&mut self) {
        while self.size > self.max_size {
            match self.table.pop_back() {
                Some((name, value)) => self.size -= name.len() + value.len() + ENTRY_OVERHEAD,
                None => {
                    self.size = 0;
                    break;
                }
            }
        }
    }
}

/// Encodes `fields` with no indexing at all (§6.2.2, or §6.2.3 where the
/// field was sent never-indexed): the receiver's dynamic table stays empty,
/// so this encoder needs no state.
pub(crate) fn encode_literal(fields: &[Field], dst: &mut BytesMut) {
    for field in fields {
        dst.put_u8(if field.never_indexed { 0x10 } else { 0x00 });
        put_string(&field.name, dst);
        put_string(&field.value, dst);
    }
}

/// A raw (not Huffman) string literal (§5.2).
fn put_string(s: &[u8], dst: &mut BytesMut) {
    put_integer(s.len(), 7, 0x00, dst);
    dst.put_slice(s);
}

/// An integer with an `prefix`-bit prefix; `flags` fills the bits above it (§5.1).
fn put_integer(mut value: usize, prefix: u8, flags: u8, dst: &mut BytesMut) {
    let max = (1usize << prefix) - 1;
    if value < max {
        dst.put_u8(flags | value as u8);
        return;
    }
    dst.put_u8(flags | max as u8);
    value -= max;
    while value >= 0x80 {
        dst.put_u8((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    dst.put_u8(value as u8);
}

/// Reads an integer with a `prefix`-bit prefix (§5.1).
fn integer(src: &mut &[u8], prefix: u8) -> Result<usize, HpackError> {
    let (&first, mut rest) = src.split_first().ok_or(HpackError::Truncated)?;
    let max = (1u64 << prefix) - 1;
    let mut value = u64::from(first) & max;
    if value == max {
        let mut shift = 0u32;
        loop {
            let (&byte, tail) = rest.split_first().ok_or(HpackError::Truncated)?;
            rest = tail;
            value += u64::from(byte & 0x7f) << shift;
            if value > MAX_INTEGER {
                return Err(HpackError::Integer);
            }
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 28 {
                return Err(HpackError::Integer);
            }
        }
    }
    *src = rest;
    usize::try_from(value).map_err(|_| HpackError::Integer)
}

/// Reads a string literal, raw or Huffman-coded (§5.2).
fn string(src: &mut &[u8]) -> Result<Bytes, HpackError> {
    let huffman = src.first().is_some_and(|b| b & 0x80 != 0);
    let len = integer(src, 7)?;
    if len > src.len() {
        return Err(HpackError::Truncated);
    }
    let (raw, rest) = src.split_at(len);
    *src = rest;
    if huffman {
        huffman_decode(raw).map(Bytes::from)
    } else {
        Ok(Bytes::copy_from_slice(raw))
    }
}

/// Bit length of each symbol's code (RFC 7541 Appendix B), symbols 0–255
/// then EOS (256). The codes themselves are canonical: within a length they
/// count up in symbol order, and each length starts where the shorter one
/// ended, shifted left.
#[rustfmt::skip]
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
];

/// The longest code.
const MAX_CODE_LENGTH: usize = 30;

/// The EOS symbol, which may not appear in a string (§5.2).
const EOS: u16 = 256;

/// Canonical decoding tables built from [`CODE_LENGTHS`].
struct Canonical {
    /// How many codes have each length.
    count: [u16; MAX_CODE_LENGTH + 1],
    /// Symbols ordered by (code length, symbol).
    symbols: [u16; 257],
}

static CANONICAL: LazyLock<Canonical> = LazyLock::new(|| {
    let mut count = [0u16; MAX_CODE_LENGTH + 1];
    for &len in &CODE_LENGTHS {
        count[usize::from(len)] += 1;
    }
    let mut symbols = [0u16; 257];
    let mut next = 0;
    for len in 1..=MAX_CODE_LENGTH {
        for (symbol, &l) in (0u16..).zip(CODE_LENGTHS.iter()) {
            if usize::from(l) == len {
                symbols[next] = symbol;
                next += 1;
            }
        }
    }
    Canonical { count, symbols }
});

/// Decodes a Huffman-coded string (§5.2): at most 7 bits of padding, all
/// ones (a prefix of EOS), and no EOS.
fn huffman_decode(src: &[u8]) -> Result<Vec<u8>, HpackError> {
    let canonical = &*CANONICAL;
    let mut out = Vec::with_capacity(src.len() * 8 / 5 + 1);
    // The code read so far, its length, the first code of that length and
    // the index in `symbols` where that length starts.
    let (mut code, mut len, mut first, mut index) = (0u32, 0usize, 0u32, 0usize);
    let mut all_ones = true;
    for byte in src {
        for shift in (0..8).rev() {
            let bit = u32::from(byte >> shift) & 1;
            code |= bit;
            all_ones &= bit == 1;
            len += 1;
            let count = u32::from(canonical.count[len]);
            // Canonical codes keep `code >= first` at every length.
            if code >= first && code - first < count {
                let symbol = canonical.symbols[index + (code - first) as usize];
                if symbol == EOS {
                    return Err(HpackError::Huffman);
                }
                out.push(symbol as u8);
                (code, len, first, index) = (0, 0, 0, 0);
                all_ones = true;
                continue;
            }
            if len == MAX_CODE_LENGTH {
                return Err(HpackError::Huffman);
            }
            index += count as usize;
            first = (first + count) << 1;
            code <<= 1;
        }
    }
    if len > 7 || !all_ones {
        return Err(HpackError::Huffman);
    }
    Ok(out)
}

/// The static table (RFC 7541 Appendix A).
const STATIC_TABLE: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses a hex dump as the RFC prints it.
    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap())
            .collect()
    }

    /// The list as (name, value) strings.
    fn pairs(fields: &[Field]) -> Vec<(String, String)> {
        fields
            .iter()
            .map(|f| {
                (
                    String::from_utf8(f.name.to_vec()).unwrap(),
                    String::from_utf8(f.value.to_vec()).unwrap(),
                )
            })
            .collect()
    }

    fn owned(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Huffman-encodes `s` with the canonical codes (test-side encoder).
    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let mut codes = [0u32; 257];
        let (mut code, mut prev_len) = (0u32, 0u8);
        let mut order: Vec<usize> = (0..257).collect();
        order.sort_by_key(|&sym| (CODE_LENGTHS[sym], sym));
        for (i, &sym) in order.iter().enumerate() {
            let len = CODE_LENGTHS[sym];
            if i > 0 {
                code = (code + 1) << (len - prev_len);
            }
            prev_len = len;
            codes[sym] = code;
        }
        let (mut out, mut acc, mut bits) = (Vec::new(), 0u64, 0u32);
        for &b in s {
            let len = u32::from(CODE_LENGTHS[usize::from(b)]);
            acc = (acc << len) | u64::from(codes[usize::from(b)]);
            bits += len;
            while bits >= 8 {
                out.push((acc >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
        }
        out
    }

    #[test]
    fn rfc7541_c3_requests_without_huffman_share_one_table() {
        let mut decoder = Decoder::new(4096);
        let first = decoder
            .decode(
                &hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d"),
                MAX,
            )
            .unwrap();
        assert_eq!(
            pairs(&first),
            owned(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ])
        );
        assert_eq!(decoder.size, 57);
        let second = decoder
            .decode(&hex("8286 84be 5808 6e6f 2d63 6163 6865"), MAX)
            .unwrap();
        assert_eq!(
            pairs(&second),
            owned(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
        assert_eq!(decoder.size, 110);
        let third = decoder
            .decode(
                &hex("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65"),
                MAX,
            )
            .unwrap();
        assert_eq!(
            pairs(&third),
            owned(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(decoder.size, 164);
    }

    #[test]
    fn rfc7541_c4_requests_with_huffman() {
        let mut decoder = Decoder::new(4096);
        let first = decoder
            .decode(&hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"), MAX)
            .unwrap();
        assert_eq!(
            pairs(&first)[3],
            owned(&[(":authority", "www.example.com")])[0]
        );
        let second = decoder
            .decode(&hex("8286 84be 5886 a8eb 1064 9cbf"), MAX)
            .unwrap();
        assert_eq!(
            pairs(&second)[4],
            owned(&[("cache-control", "no-cache")])[0]
        );
        let third = decoder
            .decode(
                &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
                MAX,
            )
            .unwrap();
        assert_eq!(
            pairs(&third)[4],
            owned(&[("custom-key", "custom-value")])[0]
        );
        assert_eq!(decoder.size, 164);
    }

    #[test]
    fn rfc7541_c5_responses_evict_the_oldest_entries() {
        let mut decoder = Decoder::new(256);
        decoder
            .decode(
                &hex(
                    "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 \
                     3133 2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 \
                     7861 6d70 6c65 2e63 6f6d",
                ),
                MAX,
            )
            .unwrap();
        assert_eq!(decoder.size, 222);
        let second = decoder.decode(&hex("4803 3330 37c1 c0bf"), MAX).unwrap();
        assert_eq!(
            pairs(&second),
            owned(&[
                (":status", "307"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com"),
            ])
        );
        assert_eq!(decoder.size, 222);
        assert_eq!(decoder.table.len(), 4, ":status 302 was evicted");
    }

    #[test]
    fn huffman_round_trips_every_byte_value() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(huffman_decode(&huffman_encode(&all)).unwrap(), all);
        assert_eq!(
            huffman_encode(b"www.example.com"),
            hex("f1e3 c2e5 f23a 6ba0 ab90 f4ff")
        );
    }

    #[test]
    fn huffman_refuses_eos_long_padding_and_zero_padding() {
        // EOS itself: 30 ones, padded with ones.
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xff]),
            Err(HpackError::Huffman)
        );
        // 'a' (00011) then 8 bits of padding.
        assert_eq!(huffman_decode(&[0x1f, 0xff]), Err(HpackError::Huffman));
        // 'a' then padding of zeros.
        assert_eq!(huffman_decode(&[0x18]), Err(HpackError::Huffman));
        assert_eq!(huffman_decode(&[0x1f]).unwrap(), b"a");
    }

    #[test]
    fn malformed_blocks_are_errors_not_panics() {
        let cases: &[(&str, HpackError)] = &[
            // A size update cut short (RUSTSEC-2023-0085's input).
            ("3f", HpackError::Truncated),
            ("ff", HpackError::Truncated),
            ("80", HpackError::Index(0)),
            ("be", HpackError::Index(62)),
            // A literal whose value length runs past the end.
            ("4003 6162 6305 61", HpackError::Truncated),
            ("ff ff ff ff ff ff 01", HpackError::Integer),
            // A table size above what the server allows.
            (
                "3fe2 1f",
                HpackError::TableSize {
                    size: 4097,
                    limit: 4096,
                },
            ),
            ("82 20", HpackError::MisplacedSizeUpdate),
        ];
        for (input, expected) in cases {
            let mut decoder = Decoder::new(4096);
            assert_eq!(
                decoder.decode(&hex(input), MAX).unwrap_err(),
                *expected,
                "{input}"
            );
        }
    }

    #[test]
    fn size_update_at_the_start_shrinks_the_table() {
        let mut decoder = Decoder::new(4096);
        decoder
            .decode(
                &hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d"),
                MAX,
            )
            .unwrap();
        assert_eq!(decoder.table.len(), 1);
        // Size 0, then an indexed static field.
        assert_eq!(pairs(&decoder.decode(&hex("20 82"), MAX).unwrap()).len(), 1);
        assert!(decoder.table.is_empty());
        assert_eq!(
            decoder.decode(&hex("be"), MAX).unwrap_err(),
            HpackError::Index(62)
        );
    }

    #[test]
    fn a_list_over_the_limit_is_refused() {
        let mut decoder = Decoder::new(4096);
        // Ten references to one 4000-byte entry would decode to 40 KB.
        let mut block = vec![0x40, 0x01, b'x', 0x7f];
        put_integer_vec(3900, &mut block);
        block.extend(std::iter::repeat_n(b'v', 3900));
        block.extend(std::iter::repeat_n(0xbe, 10));
        assert_eq!(
            decoder.decode(&block, 16 * 1024).unwrap_err(),
            HpackError::ListTooLarge(16 * 1024)
        );
    }

    fn put_integer_vec(value: usize, out: &mut Vec<u8>) {
        let mut b = BytesMut::new();
        put_integer(value, 7, 0, &mut b);
        out.extend_from_slice(&b[1..]);
    }

    #[test]
    fn literal_encoding_decodes_to_the_same_fields_and_keeps_never_indexed() {
        let fields = vec![
            field(":method", "POST", false),
            field(":path", "/ProxyService/Proxy", false),
            field("authorization", "Bearer secret", true),
            field("x-long", &"y".repeat(300), false),
        ];
        let mut encoded = BytesMut::new();
        encode_literal(&fields, &mut encoded);
        let mut decoder = Decoder::new(4096);
        assert_eq!(decoder.decode(&encoded, MAX).unwrap(), fields);
        assert!(
            decoder.table.is_empty(),
            "literal fields leave the table empty"
        );
    }

    fn field(name: &str, value: &str, never_indexed: bool) -> Field {
        Field {
            name: Bytes::copy_from_slice(name.as_bytes()),
            value: Bytes::copy_from_slice(value.as_bytes()),
            never_indexed,
        }
    }

    const MAX: usize = 64 * 1024;

    mod prop {
        use proptest::prelude::*;

        use super::*;

        proptest! {
            #[test]
            fn any_bytes_decode_or_fail_without_panic(
                blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 1..5)
            ) {
                let mut decoder = Decoder::new(4096);
                for block in blocks {
                    let _ = decoder.decode(&block, MAX);
                    decoder.check();
                }
            }

            #[test]
            fn any_string_round_trips_through_huffman(s in proptest::collection::vec(any::<u8>(), 0..300)) {
                prop_assert_eq!(huffman_decode(&huffman_encode(&s)).unwrap(), s);
            }

            #[test]
            fn literal_fields_round_trip(
                list in proptest::collection::vec(
                    (proptest::collection::vec(any::<u8>(), 0..40), proptest::collection::vec(any::<u8>(), 0..200), any::<bool>()),
                    0..20,
                )
            ) {
                let fields: Vec<Field> = list
                    .into_iter()
                    .map(|(n, v, never_indexed)| Field { name: n.into(), value: v.into(), never_indexed })
                    .collect();
                let mut encoded = BytesMut::new();
                encode_literal(&fields, &mut encoded);
                prop_assert_eq!(Decoder::new(4096).decode(&encoded, usize::MAX).unwrap(), fields);
            }
        }
    }
}
