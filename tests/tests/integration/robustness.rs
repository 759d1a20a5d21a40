//! Bad peers: untrusted agents, plain TCP, garbage and truncated HTTP/2 on
//! both listeners, and frontends that break the packet protocol. The server
//! must refuse or close them and keep serving everyone else.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::sync::Arc;

use integration_tests::{
    AgentOpts, DEADLINE, Pki, RawFrontend, TestAgent, TestServer, destination, wait_for,
};
use ops::tls;
use proto::{Packet, packet::PacketKind};
use rustls_pki_types::ServerName;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    net::{TcpStream, UnixStream},
};
use tokio_rustls::TlsConnector;

/// The HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the peer closes or fails; panics if it keeps the connection
/// open past the deadline.
async fn expect_closed(stream: &mut (impl AsyncRead + Unpin)) {
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(DEADLINE, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the server kept a bad connection open");
}

async fn agent_tls(
    server: &TestServer,
    pki: &Pki,
    client_cert: bool,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let config = tls::client_config(
        &Pki::get().path("agent-ca.crt"),
        client_cert
            .then(|| (pki.path("proxy-agent.crt"), pki.path("proxy-agent.key")))
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path())),
        &[],
    )
    .unwrap();
    let tcp = TcpStream::connect(server.agent_addr).await.unwrap();
    TlsConnector::from(Arc::<rustls::ClientConfig>::clone(&config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap()
}

#[tokio::test]
async fn agents_with_a_foreign_or_no_certificate_are_refused() {
    let server = TestServer::start().await;
    for (pki, client_cert) in [(Pki::other(), true), (Pki::get(), false)] {
        // TLS 1.3 reports the refused client certificate after the handshake:
        // the server's alert or close is what the client reads next.
        let mut stream = agent_tls(&server, pki, client_cert).await;
        let _ = stream.write_all(PREFACE).await;
        expect_closed(&mut stream).await;
    }
    // Real agents: the untrusted one never registers, the good one does.
    let foreign = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            foreign_pki: true,
            ..Default::default()
        },
    )
    .await;
    let good = TestAgent::start(&server).await;
    assert_eq!(server.handle.backend_count(), 1);
    wait_for("the good agent to register its server", || {
        good.handle.server_connections() == 1
    })
    .await;
    assert_eq!(foreign.handle.server_connections(), 0);
    server.assert_serves().await;
}

#[tokio::test]
async fn plain_tcp_and_garbage_on_the_agent_port_are_dropped() {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;

    let mut plain = TcpStream::connect(server.agent_addr).await.unwrap();
    plain.write_all(PREFACE).await.unwrap();
    expect_closed(&mut plain).await;

    let mut garbage = TcpStream::connect(server.agent_addr).await.unwrap();
    garbage
        .write_all(&destination::pattern(4096, 99))
        .await
        .unwrap();
    expect_closed(&mut garbage).await;

    // A peer that connects and says nothing does not block anyone.
    let _idle = TcpStream::connect(server.agent_addr).await.unwrap();

    // Good TLS, then garbage instead of HTTP/2; then truncated HTTP/2.
    let mut tls_garbage = agent_tls(&server, Pki::get(), true).await;
    tls_garbage
        .write_all(&destination::pattern(1000, 5))
        .await
        .unwrap();
    expect_closed(&mut tls_garbage).await;
    let mut truncated = agent_tls(&server, Pki::get(), true).await;
    truncated.write_all(PREFACE).await.unwrap();
    truncated
        .write_all(&[0, 0, 18, 4, 0, 0, 0, 0, 0, 0, 3])
        .await
        .unwrap();
    drop(truncated);

    server.assert_serves().await;
    let second = TestAgent::start(&server).await;
    wait_for("the second agent", || {
        second.handle.server_connections() == 1
    })
    .await;
}

#[tokio::test]
async fn garbage_and_truncated_http2_on_the_frontend_socket_are_dropped() {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;

    let mut garbage = UnixStream::connect(&server.uds).await.unwrap();
    garbage
        .write_all(&destination::pattern(4096, 42))
        .await
        .unwrap();
    expect_closed(&mut garbage).await;

    // Preface and half a SETTINGS frame, then hang up.
    let mut truncated = UnixStream::connect(&server.uds).await.unwrap();
    truncated.write_all(PREFACE).await.unwrap();
    truncated
        .write_all(&[0, 0, 12, 4, 0, 0, 0, 0, 0, 0])
        .await
        .unwrap();
    drop(truncated);

    // Preface, then a frame that claims 16 MiB.
    let mut oversized = UnixStream::connect(&server.uds).await.unwrap();
    oversized.write_all(PREFACE).await.unwrap();
    oversized
        .write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
        .await
        .unwrap();
    oversized
        .write_all(&[0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 1])
        .await
        .unwrap();
    expect_closed(&mut oversized).await;

    // Someone who connects and stays silent.
    let _idle = UnixStream::connect(&server.uds).await.unwrap();

    server.assert_serves().await;
}

#[tokio::test]
async fn undecodable_packets_end_only_that_stream() {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let mut victim = server.dial(&echo.address()).await.unwrap();

    // A well-framed gRPC message whose bytes are not a Packet.
    let channel = server.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/ProxyService/Proxy");
    let garbage = bytes::Bytes::from(vec![0xff; 64]);
    let result = grpc
        .streaming(
            tonic::Request::new(tokio_stream::once(garbage)),
            path,
            RawCodec,
        )
        .await;
    if let Ok(response) = result {
        let mut stream = response.into_inner();
        let ended = tokio::time::timeout(DEADLINE, async {
            loop {
                match stream.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => return,
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "the bad stream was not ended");
    }

    victim.write_all(b"unaffected").await.unwrap();
    let mut got = [0u8; 10];
    victim.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"unaffected");
    victim.finish().await.unwrap();
}

#[tokio::test]
async fn frontends_using_connections_they_do_not_own_get_anps_answers() {
    let server = TestServer::start().await;
    let agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;

    // The victim: an established connection of another frontend.
    let mut victim = server.dial(&echo.address()).await.unwrap();
    let theirs = victim.conn_id().0;

    // 1. DATA before any dial: "backend not initialized".
    let mut stranger =
        RawFrontend::open(&server, Packet::data(theirs, b"intrude".to_vec().into())).await;
    expect_close_rsp(&mut stranger, theirs, "backend not initialized").await;

    // 2. CLOSE_REQ before any dial: "backend uninitialized".
    let mut closer = RawFrontend::open(&server, Packet::close_request(theirs)).await;
    expect_close_rsp(&mut closer, theirs, "backend uninitialized").await;

    // 3. A dialed frontend that uses someone else's id, then one that uses an
    //    id nobody issued: both ids get "mismatched connection IDs" and the
    //    offender's own connection is closed; nobody else's is touched.
    for foreign in [theirs, 987_654_321] {
        let mut offender =
            RawFrontend::open(&server, Packet::dial_request("tcp", &echo.address(), 77)).await;
        let own = match offender.recv().await.into_kind() {
            PacketKind::DialRsp(rsp) => {
                assert!(rsp.error.is_empty(), "{}", rsp.error);
                rsp.connect_id
            }
            other => panic!("unexpected {other:?}"),
        };
        offender
            .send(Packet::data(foreign, b"intrude".to_vec().into()))
            .await;
        expect_close_rsp(&mut offender, foreign, proxy_server::MISMATCHED).await;
        expect_close_rsp(&mut offender, own, proxy_server::MISMATCHED).await;
        // Later packets from the offender are ignored.
        offender
            .send(Packet::data(own, b"more".to_vec().into()))
            .await;
    }

    // 4. DATA for connection 0 and a packet type nobody knows: dropped.
    let mut odd = RawFrontend::open(&server, Packet::data(0, b"zero".to_vec().into())).await;
    odd.send(Packet {
        r#type: 42,
        payload: None,
    })
    .await;
    odd.send(Packet::dial_request("tcp", &echo.address(), 5))
        .await;
    match odd.recv().await.into_kind() {
        PacketKind::DialRsp(rsp) => assert!(rsp.error.is_empty(), "{}", rsp.error),
        other => panic!("unexpected {other:?}"),
    }

    // The victim never noticed.
    victim.write_all(b"unharmed").await.unwrap();
    let mut got = [0u8; 8];
    victim.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"unharmed");
    victim.finish().await.unwrap();
    drop(odd);
    server.wait_idle().await;
    wait_for("agent connections closed", || {
        agent.handle.endpoint_connections() == 0
    })
    .await;
}

async fn expect_close_rsp(frontend: &mut RawFrontend, id: i64, error: &str) {
    match frontend.recv().await.into_kind() {
        PacketKind::CloseRsp(rsp) => {
            assert_eq!(rsp.connect_id, id);
            assert_eq!(rsp.error, error);
        }
        other => panic!("expected CLOSE_RSP for {id}, got {other:?}"),
    }
}

/// Sends raw bytes as gRPC messages and decodes nothing.
#[derive(Clone, Copy)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = bytes::Bytes;
    type Decode = bytes::Bytes;
    type Encoder = Self;
    type Decoder = Self;
    fn encoder(&mut self) -> Self {
        Self
    }
    fn decoder(&mut self) -> Self {
        Self
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = bytes::Bytes;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: bytes::Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put(item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = bytes::Bytes;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<bytes::Bytes>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}
