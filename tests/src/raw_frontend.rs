//! [`RawFrontend`]: a frontend that sends packets by hand.

use proto::{Packet, packet::PacketKind, proxy_service_client::ProxyServiceClient};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, transport::Channel};
use tunnel::ids::DialId;

use crate::{DEADLINE, TestServer};

/// A frontend that speaks packets directly, for protocol tests.
pub struct RawFrontend {
    /// Packets to the server.
    pub tx: mpsc::Sender<Packet>,
    /// Packets from the server.
    pub rx: Streaming<Packet>,
}

impl RawFrontend {
    /// Opens a `Proxy` stream on a fresh frontend connection; `first` is sent
    /// before the call so the server's headers come with its answer.
    pub async fn open(server: &TestServer, first: Packet) -> Self {
        let (tx, rx) = mpsc::channel(64);
        tx.send(first).await.expect("queueing the first packet");
        let response = ProxyServiceClient::new(server.channel().await)
            .proxy(ReceiverStream::new(rx))
            .await
            .expect("opening the proxy stream");
        Self {
            tx,
            rx: response.into_inner(),
        }
    }

    /// Opens a `Proxy` stream with `client` and dials `address` (DIAL_REQ
    /// with a random id, sent before the call), room for 4 packets queued
    /// towards the server; returns once a successful DIAL_RSP came, with
    /// its connection id (any other answer fails the test).
    pub async fn dial(mut client: ProxyServiceClient<Channel>, address: &str) -> (Self, i64) {
        let (tx, rx) = mpsc::channel(4);
        tx.send(Packet::dial_request("tcp", address, DialId::random().0))
            .await
            .expect("queueing the DIAL_REQ");
        let mut rx = client
            .proxy(ReceiverStream::new(rx))
            .await
            .expect("opening the proxy stream")
            .into_inner();
        let answer = rx
            .message()
            .await
            .expect("stream failed")
            .expect("stream ended");
        let conn = match answer.into_kind() {
            PacketKind::DialRsp(rsp) if rsp.error.is_empty() => rsp.connect_id,
            other => panic!("expected a successful DIAL_RSP, got {other:?}"),
        };
        (Self { tx, rx }, conn)
    }

    /// Sends a packet.
    pub async fn send(&self, packet: Packet) {
        self.tx.send(packet).await.expect("sending a packet");
    }

    /// The next packet, failing the test after [`DEADLINE`].
    pub async fn recv(&mut self) -> Packet {
        tokio::time::timeout(DEADLINE, self.rx.message())
            .await
            .expect("timed out waiting for a packet")
            .expect("stream failed")
            .expect("stream ended")
    }
}
