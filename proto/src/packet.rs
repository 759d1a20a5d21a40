//! Packet constructors and a matchable view over [`Packet`].
//!
//! Receivers dispatch on `Packet.type`, never on the oneof case, as ANP does:
//! a packet whose payload is missing or of another case reads as the zero
//! value of the payload its type names (so DATA without payload is connection
//! id 0, which every receiver drops).

use bytes::Bytes;

use crate::{
    CloseDial, CloseRequest, CloseResponse, Data, DialErrorClass, DialRequest, DialResponse, Drain,
    Packet, PacketType, Payload,
};

/// The names of ANP's packet types (`PacketType`'s enum names) by their
/// number on the wire: the `packet_type` label of ANP's stream metrics.
pub const TYPE_NAMES: [&str; 7] = [
    "DIAL_REQ",
    "DIAL_RSP",
    "CLOSE_REQ",
    "CLOSE_RSP",
    "DATA",
    "DIAL_CLS",
    "DRAIN",
];

impl Packet {
    /// `DIAL_REQ{protocol, address, random}`.
    pub fn dial_request(protocol: &str, address: &str, random: i64) -> Self {
        Self::new(
            PacketType::DialReq,
            Payload::DialRequest(DialRequest {
                protocol: protocol.to_owned(),
                address: address.to_owned(),
                random,
                traceparent: String::new(),
            }),
        )
    }

    /// `DIAL_RSP{random, connectID, error}`; an empty `error` means success.
    pub fn dial_response(random: i64, connect_id: i64, error: &str) -> Self {
        Self::dial_failure(random, connect_id, error, DialErrorClass::Unspecified)
    }

    /// `DIAL_RSP{random, connectID, error, errorClass}`: a failed dial's
    /// text and, for servers that read it (ours), its class.
    pub fn dial_failure(random: i64, connect_id: i64, error: &str, class: DialErrorClass) -> Self {
        Self::new(
            PacketType::DialRsp,
            Payload::DialResponse(DialResponse {
                error: error.to_owned(),
                connect_id,
                random,
                error_class: class as i32,
            }),
        )
    }

    /// `DATA{connectID, data}`.
    pub fn data(connect_id: i64, data: Bytes) -> Self {
        Self::new(
            PacketType::Data,
            Payload::Data(Data {
                connect_id,
                error: String::new(),
                data,
            }),
        )
    }

    /// `CLOSE_REQ{connectID}`.
    pub fn close_request(connect_id: i64) -> Self {
        Self::new(
            PacketType::CloseReq,
            Payload::CloseRequest(CloseRequest { connect_id }),
        )
    }

    /// `CLOSE_RSP{connectID, error}`; an empty `error` means a clean close.
    pub fn close_response(connect_id: i64, error: &str) -> Self {
        Self::new(
            PacketType::CloseRsp,
            Payload::CloseResponse(CloseResponse {
                error: error.to_owned(),
                connect_id,
            }),
        )
    }

    /// `DIAL_CLS{random}`: cancels a pending dial.
    pub fn close_dial(random: i64) -> Self {
        Self::new(
            PacketType::DialCls,
            Payload::CloseDial(CloseDial { random }),
        )
    }

    /// `DRAIN{}`: the agent is about to terminate.
    pub fn drain() -> Self {
        Self::new(PacketType::Drain, Payload::Drain(Drain {}))
    }

    fn new(kind: PacketType, payload: Payload) -> Self {
        Self {
            r#type: kind as i32,
            payload: Some(payload),
        }
    }

    /// The packet as a matchable value, dispatched on `type` (see module docs).
    ///
    /// Consumes the packet so that DATA bytes move out without a copy.
    pub fn into_kind(self) -> PacketKind {
        let payload = self.payload;
        match PacketType::try_from(self.r#type) {
            Ok(PacketType::DialReq) => PacketKind::DialReq(match payload {
                Some(Payload::DialRequest(p)) => p,
                _ => DialRequest::default(),
            }),
            Ok(PacketType::DialRsp) => PacketKind::DialRsp(match payload {
                Some(Payload::DialResponse(p)) => p,
                _ => DialResponse::default(),
            }),
            Ok(PacketType::CloseReq) => PacketKind::CloseReq(match payload {
                Some(Payload::CloseRequest(p)) => p,
                _ => CloseRequest::default(),
            }),
            Ok(PacketType::CloseRsp) => PacketKind::CloseRsp(match payload {
                Some(Payload::CloseResponse(p)) => p,
                _ => CloseResponse::default(),
            }),
            Ok(PacketType::Data) => PacketKind::Data(match payload {
                Some(Payload::Data(p)) => p,
                _ => Data::default(),
            }),
            Ok(PacketType::DialCls) => PacketKind::DialCls(match payload {
                Some(Payload::CloseDial(p)) => p,
                _ => CloseDial::default(),
            }),
            Ok(PacketType::Drain) => PacketKind::Drain,
            Err(_) => PacketKind::Unknown(self.r#type),
        }
    }

    /// The ANP enum name of the packet type (`DIAL_REQ`, …), for logs and metrics.
    pub fn type_name(&self) -> &'static str {
        PacketType::try_from(self.r#type).map_or("UNKNOWN", |t| t.as_str_name())
    }
}

/// A packet by what it means; see [`Packet::into_kind`].
///
/// Its `Debug` never prints DATA bytes (they are the tunnelled traffic:
/// tokens, passwords), only the connection id and the length.
#[derive(Clone, PartialEq)]
pub enum PacketKind {
    /// `DIAL_REQ`.
    DialReq(DialRequest),
    /// `DIAL_RSP`.
    DialRsp(DialResponse),
    /// `CLOSE_REQ`.
    CloseReq(CloseRequest),
    /// `CLOSE_RSP`.
    CloseRsp(CloseResponse),
    /// `DATA`.
    Data(Data),
    /// `DIAL_CLS`.
    DialCls(CloseDial),
    /// `DRAIN`.
    Drain,
    /// A type number this implementation does not know.
    Unknown(i32),
}

impl std::fmt::Debug for PacketKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::DialReq(p) => f.debug_tuple("DialReq").field(p).finish(),
            Self::DialRsp(p) => f.debug_tuple("DialRsp").field(p).finish(),
            Self::CloseReq(p) => f.debug_tuple("CloseReq").field(p).finish(),
            Self::CloseRsp(p) => f.debug_tuple("CloseRsp").field(p).finish(),
            Self::Data(p) => f
                .debug_struct("Data")
                .field("connect_id", &p.connect_id)
                .field("len", &p.data.len())
                .field("error", &p.error)
                .finish(),
            Self::DialCls(p) => f.debug_tuple("DialCls").field(p).finish(),
            Self::Drain => f.write_str("Drain"),
            Self::Unknown(t) => f.debug_tuple("Unknown").field(t).finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use prost::Message;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// Any bytes from the network decode to a packet or an error, never
        /// a panic; a decoded packet is never larger than its input (no
        /// length field makes the decoder allocate more than it was given),
        /// round-trips and can be looked at and named (the fuzz target's
        /// checks, `fuzzing::check_packet`).
        #[test]
        fn any_bytes_decode_or_fail_without_panic(input in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(packet) = Packet::decode(&input[..]) {
                crate::fuzzing::check_packet(packet, input.len());
            }
        }

        /// Every packet we build round-trips through the wire bytes.
        #[test]
        fn built_packets_round_trip(id in any::<i64>(), text in ".{0,64}", data in proptest::collection::vec(any::<u8>(), 0..256)) {
            for packet in [
                Packet::dial_request("tcp", &text, id),
                Packet::dial_response(id, id.wrapping_add(1), &text),
                Packet::data(id, Bytes::from(data.clone())),
                Packet::close_request(id),
                Packet::close_response(id, &text),
                Packet::close_dial(id),
                Packet::drain(),
            ] {
                let bytes = packet.encode_to_vec();
                prop_assert_eq!(Packet::decode(&bytes[..]).unwrap(), packet);
            }
        }
    }

    fn encoded(p: &Packet) -> Vec<u8> {
        p.encode_to_vec()
    }

    /// Golden bytes worked out by hand from the proto3 wire format, so a change
    /// of a field number, type or enum value breaks this test.
    #[test]
    fn golden_bytes_of_every_packet_type() {
        let cases: Vec<(Packet, Vec<u8>)> = vec![
            (
                // type 0 is the default and is not encoded; field 2 (dialRequest)
                // = { 1:"tcp", 2:"a:1", 3:5 }
                Packet::dial_request("tcp", "a:1", 5),
                vec![
                    0x12, 0x0c, 0x0a, 0x03, b't', b'c', b'p', 0x12, 0x03, b'a', b':', b'1', 0x18,
                    0x05,
                ],
            ),
            (
                // type 1; field 3 (dialResponse) = { 1:"e", 2:7, 3:5 }
                Packet::dial_response(5, 7, "e"),
                vec![
                    0x08, 0x01, 0x1a, 0x07, 0x0a, 0x01, b'e', 0x10, 0x07, 0x18, 0x05,
                ],
            ),
            (
                // type 1; field 3 (dialResponse) = { 1:"e", 3:5, 100:1 }:
                // the error class is field 100 (tag 800, varint a0 06).
                Packet::dial_failure(5, 0, "e", DialErrorClass::Refused),
                vec![
                    0x08, 0x01, 0x1a, 0x08, 0x0a, 0x01, b'e', 0x18, 0x05, 0xa0, 0x06, 0x01,
                ],
            ),
            (
                // The same with the class of a policy refusal: 100:6.
                Packet::dial_failure(5, 0, "e", DialErrorClass::Denied),
                vec![
                    0x08, 0x01, 0x1a, 0x08, 0x0a, 0x01, b'e', 0x18, 0x05, 0xa0, 0x06, 0x06,
                ],
            ),
            (
                // type 2; field 5 (closeRequest) = { 1:7 }
                Packet::close_request(7),
                vec![0x08, 0x02, 0x2a, 0x02, 0x08, 0x07],
            ),
            (
                // type 3; field 6 (closeResponse) = { 1:"x", 2:7 }
                Packet::close_response(7, "x"),
                vec![0x08, 0x03, 0x32, 0x05, 0x0a, 0x01, b'x', 0x10, 0x07],
            ),
            (
                // type 4; field 4 (data) = { 1:7, 3:"hi" }
                Packet::data(7, Bytes::from_static(b"hi")),
                vec![0x08, 0x04, 0x22, 0x06, 0x08, 0x07, 0x1a, 0x02, b'h', b'i'],
            ),
            (
                // type 5; field 7 (closeDial) = { 1:5 }
                Packet::close_dial(5),
                vec![0x08, 0x05, 0x3a, 0x02, 0x08, 0x05],
            ),
            (
                // type 6; field 8 (drain) = {}
                Packet::drain(),
                vec![0x08, 0x06, 0x42, 0x00],
            ),
        ];
        for (packet, bytes) in cases {
            assert_eq!(encoded(&packet), bytes, "encoding {}", packet.type_name());
            let decoded = Packet::decode(bytes.as_slice()).unwrap();
            assert_eq!(decoded, packet, "decoding {}", packet.type_name());
        }
    }

    /// ANP's DialRequest, as its own `.proto` declares it: three fields.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct AnpDialRequest {
        #[prost(string, tag = "1")]
        protocol: String,
        #[prost(string, tag = "2")]
        address: String,
        #[prost(int64, tag = "3")]
        random: i64,
    }

    /// ANP's Packet with only the dial request case, as an ANP agent
    /// decodes a DIAL_REQ.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct AnpPacket {
        #[prost(int32, tag = "1")]
        r#type: i32,
        #[prost(message, optional, tag = "2")]
        dial_request: Option<AnpDialRequest>,
    }

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// The trace context is field 101 of DialRequest: golden bytes, and an
    /// ANP agent decoding our DIAL_REQ skips it and sees the same dial.
    #[test]
    fn the_traceparent_is_invisible_to_anp_agents() {
        let mut ours = Packet::dial_request("tcp", "a:1", 5);
        if let Some(Payload::DialRequest(d)) = ours.payload.as_mut() {
            d.traceparent = TRACEPARENT.to_owned();
        }
        let bytes = ours.encode_to_vec();
        // field 2 (dialRequest) = { 1:"tcp", 2:"a:1", 3:5, 101:"00-…" }:
        // tag 101<<3|2 = 810 = varint aa 06, then length 55.
        let mut golden = vec![0x12, 0x0c + 3 + 55];
        golden.extend([
            0x0a, 0x03, b't', b'c', b'p', 0x12, 0x03, b'a', b':', b'1', 0x18, 0x05,
        ]);
        golden.extend([0xaa, 0x06, 55]);
        golden.extend(TRACEPARENT.as_bytes());
        assert_eq!(bytes, golden);
        let anp = AnpPacket::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            anp,
            AnpPacket {
                r#type: 0,
                dial_request: Some(AnpDialRequest {
                    protocol: "tcp".to_owned(),
                    address: "a:1".to_owned(),
                    random: 5,
                }),
            }
        );
        // An ANP server's DIAL_REQ (none of it) reads as no trace context.
        let back = Packet::decode(anp.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, Packet::dial_request("tcp", "a:1", 5));
    }

    /// ANP's DialResponse, as its own `.proto` declares it: three fields.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct AnpDialResponse {
        #[prost(string, tag = "1")]
        error: String,
        #[prost(int64, tag = "2")]
        connect_id: i64,
        #[prost(int64, tag = "3")]
        random: i64,
    }

    /// An ANP server reading our DIAL_RSP skips the error class (an
    /// unknown field) and sees the same answer; ours reading an ANP
    /// agent's sees no class, and reads the text.
    #[test]
    fn the_error_class_is_invisible_to_anp_and_absent_from_its_agents() {
        let ours = DialResponse {
            error: "dial tcp 10.0.0.1:80: connect: connection refused".to_owned(),
            connect_id: 0,
            random: 9,
            error_class: DialErrorClass::Refused as i32,
        };
        let anp = AnpDialResponse::decode(ours.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            anp,
            AnpDialResponse {
                error: ours.error.clone(),
                connect_id: 0,
                random: 9
            }
        );
        let back = DialResponse::decode(anp.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back.error_class(), DialErrorClass::Unspecified);
        assert_eq!(back.error, ours.error);
        // A class this build does not know reads as unspecified.
        let mut future = ours.encode_to_vec();
        let last = future.len() - 1;
        future[last] = 0x63;
        let read = DialResponse::decode(future.as_slice()).unwrap();
        assert_eq!(read.error_class, 0x63);
        assert_eq!(read.error_class(), DialErrorClass::Unspecified);
    }

    #[test]
    fn negative_ids_use_ten_byte_varints() {
        // int64 (not sint64): -1 is ten bytes on the wire, as Go encodes it.
        let bytes = encoded(&Packet::close_request(-1));
        assert_eq!(
            bytes,
            vec![
                0x08, 0x02, 0x2a, 0x0b, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                0x01
            ]
        );
    }

    #[test]
    fn dispatch_is_on_type_not_payload() {
        // DATA with no payload reads as connection id 0.
        let p = Packet {
            r#type: PacketType::Data as i32,
            payload: None,
        };
        assert_eq!(p.into_kind(), PacketKind::Data(Data::default()));
        // A CLOSE_REQ type carrying a DATA payload is a CLOSE_REQ for id 0.
        let p = Packet {
            r#type: PacketType::CloseReq as i32,
            payload: Some(Payload::Data(Data {
                connect_id: 9,
                ..Data::default()
            })),
        };
        assert_eq!(p.into_kind(), PacketKind::CloseReq(CloseRequest::default()));
        let p = Packet {
            r#type: 42,
            payload: None,
        };
        assert_eq!(p.into_kind(), PacketKind::Unknown(42));
    }

    #[test]
    fn type_names_match_anp() {
        let names: Vec<_> = [
            Packet::dial_request("tcp", "a:1", 1),
            Packet::dial_response(1, 1, ""),
            Packet::close_request(1),
            Packet::close_response(1, ""),
            Packet::data(1, Bytes::new()),
            Packet::close_dial(1),
            Packet::drain(),
        ]
        .iter()
        .map(Packet::type_name)
        .collect();
        assert_eq!(names, TYPE_NAMES);
        for (number, name) in TYPE_NAMES.iter().enumerate() {
            let number = i32::try_from(number).unwrap();
            assert_eq!(PacketType::try_from(number).unwrap().as_str_name(), *name);
        }
    }

    #[test]
    fn grpc_paths_have_no_package() {
        use crate::{agent_service_server, proxy_service_server};
        assert_eq!(
            <proxy_service_server::ProxyServiceServer<Dummy> as tonic::server::NamedService>::NAME,
            "ProxyService"
        );
        assert_eq!(
            <agent_service_server::AgentServiceServer<Dummy> as tonic::server::NamedService>::NAME,
            "AgentService"
        );
        let client_src = include_str!("gen/konnectivity.rs");
        assert!(client_src.contains("\"/ProxyService/Proxy\""));
        assert!(client_src.contains("\"/AgentService/Connect\""));
    }

    struct Dummy;
    type Stream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<Packet, tonic::Status>> + Send + 'static>,
    >;

    #[tonic::async_trait]
    impl proxy_service_server::ProxyService for Dummy {
        type ProxyStream = Stream;
        async fn proxy(
            &self,
            _: tonic::Request<tonic::Streaming<Packet>>,
        ) -> Result<tonic::Response<Stream>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
    }

    #[tonic::async_trait]
    impl agent_service_server::AgentService for Dummy {
        type ConnectStream = Stream;
        async fn connect(
            &self,
            _: tonic::Request<tonic::Streaming<Packet>>,
        ) -> Result<tonic::Response<Stream>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
    }

    use crate::{agent_service_server, proxy_service_server};

    #[test]
    fn debug_of_data_shows_its_length_never_its_bytes() {
        let kind = Packet::data(7, Bytes::from_static(b"Authorization: Bearer s3cr3t")).into_kind();
        let text = format!("{kind:?}");
        assert_eq!(text, "Data { connect_id: 7, len: 28, error: \"\" }");
        assert_eq!(
            format!("{:?}", Packet::close_request(7).into_kind()),
            "CloseReq(CloseRequest { connect_id: 7 })"
        );
    }
}
