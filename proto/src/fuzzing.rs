//! Fuzzing entry points (cargo-fuzz targets in `fuzz/`, and their corpora
//! replayed by the tests below). Not an API: compiled for tests and under
//! the `fuzzing` feature only, which no binary enables.
//!
//! Each function takes the bytes a peer controls and panics when an
//! invariant the code promises does not hold: a parse error must be an
//! error, never a panic, and what is decoded must stay within the input's
//! bound.

use std::{
    future::Future,
    pin::pin,
    task::{Context, Poll, Waker},
};

use bytes::Bytes;
use http_body_util::Full;
use prost::Message;
use tonic::{Code, Streaming, codec::Codec};

use crate::{Packet, Payload, codec::PacketCodec, packet::PacketKind};

/// tonic's default limit on a received message, which our servers and
/// clients keep: the decoder reserves up to this much for a message whose
/// header claims it, before its bytes arrive.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// The heap a [`grpc_packets`] run may use at its peak, for `len` input
/// bytes: the claimed message (up to [`MAX_MESSAGE`]), plus a few copies of
/// the input (the body, the decoded packets, their re-encodings).
pub fn grpc_packets_alloc_bound(len: usize) -> usize {
    MAX_MESSAGE + 8 * len + 64 * 1024
}

/// A gRPC request body (length-prefixed messages, as h2 hands it to
/// tonic) decoded by our codec into [`Packet`]s, as both services read
/// every frontend and agent stream. Checks: the stream ends with a
/// message, the end, or a `Status` (never a panic); no packet holds more
/// bytes than its message had; a DATA payload under the copy threshold
/// owns exactly its bytes; every packet is looked at as the receivers
/// do ([`Packet::into_kind`], [`Packet::type_name`]) and round-trips
/// through its wire form.
pub fn grpc_packets(data: &[u8]) {
    let body = Full::new(Bytes::copy_from_slice(data));
    let decoder = PacketCodec::<Packet, Packet>::default().decoder();
    let mut stream = Streaming::<Packet>::new_request(decoder, body, None, Some(MAX_MESSAGE));
    // Each message has a 5-byte header: at most this many can come out.
    let mut left = data.len() / 5 + 1;
    loop {
        let next = ready(stream.message());
        match next {
            Ok(Some(mut packet)) => {
                assert!(left > 0, "more packets than the input has message headers");
                left -= 1;
                check_owned(&mut packet);
                check_packet(packet, data.len());
            }
            Ok(None) => break,
            Err(status) => {
                assert_ne!(status.code(), Code::Ok, "an error with status OK");
                break;
            }
        }
    }
}

/// What a packet decoded from `input` bytes must be: no larger than they
/// were, re-encoded no longer, round-tripping, nameable; panics otherwise.
/// Also run by `packet.rs`'s property test.
pub(crate) fn check_packet(packet: Packet, input: usize) {
    let size = match &packet.payload {
        Some(Payload::Data(d)) => d.data.len() + d.error.len(),
        Some(Payload::DialRequest(r)) => r.address.len() + r.protocol.len(),
        Some(Payload::DialResponse(r)) => r.error.len(),
        Some(Payload::CloseResponse(r)) => r.error.len(),
        _ => 0,
    };
    assert!(
        size <= input,
        "{size} payload bytes from {input} input bytes"
    );
    // prost drops unknown fields and keeps the last of repeated ones, so
    // the re-encoding is never longer than the message it came from.
    let wire = packet.encode_to_vec();
    assert!(wire.len() <= input, "re-encoded {} > {input}", wire.len());
    let again = Packet::decode(wire.as_slice()).expect("a packet we encoded decodes");
    assert_eq!(again, packet, "a decoded packet does not round-trip");
    let _ = packet.type_name();
    let kind = packet.into_kind();
    // Its Debug never shows DATA bytes, and never fails.
    let _ = format!("{kind:?}");
    if let PacketKind::Unknown(t) = kind {
        assert!(crate::PacketType::try_from(t).is_err());
    }
}

/// A DATA payload under the copy threshold owns exactly its bytes: it
/// pins no part of the decode buffer ([`crate::codec::OwnPayload`]).
fn check_owned(packet: &mut Packet) {
    let Some(Payload::Data(data)) = &mut packet.payload else {
        return;
    };
    let len = data.data.len();
    if len == 0 || len >= crate::codec::COPY_BELOW {
        return;
    }
    let owned = std::mem::take(&mut data.data)
        .try_into_mut()
        .expect("a small payload shares the decode buffer");
    assert_eq!(
        owned.capacity(),
        len,
        "a small payload pins more than itself"
    );
    data.data = owned.freeze();
}

/// Polls a future that never waits (every byte is in memory) to its end.
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("an in-memory body made the decoder wait"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../../fuzz/replay.rs");

    replay!(fuzz_corpus_grpc_packets => grpc_packets within grpc_packets_alloc_bound);

    /// A message header claiming more than the limit is a `Status`.
    #[test]
    fn an_oversized_message_is_a_status() {
        let mut input = vec![0u8];
        input.extend_from_slice(&u32::MAX.to_be_bytes());
        grpc_packets(&input);
        let body = Full::new(Bytes::from(input));
        let decoder = PacketCodec::<Packet, Packet>::default().decoder();
        let mut stream = Streaming::<Packet>::new_request(decoder, body, None, Some(MAX_MESSAGE));
        let status = ready(stream.message()).unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange);
    }
}
