//! The gRPC codec of both services: prost, with smaller initial buffers,
//! and DATA payloads that never pin a decode buffer much larger than
//! themselves.
//!
//! tonic's default buffers are 8 KiB for encoding and 8 KiB for decoding per
//! stream, allocated when the stream starts and kept while it lives. A
//! Konnectivity stream carries one connection, and most connections of a
//! busy cluster are idle (watches, `kubectl logs -f`), so those 16 KiB were
//! most of the server's memory per idle connection. Buffers grow as needed
//! for large DATA packets, so throughput is unaffected.
//!
//! prost decodes a `bytes` field as a slice of tonic's decode buffer
//! (`BytesMut::copy_to_bytes` is `split_to().freeze()`), so a DATA payload
//! shares the allocation its message was read into. A 1-byte payload sent
//! with a 4 MiB unknown field keeps all 4 MiB alive while it waits in a
//! queue that counts it as 1 byte; and tonic reuses a buffer it holds
//! alone, so even an unpadded payload may land in a buffer an earlier,
//! larger message sized. [`PacketDecoder`] therefore copies a DATA payload
//! into an allocation of its own size ([`OwnPayload`]) unless it is large
//! ([`COPY_BELOW`]), is nearly all of its message ([`FRAMING_SLACK`]), and
//! is at least half of the largest message the stream has carried (so the
//! buffer it sits in is at most a few times its size). Small payloads cost
//! a copy of a few KiB; bulk chunks of a steady size stay in place.

use std::marker::PhantomData;

use bytes::Bytes;
use tonic::{
    Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder},
};
use tonic_prost::ProstEncoder;

use crate::{Packet, Payload};

/// Initial encode/decode buffer of a stream.
pub const BUFFER_SIZE: usize = 1024;
/// Bytes encoded before they are handed to HTTP/2 (tonic's default).
pub const YIELD_THRESHOLD: usize = 32 * 1024;
/// A DATA payload shorter than this is copied out of the decode buffer:
/// kube-apiserver's writes (up to 32 KiB) and ANP agents' reads (4 KiB)
/// are, so no payload under it pins a buffer, whatever its message held.
pub const COPY_BELOW: usize = 64 * 1024;
/// What a DATA message may hold besides its payload and still leave the
/// payload in place: its framing (packet type, connection id, field tags
/// and lengths: under 40 bytes) with room to spare. More (unknown fields,
/// an error text) and the payload is copied.
pub const FRAMING_SLACK: usize = 64;

/// prost codec with [`BUFFER_SIZE`] buffers and [`PacketDecoder`]; used by
/// the generated services.
#[derive(Debug, Clone, Copy)]
pub struct PacketCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for PacketCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}

impl<T, U> Codec for PacketCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + OwnPayload + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = PacketDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        PacketDecoder {
            largest: 0,
            _message: PhantomData,
        }
    }
}

/// A message whose byte fields may be slices of the decode buffer.
pub trait OwnPayload {
    /// Copies the payload out of the decode buffer unless it may stay
    /// (see the module documentation): `wire` is the message's length,
    /// `largest` the longest message of its stream so far (this one
    /// included). Whether it stayed in place.
    fn own_payload(&mut self, wire: usize, largest: usize) -> bool;
}

impl OwnPayload for Packet {
    fn own_payload(&mut self, wire: usize, largest: usize) -> bool {
        let Some(Payload::Data(data)) = &mut self.payload else {
            return false;
        };
        let len = data.data.len();
        if stays(len, wire, largest) {
            return true;
        }
        if len > 0 {
            data.data = Bytes::copy_from_slice(&data.data);
        }
        false
    }
}

/// Whether a payload of `len` bytes from a message of `wire` bytes, on a
/// stream whose longest message was `largest`, stays in the decode buffer.
pub fn stays(len: usize, wire: usize, largest: usize) -> bool {
    len >= COPY_BELOW && wire <= len + FRAMING_SLACK && 2 * len >= largest
}

/// One stream's decoder: prost, then [`OwnPayload`].
#[derive(Debug)]
pub struct PacketDecoder<U> {
    /// The longest message the stream has carried: tonic's buffer may be
    /// up to twice as large, and a payload left in place may pin it.
    largest: usize,
    /// What it decodes.
    _message: PhantomData<fn() -> U>,
}

impl<U> Decoder for PacketDecoder<U>
where
    U: prost::Message + Default + OwnPayload,
{
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let wire = bytes::Buf::remaining(buf);
        self.largest = self.largest.max(wire);
        let mut message = U::decode(buf).map_err(|e| Status::internal(e.to_string()))?;
        message.own_payload(wire, self.largest);
        Ok(Some(message))
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

#[cfg(test)]
mod tests {
    use std::{
        future::Future,
        pin::pin,
        task::{Context, Poll, Waker},
    };

    use std::convert::Infallible;

    use bytes::BufMut;
    use http_body::Frame;
    use http_body_util::StreamBody;
    use prost::Message;
    use tonic::Streaming;

    use super::*;

    /// 4 MiB less a little, so that the message stays within tonic's limit.
    const PADDING: usize = 4 * 1024 * 1024 - 256;
    /// HTTP/2 DATA frame size of the test bodies (h2's default).
    const FRAME: usize = 16 * 1024;
    /// A field number no Konnectivity message has.
    const UNKNOWN_FIELD: u32 = 15;

    /// `packet`'s wire form with a `PADDING`-byte unknown field inside its
    /// DATA message, after the payload.
    fn padded(packet: &Packet) -> Vec<u8> {
        let Some(Payload::Data(data)) = &packet.payload else {
            panic!("not DATA");
        };
        let mut inner = data.encode_to_vec();
        prost::encoding::bytes::encode(UNKNOWN_FIELD, &vec![7u8; PADDING], &mut inner);
        let mut wire = Vec::new();
        prost::encoding::int32::encode(1, &packet.r#type, &mut wire);
        // Packet.data is field 4.
        prost::encoding::encode_key(4, prost::encoding::WireType::LengthDelimited, &mut wire);
        prost::encoding::encode_varint(inner.len() as u64, &mut wire);
        wire.extend_from_slice(&inner);
        wire
    }

    /// `messages` as a gRPC request body (length-prefixed) in frames of
    /// 16 KiB, as h2 hands a peer's DATA frames to tonic.
    fn body(
        messages: &[Vec<u8>],
    ) -> impl http_body::Body<Data = Bytes, Error = Infallible> + use<> {
        let mut body = bytes::BytesMut::new();
        for message in messages {
            body.put_u8(0);
            body.put_u32(u32::try_from(message.len()).unwrap());
            body.put_slice(message);
        }
        let body = body.freeze();
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = (0..body.len())
            .step_by(FRAME)
            .map(|at| Ok(Frame::data(body.slice(at..body.len().min(at + FRAME)))))
            .collect();
        StreamBody::new(tokio_stream::iter(frames))
    }

    /// Polls a future whose input is all in memory to its end (a stream
    /// may yield between frames, but never waits).
    fn ready<F: Future>(future: F) -> F::Output {
        let mut cx = Context::from_waker(Waker::noop());
        let mut future = pin!(future);
        for _ in 0..10_000 {
            if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
                return output;
            }
        }
        panic!("an in-memory body made the decoder wait");
    }

    /// The DATA payloads `decoder` makes of `messages`.
    fn payloads<D>(decoder: D, messages: &[Vec<u8>]) -> Vec<Bytes>
    where
        D: Decoder<Item = Packet, Error = Status> + Send + 'static,
    {
        let mut stream =
            Streaming::<Packet>::new_request(decoder, body(messages), None, Some(8 << 20));
        let mut out = Vec::new();
        while let Some(packet) = ready(stream.message()).unwrap() {
            match packet.payload {
                Some(Payload::Data(data)) => out.push(data.data),
                other => panic!("not DATA: {other:?}"),
            }
        }
        out
    }

    /// The bytes a payload keeps alive: its allocation from where it
    /// starts (it must be the only handle on it).
    fn pinned(payload: Bytes) -> usize {
        payload
            .try_into_mut()
            .expect("the only handle on its buffer")
            .capacity()
    }

    /// A 256 KiB chunk, a padded 1-byte DATA, the chunk again.
    fn chunk_padding_chunk() -> [Vec<u8>; 3] {
        let chunk = || Packet::data(3, Bytes::from(vec![2u8; CHUNK]));
        [
            chunk().encode_to_vec(),
            padded(&Packet::data(3, Bytes::from_static(b"y"))),
            chunk().encode_to_vec(),
        ]
    }

    /// A bulk chunk of the size our agent sends.
    const CHUNK: usize = 256 * 1024;

    /// Pins down the question of issue 43: with prost's own decoder, a
    /// DATA payload is a slice of tonic's decode buffer, and a 1-byte
    /// payload keeps its whole padded message alive (over 4 MiB for 1
    /// byte).
    #[test]
    fn prost_leaves_a_payload_in_the_decode_buffer_with_its_padding() {
        let message = padded(&Packet::data(3, Bytes::from_static(b"x")));
        let prost = tonic_prost::ProstCodec::<Packet, Packet>::default().decoder();
        let mut got = payloads(prost, &[message]);
        let payload = got.pop().unwrap();
        assert_eq!(payload, Bytes::from_static(b"x"));
        assert!(pinned(payload) >= PADDING, "prost copied the payload");
    }

    /// A decoder that copies small and padded payloads but keeps every
    /// other large one in place.
    struct WithoutLargestRule;

    impl Decoder for WithoutLargestRule {
        type Item = Packet;
        type Error = Status;

        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Packet>, Status> {
            let wire = bytes::Buf::remaining(buf);
            let mut packet = Packet::decode(buf).map_err(|e| Status::internal(e.to_string()))?;
            packet.own_payload(wire, 0);
            Ok(Some(packet))
        }
    }

    /// Why a payload is copied after a much larger message: once the
    /// padded message's 1 byte is copied out, tonic holds its 4 MiB buffer
    /// alone and reuses it for the next message, so a 256 KiB chunk left
    /// in place would keep 4 MiB alive.
    #[test]
    fn without_the_largest_rule_a_chunk_reuses_a_padded_messages_buffer() {
        let mut got = payloads(WithoutLargestRule, &chunk_padding_chunk());
        let third = got.pop().unwrap();
        drop(got);
        assert!(
            pinned(third) >= PADDING,
            "the chunk got a buffer of its own"
        );
    }

    /// Ours copies it: 1 byte pins 1 byte. The same for a padded payload
    /// above the copy threshold.
    #[test]
    fn a_small_or_padded_payload_owns_exactly_its_bytes() {
        let small = Packet::data(3, Bytes::from_static(b"x"));
        let large = Packet::data(3, Bytes::from(vec![1u8; COPY_BELOW]));
        let decoder = PacketCodec::<Packet, Packet>::default().decoder();
        let got = payloads(decoder, &[padded(&small), padded(&large)]);
        let sizes: Vec<usize> = got.into_iter().map(pinned).collect();
        assert_eq!(sizes, [1, COPY_BELOW]);
    }

    /// A large unpadded payload stays in place (pinning about its own size:
    /// its message and a frame), but not after a much larger message,
    /// whose buffer tonic may reuse for it.
    #[test]
    fn a_large_payload_stays_unless_the_stream_carried_a_much_larger_message() {
        let decoder = PacketCodec::<Packet, Packet>::default().decoder();
        let mut got = payloads(decoder, &chunk_padding_chunk()).into_iter();
        let first = got.next().unwrap();
        assert_eq!(got.next().unwrap(), Bytes::from_static(b"y"));
        let third = got.next().unwrap();
        let first = pinned(first);
        assert!(
            (CHUNK..CHUNK + 2 * FRAME).contains(&first),
            "the first chunk pins {first} bytes"
        );
        assert_eq!(pinned(third), CHUNK, "after 4 MiB, a chunk is copied");
    }

    #[test]
    fn the_rule_keeps_steady_bulk_chunks_in_place() {
        let chunk = 256 * 1024;
        let wire = chunk + 12;
        assert!(stays(chunk, wire, wire));
        assert!(!stays(COPY_BELOW - 1, COPY_BELOW + 8, COPY_BELOW + 8));
        assert!(!stays(chunk, wire + FRAMING_SLACK, wire + FRAMING_SLACK));
        assert!(!stays(chunk, wire, 4 * chunk));
    }
}
