//! Fuzzing entry points (cargo-fuzz targets in `fuzz/`, and their corpora
//! replayed by the tests below). Not an API: compiled for tests and under
//! the `fuzzing` feature only, which no binary enables.

use bytes::BytesMut;

use crate::hpack::{Decoder, encode_literal};

/// The heap an [`hpack`] run may use at its peak for `len` bytes: the
/// dynamic table (at most its limit, 64 KiB here), the decoded lists (at
/// most their limit), their re-encodings and Huffman's output (8/5 of a
/// string).
pub fn hpack_alloc_bound(len: usize) -> usize {
    16 * len + 1024 * 1024
}

/// HPACK header blocks as a client sends them on the Unix-socket
/// frontend: the first byte picks the table limit we advertise and the
/// list limit, then each block is a length byte and that many bytes, all
/// decoded in order by one [`Decoder`] (one connection's context).
/// Checks, after every block: the table's bookkeeping holds
/// ([`Decoder::check`]); a malformed block is an error, never a panic; a
/// decoded list is within its limit; and re-encoded as we hand it to h2
/// ([`encode_literal`]) it decodes, with an empty table, to the same
/// fields.
pub fn hpack(data: &[u8]) {
    let (&choice, mut rest) = data.split_first().unwrap_or((&0, &[]));
    let limit = [0, 64, 256, 4096, 65_536][usize::from(choice % 5)];
    let max_list = [64, 1024, 16 * 1024, 64 * 1024][usize::from(choice / 5 % 4)];
    let mut decoder = Decoder::new(limit);
    while let Some((&len, tail)) = rest.split_first() {
        let (block, tail) = tail.split_at(usize::from(len).min(tail.len()));
        rest = tail;
        let decoded = decoder.decode(block, max_list);
        decoder.check();
        let Ok(fields) = decoded else {
            continue;
        };
        let size: usize = fields
            .iter()
            .map(|f| f.name.len() + f.value.len() + 32)
            .sum();
        assert!(size <= max_list, "a list of {size} bytes past {max_list}");
        let mut encoded = BytesMut::new();
        encode_literal(&fields, &mut encoded);
        let again = Decoder::new(4096)
            .decode(&encoded, usize::MAX)
            .expect("our own encoding decodes");
        assert_eq!(again, fields, "the fields handed on differ");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../../fuzz/replay.rs");

    replay!(fuzz_corpus_hpack => hpack within hpack_alloc_bound);
}
