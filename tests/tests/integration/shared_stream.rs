//! Several connections on one `Proxy` stream (issue 37, item 3): one whose
//! destination stopped reading does not stop the others. The server reads
//! the stream on into a bounded read-ahead while an upload waits; a
//! connection that fills it and makes no progress for the grace period is
//! closed with an error, and the stream reads on. A stream with one
//! connection keeps plain backpressure: slowed, never cut.
//!
//! Driven by Python's grpcio (`tests/python/frontend.py shared-stream`), a
//! frontend we did not write, and by hand-made packets.

use integration_tests::{
    DEADLINE, TestAgent, TestServer,
    destination::{self, Stall, pattern},
    python,
    raw_frontend::RawFrontend,
};
use proto::{Packet, packet::PacketKind, proxy_service_client::ProxyServiceClient};
use tokio::io::AsyncReadExt;

/// Two connections on one stream: one uploads `bytes` into a destination
/// that never reads, then sends CLOSE_REQ; the other makes 20 echo round
/// trips meanwhile. The stalled one's CLOSE_RSP error is checked, and the
/// count of connections closed so.
async fn shared_stream(bytes: usize) -> python::FrontendReport {
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let stall = Stall::start();
    let report = python::frontend([
        "shared-stream".to_owned(),
        format!("--target=unix:{}", server.uds.display()),
        format!("--address={}", echo.address()),
        format!("--stalled-address={}", stall.address()),
        format!("--bytes={bytes}"),
        "--round-trips=20".to_owned(),
    ])
    .await;
    report.assert_ok();
    assert_eq!(report.int("round_trips"), 20, "{report}");
    assert_eq!(
        report.str("close_error"),
        proxy_server::UPLOAD_STALLED,
        "{report}"
    );
    assert_eq!(
        server
            .metric("konnectivity_rs_server_connections_closed_total{reason=\"upload_stalled\"}")
            .await,
        1.0
    );
    server.wait_idle().await;
    report
}

/// The stalled connection sends far more than the agent's window and the
/// server's read-ahead hold: the read-ahead fills and the stream stops for
/// it, the echo connection's round trips wait, and after the grace period
/// the stalled one is cut and the stream reads on. Before the read-ahead,
/// the echo connection made no round trip at all (the stream waited on the
/// stalled upload for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_that_fills_the_read_ahead_is_cut_and_the_others_go_on() {
    let report = shared_stream(64 << 20).await;
    let slowest = report.json["slowest_round_trip"].as_f64().unwrap();
    assert!(slowest < 60.0, "{report}");
}

/// The stalled connection sends more than the destination's kernel
/// buffers take, then CLOSE_REQ: the close is answered (with an error: its
/// bytes were not delivered) after the grace period, not when the
/// destination reads, whether the read-ahead filled or the CLOSE_REQ
/// waited in its lane (`frontend::lanes`' unit tests take each path alone).
/// Before, it was never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_behind_a_stalled_upload_is_answered_without_the_destination() {
    shared_stream(16 << 20).await;
}

/// One connection on its stream whose destination reads nothing for longer
/// than the grace period, then everything: every byte arrives, nothing is
/// cut (plain backpressure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_slow_connection_is_slowed_never_cut() {
    // More than every buffer on the way (the agent's window and socket,
    // the server's read-ahead, HTTP/2 windows) holds.
    const LEN: usize = 32 << 20;
    let server = TestServer::start().await;
    let _agent = TestAgent::start(&server).await;
    let (resume_tx, resume_rx) = tokio::sync::oneshot::channel::<()>();
    let resume = std::sync::Mutex::new(Some(resume_rx));
    let late = destination::spawn(move |mut stream| {
        let resume = resume.lock().unwrap().take();
        async move {
            // Reads nothing until told, then everything; answers its hash.
            if let Some(resume) = resume {
                let _ = resume.await;
            }
            let mut read = 0;
            let mut hash = destination::Fnv::new();
            let mut buf = vec![0u8; 64 * 1024];
            while read < LEN {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "the tunnel closed after {read} bytes");
                hash.update(&buf[..n]);
                read += n;
            }
            use tokio::io::AsyncWriteExt;
            stream.write_u64(hash.finish()).await.unwrap();
        }
    })
    .await;
    let client = ProxyServiceClient::new(server.channel().await);
    let (mut fe, conn) = RawFrontend::dial(client, &late.address()).await;
    let data = pattern(LEN, 3);
    let sender = {
        let tx = fe.tx.clone();
        let data = data.clone();
        tokio::spawn(async move {
            for chunk in data.chunks(32 * 1024) {
                let packet = Packet::data(conn, bytes::Bytes::copy_from_slice(chunk));
                tx.send(packet).await.unwrap();
            }
        })
    };
    // The upload stalls for longer than the grace period.
    let stalled_for = proxy_server::UPLOAD_GRACE + std::time::Duration::from_secs(2);
    tokio::time::sleep(stalled_for).await;
    assert!(!sender.is_finished(), "the upload did not stall");
    resume_tx.send(()).unwrap();
    let mut expected = destination::Fnv::new();
    expected.update(&data);
    let answer = tokio::time::timeout(DEADLINE, async {
        loop {
            match fe.recv().await.into_kind() {
                PacketKind::Data(d) => return d.data,
                PacketKind::CloseRsp(rsp) => panic!("closed: {:?}", rsp.error),
                _ => {}
            }
        }
    })
    .await
    .expect("the destination's answer");
    assert_eq!(&answer[..], &expected.finish().to_be_bytes()[..]);
    sender.await.unwrap();
}
