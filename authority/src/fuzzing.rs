//! Fuzzing entry points (cargo-fuzz targets in `fuzz/`, and their corpora
//! replayed by the tests below). Not an API: compiled for tests and under
//! the `fuzzing` feature only, which no binary enables.

use std::borrow::Cow;

use bytes::BytesMut;
use loona_hpack::decoder::{DecoderError, IntegerDecodingError};

use crate::hpack::{Decoder, Field, HpackError, encode_literal};

/// The heap an [`hpack`] run may use at its peak for `len` bytes: the
/// dynamic tables of both decoders (at most their limit, 64 KiB here), the
/// decoded lists (at most their limit), their re-encodings and Huffman's
/// output (8/5 of a string), and the reference's Huffman tables (built per
/// string).
pub fn hpack_alloc_bound(len: usize) -> usize {
    16 * len + 1024 * 1024
}

/// The longest block an input holds: its length is two bytes, masked.
const MAX_BLOCK: usize = 0x1fff;

/// HPACK header blocks as a client sends them on the Unix-socket
/// frontend: the first byte picks the table limit we advertise and the
/// list limit, then each block is a two-byte length (big-endian, up to
/// 8 KiB) and that many bytes, all decoded in order by one [`Decoder`]
/// (one connection's context).
///
/// Checks, after every block: the table's bookkeeping holds
/// ([`Decoder::check`]); a malformed block is an error, never a panic; a
/// decoded list is within its limit; re-encoded as we hand it to h2
/// ([`encode_literal`]) it decodes, with an empty table, to the same
/// fields, by our decoder and by the reference. And the blocks are decoded
/// by an independent decoder too (`loona-hpack`, the reference, given the
/// same table limit): until the first error of either (a connection error,
/// RFC 7541 §2.4: nothing is decoded after it), both decode each block to
/// the same list or both refuse it, but for the three differences the
/// RFC leaves to each decoder, each recognised by what it is
/// ([`explained`]). Returns how many blocks the two decoders were set
/// against each other (a test's proof that the input was read at all).
pub fn hpack(data: &[u8]) -> usize {
    let (&choice, mut rest) = data.split_first().unwrap_or((&0, &[]));
    let limit = [0, 64, 256, 4096, 65_536][usize::from(choice % 5)];
    let max_list = [64, 1024, 16 * 1024, 64 * 1024][usize::from(choice / 5 % 4)];
    let mut decoder = Decoder::new(limit);
    let mut reference = Some(Reference::new(limit));
    let mut compared = 0;
    while !rest.is_empty() {
        let (len, tail) = match rest {
            [hi, lo, tail @ ..] => (
                usize::from(u16::from_be_bytes([*hi, *lo])) & MAX_BLOCK,
                tail,
            ),
            [one] => (usize::from(*one), &[][..]),
            [] => break,
        };
        let (block, tail) = tail.split_at(len.min(tail.len()));
        rest = tail;
        let decoded = decoder.decode(block, max_list);
        decoder.check();
        if let Some(theirs) = reference.as_mut().map(|r| r.decode(block, max_list)) {
            compared += 1;
            assert!(
                agree(&decoded, &theirs, max_list),
                "our decoder and the reference disagree on block {block:02x?}:\n ours: {decoded:?}\n theirs: {theirs:?}"
            );
            if decoded.is_err() || theirs.is_err() {
                // A connection error: the two tables may differ from here.
                reference = None;
            }
        }
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
        let theirs = Reference::new(4096)
            .decode(&encoded, usize::MAX)
            .expect("the reference decodes what we hand on");
        assert!(
            same(&fields, &theirs.fields),
            "the reference reads what we hand on otherwise"
        );
    }
    compared
}

/// The reference decoder (`loona-hpack`), on a connection whose table may
/// grow to `limit` bytes, and what it decoded of a block.
struct Reference(loona_hpack::Decoder<'static>);

/// A block as the reference decoded it: the fields while the list was
/// within the caller's limit (the reference has none: it is counted here,
/// so that its list stays bounded), and the whole list's size.
#[derive(Debug)]
struct Listed {
    /// Names and values, up to the limit.
    fields: Vec<(Vec<u8>, Vec<u8>)>,
    /// Names, values and 32 bytes per field, of the whole list.
    size: usize,
}

impl Reference {
    fn new(limit: usize) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_table_size(limit);
        decoder.set_max_allowed_table_size(limit);
        Self(decoder)
    }

    fn decode(&mut self, block: &[u8], max_list: usize) -> Result<Listed, DecoderError> {
        let mut listed = Listed {
            fields: Vec::new(),
            size: 0,
        };
        self.0
            .decode_with_cb(block, |name: Cow<'_, [u8]>, value: Cow<'_, [u8]>| {
                listed.size = listed.size.saturating_add(name.len() + value.len() + 32);
                if listed.size <= max_list {
                    listed.fields.push((name.into_owned(), value.into_owned()));
                }
            })?;
        Ok(listed)
    }
}

/// Whether our list and the reference's have the same names and values in
/// the same order.
fn same(ours: &[Field], theirs: &[(Vec<u8>, Vec<u8>)]) -> bool {
    ours.len() == theirs.len()
        && ours
            .iter()
            .zip(theirs)
            .all(|(f, (name, value))| f.name == name.as_slice() && f.value == value.as_slice())
}

/// Whether our decoder's verdict on a block and the reference's agree:
/// the same list, both an error, or a difference [`explained`].
fn agree(
    ours: &Result<Vec<Field>, HpackError>,
    theirs: &Result<Listed, DecoderError>,
    max_list: usize,
) -> bool {
    match (ours, theirs) {
        (Ok(fields), Ok(listed)) => listed.size <= max_list && same(fields, &listed.fields),
        (Err(_), Err(_)) => true,
        _ => explained(ours, theirs, max_list),
    }
}

/// The differences between the two decoders that RFC 7541 allows, each
/// recognised by what it is, never by "both are odd":
/// - a list over the caller's limit is refused by ours (the reference
///   has no limit): the reference's list is over it too;
/// - a table size update after a header field is refused by ours (§4.2:
///   it must come first, as h2 requires) and taken by the reference;
/// - a block of table size updates only is taken by ours (an empty list)
///   and refused by the reference (`SizeUpdateAtEnd`);
/// - an integer with five continuation octets (and a value within 2^28)
///   is taken by ours and refused by the reference (which stops at four;
///   §5.1 leaves the limit to the decoder).
fn explained(
    ours: &Result<Vec<Field>, HpackError>,
    theirs: &Result<Listed, DecoderError>,
    max_list: usize,
) -> bool {
    match (ours, theirs) {
        (Err(HpackError::ListTooLarge(_)), Ok(listed)) => listed.size > max_list,
        (Err(HpackError::MisplacedSizeUpdate), Ok(_)) => true,
        (Ok(fields), Err(DecoderError::SizeUpdateAtEnd)) => fields.is_empty(),
        (Ok(_), Err(DecoderError::IntegerDecodingError(IntegerDecodingError::TooManyOctets))) => {
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../../fuzz/replay.rs");

    replay!(fuzz_corpus_hpack => hpack within hpack_alloc_bound reaching |set: &usize| *set > 0);

    /// One block of `hex`, after the choice byte 13 (a 4096-byte table, a
    /// 16 KiB list).
    fn input(blocks: &[&str]) -> Vec<u8> {
        let mut input = vec![13u8];
        for hex in blocks {
            let block: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            input.extend_from_slice(&u16::try_from(block.len()).unwrap().to_be_bytes());
            input.extend_from_slice(&block);
        }
        input
    }

    /// The differential sees both decoders' lists: RFC 7541 C.3 agrees, a
    /// block where the reference reads another field does not.
    #[test]
    fn the_reference_reads_what_ours_reads() {
        hpack(&input(&[
            "828684410f7777772e6578616d706c652e636f6d",
            "828684be58086e6f2d6361636865",
        ]));
        let mut reference = Reference::new(4096);
        let theirs = reference.decode(&[0x82, 0x86], 64 * 1024).unwrap();
        let ours = Decoder::new(4096).decode(&[0x82, 0x87], 64 * 1024);
        assert!(
            !agree(&ours, &Ok(theirs), 64 * 1024),
            ":scheme http vs https"
        );
    }

    /// The blocks grpc-go wrote on one connection (`fuzz/capture_hpack.py`):
    /// eight Proxy streams, the first with Huffman-coded literals that fill
    /// the dynamic table, the next seven indexing it; both decoders read
    /// each as the same request.
    #[test]
    fn grpc_go_blocks_decode_alike_and_as_sent() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/regressions/hpack/grpc-go-eight-tunnels-one-connection"
        );
        let input = std::fs::read(path).unwrap();
        assert_eq!(hpack(&input), 8, "every block set against the reference");
        let (mut ours, mut reference) = (Decoder::new(4096), Reference::new(4096));
        let mut rest = &input[1..];
        let mut lists = Vec::new();
        while let [hi, lo, tail @ ..] = rest {
            let (block, tail) = tail.split_at(usize::from(u16::from_be_bytes([*hi, *lo])));
            rest = tail;
            let fields = ours.decode(block, 64 * 1024).unwrap();
            let theirs = reference.decode(block, 64 * 1024).unwrap();
            assert!(same(&fields, &theirs.fields));
            lists.push(theirs.fields);
        }
        assert_eq!(lists.len(), 8);
        assert!(lists.iter().all(|l| *l == lists[0]), "eight alike requests");
        let has = |name: &str, value: &str| {
            lists[0]
                .iter()
                .any(|(n, v)| n == name.as_bytes() && v == value.as_bytes())
        };
        assert!(has(":method", "POST") && has(":path", "/ProxyService/Proxy"));
        assert!(has("content-type", "application/grpc") && has("te", "trailers"));
    }

    /// Each allowed difference is recognised, and only it.
    #[test]
    fn the_differences_the_rfc_allows_are_told_apart() {
        let max = 64 * 1024;
        let decode = |block: &[u8]| {
            (
                Decoder::new(4096).decode(block, max),
                Reference::new(4096).decode(block, max),
            )
        };
        // A size update after a field.
        let (ours, theirs) = decode(&[0x82, 0x3f, 0x01, 0x82]);
        assert_eq!(ours, Err(HpackError::MisplacedSizeUpdate));
        assert!(theirs.is_ok() && agree(&ours, &theirs, max));
        // A block of a size update only.
        let (ours, theirs) = decode(&[0x20]);
        assert_eq!(ours, Ok(Vec::new()));
        assert!(matches!(theirs, Err(DecoderError::SizeUpdateAtEnd)));
        assert!(agree(&ours, &theirs, max));
        // A name index in six continuation octets: refused by both; in
        // five, taken by ours only.
        let six = [0x0f, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 0x01, b'v'];
        let (ours, theirs) = decode(&six);
        assert!(ours.is_err() && theirs.is_err());
        let (ours, theirs) = decode(&[0x0f, 0x80, 0x80, 0x80, 0x80, 0x00, 0x01, b'v']);
        assert_eq!(ours.as_ref().map(Vec::len), Ok(1), "accept-charset: v");
        assert!(matches!(
            theirs,
            Err(DecoderError::IntegerDecodingError(
                IntegerDecodingError::TooManyOctets
            ))
        ));
        assert!(agree(&ours, &theirs, max));
        // A list over the limit: ours refuses it, the reference's is over it.
        let big = [0x82; 100];
        let ours = Decoder::new(4096).decode(&big, 1024);
        let theirs = Reference::new(4096).decode(&big, 1024);
        assert!(agree(&ours, &theirs, 1024));
        let small = Reference::new(4096).decode(&[0x82], 1024);
        assert!(
            !agree(&ours, &small, 1024),
            "a list within the limit is not"
        );
    }
}
