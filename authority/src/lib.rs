//! Lets any `:authority` through to h2 on the Unix-socket gRPC frontend.
//!
//! kube-apiserver dials the socket with its *path* as the gRPC target, so
//! grpc-go sends `:authority: %2Fetc%2Fkubernetes%2F…%2Fkonnectivity-server.socket`
//! (other stacks send the raw path). h2 refuses both as malformed
//! (hyperium/h2#442) and resets every stream, before tonic sees the request.
//! On a Unix socket the authority means nothing, so [`AnyAuthority`] sits
//! between the socket and h2 and drops an `:authority` that h2 would refuse.
//!
//! Only the client's header blocks change; every other frame, and every byte
//! the server writes, passes as it is. Frame payloads other than HEADERS and
//! CONTINUATION are not copied: they are read straight into h2's buffer and
//! only their 9-byte frame headers are looked at. Header blocks are decoded
//! with the client's compression context (`hpack::Decoder`) and handed on
//! with literal fields only, so h2's own decoding context stays empty and the
//! two never disagree. A block that cannot be decoded, or a frame sequence h2
//! would refuse, is passed on as it came and the shim steps aside: h2 then
//! answers the fault itself (GOAWAY) exactly as without the shim.

/// The test build counts each thread's heap, so that the replay of the fuzz
/// corpora checks each target's heap bound (`fuzz/replay.rs`).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: heap_count::Counting<std::alloc::System> =
    heap_count::Counting::new(std::alloc::System);

#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod hpack;

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use tracing::debug;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE_LEN: usize = 24;
/// Frame header length.
const FRAME_HEADER_LEN: usize = 9;
/// HEADERS frame type.
const HEADERS: u8 = 0x1;
/// PUSH_PROMISE frame type (never valid from a client).
const PUSH_PROMISE: u8 = 0x5;
/// CONTINUATION frame type.
const CONTINUATION: u8 = 0x9;
/// END_STREAM flag.
const END_STREAM: u8 = 0x1;
/// END_HEADERS flag.
const END_HEADERS: u8 = 0x4;
/// PADDED flag.
const PADDED: u8 = 0x8;
/// PRIORITY flag (HEADERS).
const PRIORITY: u8 = 0x20;
/// Largest frame payload written: the HTTP/2 minimum, valid for any peer.
const OUT_FRAME_LEN: usize = 16 * 1024;
/// The dynamic table size h2 lets clients use: tonic sets no
/// `SETTINGS_HEADER_TABLE_SIZE`, so the protocol default applies.
const CLIENT_TABLE_SIZE: usize = 4096;
/// The largest compressed header block collected. h2 itself accepts 16 KiB
/// of decoded headers (hyper's default); a larger block is passed on whole
/// for h2 to judge.
const MAX_BLOCK: usize = 64 * 1024;
/// The largest decoded header list rewritten (same reasoning).
const MAX_LIST: usize = 64 * 1024;
/// How much is read at once when bytes must be looked at before h2 gets them.
const READ_CHUNK: usize = 16 * 1024;

/// A server-side connection whose client header blocks lose an
/// `:authority` h2 would refuse. See the module documentation.
pub struct AnyAuthority<IO> {
    /// The client connection.
    io: IO,
    /// Bytes read but not yet classified; they start at a frame boundary
    /// once `passthrough` is zero.
    inbox: BytesMut,
    /// Bytes ready for h2.
    outbox: BytesMut,
    /// Bytes of the preface or of the current frame's payload still to pass
    /// unchanged.
    passthrough: usize,
    /// A header block whose CONTINUATION frames are still to come.
    block: Option<Block>,
    /// The client's compression context.
    decoder: hpack::Decoder,
    /// Set after a fault h2 must see unchanged: everything passes as read.
    transparent: bool,
}

/// A header block being collected.
struct Block {
    /// Its stream.
    stream_id: u32,
    /// END_STREAM of the HEADERS frame.
    end_stream: bool,
    /// The priority fields of the HEADERS frame, if flagged.
    priority: Option<[u8; 5]>,
    /// The block fragments, concatenated.
    fragments: BytesMut,
    /// The frames as received, for handing on unchanged after a fault.
    raw: BytesMut,
}

/// A frame header.
#[derive(Clone, Copy)]
struct FrameHead {
    /// Payload length.
    len: usize,
    /// Frame type.
    kind: u8,
    /// Flags.
    flags: u8,
    /// Stream identifier (reserved bit cleared).
    stream_id: u32,
}

impl FrameHead {
    /// Parses the first [`FRAME_HEADER_LEN`] bytes of `b`.
    fn parse(b: &[u8]) -> Self {
        Self {
            len: usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]),
            kind: b[3],
            flags: b[4],
            stream_id: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        }
    }

    /// Whether the frame carries a header block this shim must read.
    fn carries_headers(self) -> bool {
        matches!(self.kind, HEADERS | CONTINUATION | PUSH_PROMISE)
    }
}

impl<IO> AnyAuthority<IO> {
    /// Wraps a freshly accepted client connection.
    pub fn new(io: IO) -> Self {
        Self {
            io,
            inbox: BytesMut::new(),
            outbox: BytesMut::new(),
            passthrough: PREFACE_LEN,
            block: None,
            decoder: hpack::Decoder::new(CLIENT_TABLE_SIZE),
            transparent: false,
        }
    }

    /// Looks at bytes just read into h2's buffer; returns where the first
    /// byte that must be held back is (a header-carrying frame, or a frame
    /// header cut short), if any.
    fn scan(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut pos = 0;
        loop {
            let skip = self.passthrough.min(bytes.len() - pos);
            pos += skip;
            self.passthrough -= skip;
            if pos == bytes.len() {
                return None;
            }
            if bytes.len() - pos < FRAME_HEADER_LEN {
                return Some(pos);
            }
            let head = FrameHead::parse(&bytes[pos..]);
            if head.carries_headers() {
                return Some(pos);
            }
            pos += FRAME_HEADER_LEN;
            self.passthrough = head.len;
        }
    }

    /// Moves what can be classified from `inbox` to `outbox`, rewriting
    /// complete header blocks.
    fn classify(&mut self) {
        loop {
            if self.transparent {
                let all = self.inbox.split();
                self.outbox.unsplit(all);
                return;
            }
            if self.passthrough > 0 {
                let n = self.passthrough.min(self.inbox.len());
                if n == 0 {
                    return;
                }
                let bytes = self.inbox.split_to(n);
                self.outbox.unsplit(bytes);
                self.passthrough -= n;
                continue;
            }
            if self.inbox.len() < FRAME_HEADER_LEN {
                return;
            }
            let head = FrameHead::parse(&self.inbox);
            if !head.carries_headers() {
                if self.block.is_some() {
                    // A frame inside a header block: h2 answers it.
                    self.step_aside("frame interleaved in a header block");
                    continue;
                }
                let bytes = self.inbox.split_to(FRAME_HEADER_LEN);
                self.outbox.unsplit(bytes);
                self.passthrough = head.len;
                continue;
            }
            if head.len > MAX_BLOCK {
                self.step_aside("header frame larger than the shim collects");
                continue;
            }
            if self.inbox.len() < FRAME_HEADER_LEN + head.len {
                return;
            }
            let frame = self.inbox.split_to(FRAME_HEADER_LEN + head.len);
            self.header_frame(head, frame);
        }
    }

    /// Takes one HEADERS, CONTINUATION or PUSH_PROMISE frame.
    fn header_frame(&mut self, head: FrameHead, frame: BytesMut) {
        let payload = &frame[FRAME_HEADER_LEN..];
        match (head.kind, self.block.as_mut()) {
            (HEADERS, None) => {
                let Some((priority, fragment)) = headers_payload(head.flags, payload) else {
                    return self.hand_on_raw(frame, "malformed HEADERS frame");
                };
                let mut block = Block {
                    stream_id: head.stream_id,
                    end_stream: head.flags & END_STREAM != 0,
                    priority,
                    fragments: BytesMut::from(fragment),
                    raw: BytesMut::new(),
                };
                block.raw.unsplit(frame);
                self.block = Some(block);
            }
            (CONTINUATION, Some(block)) if block.stream_id == head.stream_id => {
                if block.raw.len() + frame.len() > MAX_BLOCK {
                    return self.hand_on_raw(frame, "header block larger than the shim collects");
                }
                block.fragments.extend_from_slice(payload);
                block.raw.unsplit(frame);
            }
            _ => return self.hand_on_raw(frame, "unexpected header frame"),
        }
        if head.flags & END_HEADERS != 0 {
            self.finish_block();
        }
    }

    /// Decodes the collected block and queues it rewritten.
    fn finish_block(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        let mut fields = match self.decoder.decode(&block.fragments, MAX_LIST) {
            Ok(fields) => fields,
            Err(error) => {
                debug!(%error, "cannot decode a frontend header block; passing it on for h2 to answer");
                self.block = Some(block);
                return self.step_aside("undecodable header block");
            }
        };
        fields.retain(|field| {
            let keep = field.name != ":authority"
                || http::uri::Authority::try_from(&field.value[..]).is_ok();
            if !keep {
                debug!(authority = ?field.value, "dropping an :authority h2 would refuse (a socket path)");
            }
            keep
        });
        let mut encoded = BytesMut::new();
        hpack::encode_literal(&fields, &mut encoded);
        write_header_frames(&block, encoded, &mut self.outbox);
    }

    /// Queues `frame` (and any block being collected) unchanged, then
    /// passes everything on as read.
    fn hand_on_raw(&mut self, frame: BytesMut, why: &'static str) {
        self.step_aside(why);
        self.outbox.unsplit(frame);
    }

    /// Queues a block being collected unchanged and stops looking at frames.
    fn step_aside(&mut self, why: &'static str) {
        debug!(
            reason = why,
            "frontend connection passed to h2 unchanged from here on"
        );
        if let Some(block) = self.block.take() {
            self.outbox.unsplit(block.raw);
        }
        self.transparent = true;
    }
}

/// Splits a HEADERS payload into its priority fields and block fragment;
/// `None` if its padding does not fit.
fn headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut rest = payload;
    let pad = if flags & PADDED != 0 {
        let (&pad, tail) = rest.split_first()?;
        rest = tail;
        usize::from(pad)
    } else {
        0
    };
    let priority = if flags & PRIORITY != 0 {
        let fields: [u8; 5] = rest.get(..5)?.try_into().ok()?;
        rest = &rest[5..];
        Some(fields)
    } else {
        None
    };
    let end = rest.len().checked_sub(pad)?;
    Some((priority, &rest[..end]))
}

/// Writes `encoded` as a HEADERS frame and as many CONTINUATION frames as
/// it needs, with the flags and priority of the original.
fn write_header_frames(block: &Block, mut encoded: BytesMut, out: &mut BytesMut) {
    let mut first = true;
    loop {
        let room = if first && block.priority.is_some() {
            OUT_FRAME_LEN - 5
        } else {
            OUT_FRAME_LEN
        };
        let chunk = encoded.split_to(encoded.len().min(room));
        let last = encoded.is_empty();
        let mut flags = if last { END_HEADERS } else { 0 };
        let (kind, priority) = if first {
            if block.end_stream {
                flags |= END_STREAM;
            }
            if block.priority.is_some() {
                flags |= PRIORITY;
            }
            (HEADERS, block.priority)
        } else {
            (CONTINUATION, None)
        };
        let len = chunk.len() + priority.map_or(0, |p| p.len());
        out.reserve(FRAME_HEADER_LEN + len);
        out.put_uint(len as u64, 3);
        out.put_u8(kind);
        out.put_u8(flags);
        out.put_u32(block.stream_id);
        if let Some(priority) = priority {
            out.put_slice(&priority);
        }
        out.put_slice(&chunk);
        if last {
            return;
        }
        first = false;
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AnyAuthority<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.outbox.is_empty() {
                let n = this.outbox.len().min(buf.remaining());
                buf.put_slice(&this.outbox[..n]);
                this.outbox.advance(n);
                return Poll::Ready(Ok(()));
            }
            if !this.inbox.is_empty() || this.block.is_some() {
                this.classify();
                if !this.outbox.is_empty() {
                    continue;
                }
                // A frame is incomplete: read more of it.
                this.inbox.reserve(READ_CHUNK);
                let n = ready!(tokio_util::io::poll_read_buf(
                    Pin::new(&mut this.io),
                    cx,
                    &mut this.inbox
                ))?;
                if n == 0 {
                    // The client left mid-frame: h2 gets what there is and
                    // sees the connection end inside a frame.
                    this.step_aside("connection ended inside a frame");
                    let rest = this.inbox.split();
                    this.outbox.unsplit(rest);
                    if this.outbox.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                }
                continue;
            }
            // The fast path: read into h2's buffer, hold back only what
            // must be looked at.
            let start = buf.filled().len();
            ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
            let end = buf.filled().len();
            if end == start || this.transparent {
                return Poll::Ready(Ok(()));
            }
            if let Some(cut) = this.scan(&buf.filled()[start..end]) {
                this.inbox
                    .extend_from_slice(&buf.filled()[start + cut..end]);
                buf.set_filled(start + cut);
            }
            if buf.filled().len() > start {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

edge::forward_write!([IO: AsyncWrite + Unpin] AnyAuthority<IO>, io);

impl<IO: Connected> Connected for AnyAuthority<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use tokio::io::AsyncReadExt;

    use super::{hpack::Field, *};

    /// Yields its bytes at most `chunk` at a time.
    struct Trickle {
        /// What is left.
        data: Bytes,
        /// Largest read.
        chunk: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            let n = this.chunk.min(this.data.len()).min(buf.remaining());
            buf.put_slice(&this.data.split_to(n));
            Poll::Ready(Ok(()))
        }
    }

    /// Everything `input` becomes through the shim, read `chunk` bytes at a
    /// time from the client and into buffers of `out` bytes.
    async fn through(input: &[u8], chunk: usize, out: usize) -> Vec<u8> {
        let mut shim = AnyAuthority::new(Trickle {
            data: Bytes::copy_from_slice(input),
            chunk,
        });
        let mut result = Vec::new();
        let mut buf = vec![0u8; out];
        loop {
            let n = shim.read(&mut buf).await.unwrap();
            if n == 0 {
                return result;
            }
            result.extend_from_slice(&buf[..n]);
        }
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        out.put_uint(payload.len() as u64, 3);
        out.put_u8(kind);
        out.put_u8(flags);
        out.put_u32(stream);
        out.put_slice(payload);
        out.to_vec()
    }

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const DATA: u8 = 0x0;
    const SETTINGS: u8 = 0x4;

    /// The frames of `bytes` after the preface: (type, flags, stream, payload).
    fn frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert_eq!(&bytes[..PREFACE_LEN], PREFACE);
        let mut rest = &bytes[PREFACE_LEN..];
        let mut out = Vec::new();
        while !rest.is_empty() {
            let head = FrameHead::parse(rest);
            out.push((
                head.kind,
                head.flags,
                head.stream_id,
                rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + head.len].to_vec(),
            ));
            rest = &rest[FRAME_HEADER_LEN + head.len..];
        }
        out
    }

    /// A request block as grpc-go encodes it: static indexes, and
    /// `:authority` as a Huffman literal added to the table (first request)
    /// or indexed from it (later ones).
    fn grpc_go_block(first: bool, authority: &[u8]) -> Vec<u8> {
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
        if first {
            block.extend([0x44, 19]); // :path, literal with indexing
            block.extend(b"/ProxyService/Proxy");
            block.push(0x41); // :authority, literal with indexing
            let mut value = BytesMut::new();
            hpack_huffman_string(authority, &mut value);
            block.extend_from_slice(&value);
            block.extend([0x5f, 16]); // content-type, literal with indexing
            block.extend(b"application/grpc");
        } else {
            block.extend([0x04, 19]); // :path, literal without indexing
            block.extend(b"/ProxyService/Proxy");
            // :authority (63) and content-type (62) from the dynamic table.
            block.extend([0xbf, 0xbe]);
        }
        block
    }

    /// A Huffman string literal (the shim never writes one; clients do).
    fn hpack_huffman_string(s: &[u8], out: &mut BytesMut) {
        // The RFC 7541 C.4.1 vector is the only Huffman text needed beyond
        // the decoder's own tests; other values go raw.
        if s == b"www.example.com" {
            out.put_u8(0x8c);
            out.put_slice(&[
                0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
            ]);
        } else {
            out.put_u8(s.len() as u8);
            out.put_slice(s);
        }
    }

    fn fields_of(decoder: &mut hpack::Decoder, payload: &[u8]) -> Vec<(String, String)> {
        decoder
            .decode(payload, MAX_LIST)
            .unwrap()
            .into_iter()
            .map(|Field { name, value, .. }| {
                (
                    String::from_utf8(name.to_vec()).unwrap(),
                    String::from_utf8(value.to_vec()).unwrap(),
                )
            })
            .collect()
    }

    /// A client that opens two streams with `authority` and sends data on each.
    fn client_bytes(authority: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut input = PREFACE.to_vec();
        input.extend(frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]));
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &grpc_go_block(true, authority),
        ));
        for part in data.chunks(16_384) {
            input.extend(frame(DATA, 0, 1, part));
        }
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            3,
            &grpc_go_block(false, authority),
        ));
        input.extend(frame(DATA, END_STREAM, 3, &data[..1000]));
        (input, data)
    }

    #[tokio::test]
    async fn a_socket_path_authority_is_dropped_and_every_other_byte_kept() {
        let path = b"%2Ftmp%2Fx%2Fs.sock";
        let (input, data) = client_bytes(path);
        for (chunk, out) in [
            (1, 7),
            (5, 64 * 1024),
            (9, 9),
            (100, 3),
            (16_393, 16_384),
            (1 << 20, 1 << 20),
        ] {
            let output = through(&input, chunk, out).await;
            let frames = frames(&output);
            let kinds: Vec<u8> = frames.iter().map(|f| f.0).collect();
            assert_eq!(
                kinds,
                [SETTINGS, HEADERS, DATA, DATA, DATA, HEADERS, DATA],
                "chunk {chunk}"
            );
            let mut decoder = hpack::Decoder::new(CLIENT_TABLE_SIZE);
            let expected = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/ProxyService/Proxy"),
                ("content-type", "application/grpc"),
            ]
            .map(|(n, v)| (n.to_owned(), v.to_owned()));
            assert_eq!(fields_of(&mut decoder, &frames[1].3), expected);
            assert_eq!(fields_of(&mut decoder, &frames[5].3), expected);
            assert_eq!(frames[1].1, END_HEADERS);
            assert_eq!((frames[5].1, frames[5].2), (END_HEADERS, 3));
            let carried: Vec<u8> = frames[2..5].iter().flat_map(|f| f.3.clone()).collect();
            assert_eq!(carried, data);
            assert_eq!(frames[6], (DATA, END_STREAM, 3, data[..1000].to_vec()));
        }
    }

    #[tokio::test]
    async fn a_valid_authority_is_kept() {
        let (input, _) = client_bytes(b"www.example.com");
        let frames = frames(&through(&input, 1 << 20, 1 << 20).await);
        let mut decoder = hpack::Decoder::new(CLIENT_TABLE_SIZE);
        for headers in [&frames[1], &frames[5]] {
            let fields = fields_of(&mut decoder, &headers.3);
            assert_eq!(
                fields[3],
                (":authority".to_owned(), "www.example.com".to_owned())
            );
        }
    }

    #[tokio::test]
    async fn continuation_padding_and_priority_are_undone_and_long_blocks_split() {
        let mut block = grpc_go_block(true, b"/var/run/x.sock");
        block.extend([0x40, 6]);
        block.extend(b"x-long");
        block.extend([0x7f, 0x81, 0x9c, 0x01]); // 127 + 0x1c01 + ... = 20_000 bytes, raw
        let long_len = 127 + 0x01 + (0x1c << 7) + (0x01 << 14);
        block.extend(std::iter::repeat_n(b'z', long_len));
        // HEADERS (padded, with priority) + two CONTINUATION frames.
        let (a, rest) = block.split_at(10);
        let (b, c) = rest.split_at(rest.len() / 2);
        let mut payload = vec![3u8]; // pad length
        payload.extend([0, 0, 0, 0, 15]); // priority: stream 0, weight 15
        payload.extend(a);
        payload.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 1, &payload));
        input.extend(frame(CONTINUATION, 0, 1, b));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, c));
        let frames = frames(&through(&input, 1000, 4096).await);
        assert_eq!(frames[0].0, HEADERS);
        assert_eq!(frames[0].1, PRIORITY | END_STREAM);
        assert_eq!(&frames[0].3[..5], &[0, 0, 0, 0, 15]);
        assert!(frames[1..].iter().all(|f| f.0 == CONTINUATION && f.2 == 1));
        assert_eq!(frames.last().unwrap().1, END_HEADERS);
        assert!(frames.iter().all(|f| f.3.len() <= OUT_FRAME_LEN));
        let mut block = frames[0].3[5..].to_vec();
        for f in &frames[1..] {
            block.extend(&f.3);
        }
        let fields = fields_of(&mut hpack::Decoder::new(CLIENT_TABLE_SIZE), &block);
        assert!(fields.iter().all(|(n, _)| n != ":authority"));
        assert_eq!(fields.last().unwrap().1.len(), long_len);
    }

    fn run<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Any bytes after the preface, read in any pieces: no panic, and
        /// what comes out is bounded (a rewritten block is at most the
        /// decoded-list limit).
        #[test]
        fn any_bytes_pass_without_panic(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
            chunk in 1usize..2048,
            out in 1usize..4096,
        ) {
            let input = [PREFACE, &body[..]].concat();
            let output = run(through(&input, chunk, out));
            let blocks = body.len() / FRAME_HEADER_LEN + 1;
            proptest::prop_assert!(output.len() <= input.len() + blocks * (MAX_LIST + 1024));
        }

        /// Frames that carry no header block pass byte for byte, however
        /// they are cut.
        #[test]
        fn frames_without_header_blocks_pass_unchanged(
            frames in proptest::collection::vec(
                (
                    proptest::sample::select(vec![0u8, 2, 3, 4, 6, 7, 8, 0x20]),
                    proptest::prelude::any::<u8>(),
                    0u32..16,
                    proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
                ),
                0..20,
            ),
            chunk in 1usize..700,
            out in 1usize..700,
        ) {
            let mut input = PREFACE.to_vec();
            for (kind, flags, stream, payload) in &frames {
                input.extend(frame(*kind, *flags, *stream, payload));
            }
            proptest::prop_assert_eq!(run(through(&input, chunk, out)), input);
        }
    }

    #[tokio::test]
    async fn faults_pass_to_h2_unchanged() {
        let bad_hpack = [PREFACE.to_vec(), frame(HEADERS, END_HEADERS, 1, &[0x3f])].concat();
        let interleaved = [
            PREFACE.to_vec(),
            frame(HEADERS, 0, 1, &grpc_go_block(true, b"/a")),
            frame(DATA, 0, 1, b"not a continuation"),
            frame(CONTINUATION, END_HEADERS, 1, &[]),
        ]
        .concat();
        let push = [
            PREFACE.to_vec(),
            frame(PUSH_PROMISE, END_HEADERS, 1, &[0, 0, 0, 2, 0x82]),
        ]
        .concat();
        let bad_padding = [
            PREFACE.to_vec(),
            frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x82]),
        ]
        .concat();
        let cut_short = [
            PREFACE.to_vec(),
            frame(HEADERS, END_HEADERS, 1, &[0x82, 0x86])[..10].to_vec(),
        ]
        .concat();
        let mut huge = PREFACE.to_vec();
        huge.extend(frame(HEADERS, END_HEADERS, 1, &vec![0x82; MAX_BLOCK + 1]));
        huge.extend(frame(DATA, 0, 1, b"after"));
        for (name, input) in [
            ("bad hpack", bad_hpack),
            ("interleaved", interleaved),
            ("push promise", push),
            ("bad padding", bad_padding),
            ("cut short", cut_short),
            ("huge", huge),
        ] {
            for chunk in [1, 13, 1 << 20] {
                assert_eq!(
                    through(&input, chunk, 8192).await,
                    input,
                    "{name}, chunk {chunk}"
                );
            }
        }
    }
}
