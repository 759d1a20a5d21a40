//! The gRPC codec of both services: prost, with smaller initial buffers.
//!
//! tonic's default buffers are 8 KiB for encoding and 8 KiB for decoding per
//! stream, allocated when the stream starts and kept while it lives. A
//! Konnectivity stream carries one connection, and most connections of a
//! busy cluster are idle (watches, `kubectl logs -f`), so those 16 KiB were
//! most of the server's memory per idle connection. Buffers grow as needed
//! for large DATA packets, so throughput is unaffected.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial encode/decode buffer of a stream.
pub const BUFFER_SIZE: usize = 1024;
/// Bytes encoded before they are handed to HTTP/2 (tonic's default).
pub const YIELD_THRESHOLD: usize = 32 * 1024;

/// prost codec with [`BUFFER_SIZE`] buffers; used by the generated services.
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
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(settings())
    }
}
