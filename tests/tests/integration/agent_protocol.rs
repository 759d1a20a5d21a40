//! proxy-agent against a scripted server: the packets it answers with for
//! every case of the protocol, as ANP's server would see them.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::pin::Pin;

use futures_util::Stream;
use integration_tests::{AgentOpts, DEADLINE, Pki, TestAgent, destination, wait_for};
use proto::{
    Packet,
    agent_service_server::{AgentService, AgentServiceServer},
    header,
    packet::PacketKind,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::mpsc,
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming, metadata::MetadataValue};

type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// One accepted agent stream, driven by the test.
struct AgentStream {
    /// Request metadata the agent sent.
    metadata: tonic::metadata::MetadataMap,
    /// Packets to the agent.
    tx: mpsc::Sender<Packet>,
    /// Packets from the agent.
    rx: Streaming<Packet>,
}

impl AgentStream {
    async fn send(&self, packet: Packet) {
        self.tx.send(packet).await.unwrap();
    }

    async fn recv(&mut self) -> PacketKind {
        tokio::time::timeout(DEADLINE, self.rx.message())
            .await
            .expect("timed out waiting for the agent")
            .unwrap()
            .expect("agent stream ended")
            .into_kind()
    }
}

struct Scripted {
    streams: mpsc::Sender<AgentStream>,
}

#[tonic::async_trait]
impl AgentService for Scripted {
    type ConnectStream = PacketStream;
    async fn connect(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<PacketStream>, Status> {
        let metadata = request.metadata().clone();
        let (tx, rx) = mpsc::channel(64);
        let _ = self
            .streams
            .send(AgentStream {
                metadata,
                tx,
                rx: request.into_inner(),
            })
            .await;
        let mut response = Response::new(Box::pin(futures_util::StreamExt::map(
            ReceiverStream::new(rx),
            Ok,
        )) as PacketStream);
        response
            .metadata_mut()
            .insert(header::SERVER_ID, MetadataValue::from_static("scripted"));
        response
            .metadata_mut()
            .insert(header::SERVER_COUNT, MetadataValue::from_static("1"));
        Ok(response)
    }
}

/// A scripted server with the test PKI; yields each agent stream.
async fn scripted_server() -> (
    std::net::SocketAddr,
    mpsc::Receiver<AgentStream>,
    CancellationToken,
) {
    let pki = Pki::get();
    let tls = ops::tls::server_config(
        &pki.path("cluster.crt"),
        &pki.path("cluster.key"),
        Some(&pki.path("agent-ca.crt")),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (streams_tx, streams) = mpsc::channel(4);
    let stop = CancellationToken::new();
    let incoming = edge::listen::tls_incoming(
        listener,
        tls,
        stop.clone(),
        "scripted",
        64,
        std::sync::Arc::new(|| {}),
    );
    let token = stop.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(AgentServiceServer::new(Scripted {
                streams: streams_tx,
            }))
            .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
            .await
            .unwrap();
    });
    (addr, streams, stop)
}

#[tokio::test]
async fn the_agent_answers_every_packet_as_anp_expects() {
    let (addr, mut streams, _stop) = scripted_server().await;
    let agent = TestAgent::start_with(
        addr,
        AgentOpts {
            agent_id: Some("agent-x".to_owned()),
            identifiers: "host=node-1&default-route=true".to_owned(),
            ..Default::default()
        },
    )
    .await;
    let mut server = tokio::time::timeout(DEADLINE, streams.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(server.metadata.get(header::AGENT_ID).unwrap(), "agent-x");
    assert_eq!(
        server.metadata.get(header::AGENT_IDENTIFIERS).unwrap(),
        "host=node-1&default-route=true"
    );
    wait_for("the agent to register the server", || {
        agent.handle.server_connections() == 1
    })
    .await;

    // Two dials get connection ids 1 and 2, echoing the dial ids.
    let echo = destination::echo().await;
    let mut ids = Vec::new();
    for random in [111, 222] {
        server
            .send(Packet::dial_request("tcp", &echo.address(), random))
            .await;
        match server.recv().await {
            PacketKind::DialRsp(rsp) => {
                assert_eq!(rsp.random, random);
                assert!(rsp.error.is_empty(), "{}", rsp.error);
                ids.push(rsp.connect_id);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(ids, [1, 2]);

    // DATA flows to the destination and back.
    server.send(Packet::data(1, b"abc".to_vec().into())).await;
    match server.recv().await {
        PacketKind::Data(d) => {
            assert_eq!(d.connect_id, 1);
            assert_eq!(&d.data[..], b"abc");
        }
        other => panic!("unexpected {other:?}"),
    }

    // DATA for an unknown id: CLOSE_RSP "unrecognized connectID".
    server.send(Packet::data(99, b"x".to_vec().into())).await;
    match server.recv().await {
        PacketKind::CloseRsp(rsp) => {
            assert_eq!(
                (rsp.connect_id, rsp.error.as_str()),
                (99, "unrecognized connectID")
            );
        }
        other => panic!("unexpected {other:?}"),
    }

    // CLOSE_REQ: CLOSE_RSP with no error; again: "Unknown connectID".
    server.send(Packet::close_request(1)).await;
    match server.recv().await {
        PacketKind::CloseRsp(rsp) => assert_eq!((rsp.connect_id, rsp.error.as_str()), (1, "")),
        other => panic!("unexpected {other:?}"),
    }
    server.send(Packet::close_request(1)).await;
    match server.recv().await {
        PacketKind::CloseRsp(rsp) => {
            assert_eq!(
                (rsp.connect_id, rsp.error.as_str()),
                (1, "Unknown connectID")
            );
        }
        other => panic!("unexpected {other:?}"),
    }

    // A failed dial: DIAL_RSP with Go's error text and connection id 0.
    let closed = destination::closed_port();
    server
        .send(Packet::dial_request("tcp", &closed.to_string(), 333))
        .await;
    match server.recv().await {
        PacketKind::DialRsp(rsp) => {
            assert_eq!((rsp.random, rsp.connect_id), (333, 0));
            assert_eq!(
                rsp.error,
                format!("dial tcp {closed}: connect: connection refused")
            );
        }
        other => panic!("unexpected {other:?}"),
    }

    // The destination closes its connection: CLOSE_RSP with no error.
    let download = destination::download(1000).await;
    server
        .send(Packet::dial_request("tcp", &download.address(), 444))
        .await;
    let id = match server.recv().await {
        PacketKind::DialRsp(rsp) => rsp.connect_id,
        other => panic!("unexpected {other:?}"),
    };
    // Ids are allocated before dialing (as ANP does), so the failed dial used 3.
    assert_eq!(id, 4, "ids are never reused on a stream");
    let mut got = 0;
    loop {
        match server.recv().await {
            PacketKind::Data(d) => {
                assert_eq!(d.connect_id, 4);
                got += d.data.len();
            }
            PacketKind::CloseRsp(rsp) => {
                assert_eq!((rsp.connect_id, rsp.error.as_str()), (4, ""));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, 1000);

    // Packets the agent does not expect from a server are ignored; the
    // stream keeps working (connection 2 still echoes).
    server.send(Packet::drain()).await;
    server.send(Packet::dial_response(1, 1, "")).await;
    server
        .send(Packet {
            r#type: 42,
            payload: None,
        })
        .await;
    server.send(Packet::data(2, b"still".to_vec().into())).await;
    match server.recv().await {
        PacketKind::Data(d) => assert_eq!((d.connect_id, &d.data[..]), (2, &b"still"[..])),
        other => panic!("unexpected {other:?}"),
    }

    // When the server stream ends, the agent closes its node-side connections.
    wait_for("one open connection", || {
        agent.handle.endpoint_connections() == 1
    })
    .await;
    drop(server);
    wait_for("connections closed with the stream", || {
        agent.handle.endpoint_connections() == 0 && echo.open_connections() == 0
    })
    .await;
}

#[tokio::test]
async fn the_agent_writes_every_queued_byte_before_closing() {
    let (addr, mut streams, _stop) = scripted_server().await;
    let _agent = TestAgent::start_with(addr, AgentOpts::default()).await;
    let mut server = tokio::time::timeout(DEADLINE, streams.recv())
        .await
        .unwrap()
        .unwrap();
    let sink = destination::upload_hash().await;
    server
        .send(Packet::dial_request("tcp", &sink.address(), 1))
        .await;
    let PacketKind::DialRsp(rsp) = server.recv().await else {
        panic!("expected DIAL_RSP")
    };
    let id = rsp.connect_id;
    let data = destination::pattern(3 << 20, 8);
    let mut hash = destination::Fnv::new();
    hash.update(&data);
    server
        .send(Packet::data(
            id,
            (data.len() as u64).to_be_bytes().to_vec().into(),
        ))
        .await;
    for chunk in data.chunks(100_000) {
        server.send(Packet::data(id, chunk.to_vec().into())).await;
    }
    match server.recv().await {
        PacketKind::Data(d) => assert_eq!(&d.data[..], &hash.finish().to_be_bytes()),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn a_dial_cancelled_with_dial_cls_is_never_answered_or_connected() {
    let (addr, mut streams, _stop) = scripted_server().await;
    let agent = TestAgent::start_with(addr, AgentOpts::default()).await;
    let mut server = tokio::time::timeout(DEADLINE, streams.recv())
        .await
        .unwrap()
        .unwrap();
    wait_for("the agent to register the server", || {
        agent.handle.server_connections() == 1
    })
    .await;
    let hole = destination::Blackhole::new();
    server
        .send(Packet::dial_request("tcp", &hole.addr.to_string(), 5))
        .await;
    wait_for("the dial to start", || {
        agent.handle.dials_in_progress() == 1
    })
    .await;
    server.send(Packet::close_dial(5)).await;
    wait_for("the dial to stop", || agent.handle.dials_in_progress() == 0).await;
    // The next answer is for the next dial, not the cancelled one.
    let echo = destination::echo().await;
    server
        .send(Packet::dial_request("tcp", &echo.address(), 6))
        .await;
    match server.recv().await {
        PacketKind::DialRsp(rsp) => assert_eq!(rsp.random, 6),
        other => panic!("unexpected {other:?}"),
    }
    let mut conn = tokio::net::TcpStream::connect(echo.addr).await.unwrap();
    conn.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    conn.read_exact(&mut b).await.unwrap();
}

#[tokio::test]
async fn the_token_file_is_read_again_on_every_connect() {
    let (addr, mut streams, _stop) = scripted_server().await;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "first-token").unwrap();
    let _agent = TestAgent::start_with(
        addr,
        AgentOpts {
            token_path: Some(token.clone()),
            ..Default::default()
        },
    )
    .await;
    let server = tokio::time::timeout(DEADLINE, streams.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        server.metadata.get(header::AUTHORIZATION).unwrap(),
        "Bearer first-token"
    );
    // The token rotates; the stream breaks; the agent reconnects with the new one.
    std::fs::write(&token, "second-token").unwrap();
    drop(server);
    let server = tokio::time::timeout(DEADLINE, streams.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        server.metadata.get(header::AUTHORIZATION).unwrap(),
        "Bearer second-token"
    );
}

#[tokio::test]
async fn without_a_token_file_no_authorization_is_sent() {
    let (addr, mut streams, _stop) = scripted_server().await;
    let _agent = TestAgent::start_with(addr, AgentOpts::default()).await;
    let server = tokio::time::timeout(DEADLINE, streams.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(server.metadata.get(header::AUTHORIZATION).is_none());
    // Our agent offers flow control; a server that does not answer it (ANP)
    // gets plain ANP behaviour.
    assert_eq!(
        server.metadata.get(tunnel::flow::HEADER).unwrap(),
        tunnel::flow::VERSION
    );
}
