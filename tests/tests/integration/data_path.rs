//! Moving DATA takes no lock that more than one stream takes: the server
//! counts, in debug builds, every time it takes such a lock (the control
//! core's, a frontend's attachments), and an established connection
//! carries 8 MiB each way, in both modes, without one.

use integration_tests::{
    ServerOpts, TestAgent, TestServer,
    destination::{self, pattern},
};
use proxy_server::config::Mode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LEN: usize = 8 << 20;

async fn no_shared_lock_while_bytes_move(mode: Mode) {
    let server = TestServer::start_with(ServerOpts {
        mode,
        // The stall scan reads every connection under the control lock.
        frontend_stall_timeout: None,
        ..Default::default()
    })
    .await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let mut conn = server.dialer().dial(&echo.address()).await.unwrap();
    // The connection is established and has carried its first bytes.
    conn.write_all(b"ping").await.unwrap();
    let mut pong = [0u8; 4];
    conn.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"ping");

    let before = proxy_server::shared_locks_taken().expect("a debug build counts");
    let data = pattern(LEN, 9);
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    let (_, got) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut got = vec![0u8; LEN];
        rd.read_exact(&mut got).await.unwrap();
        got
    });
    let after = proxy_server::shared_locks_taken().expect("a debug build counts");
    assert!(got == data, "echoed bytes differ");
    assert_eq!(
        after - before,
        0,
        "{} shared locks taken while 8 MiB went each way ({mode:?})",
        after - before
    );
    // Closing is a control event: it does take the lock.
    drop(conn);
    server.wait_idle().await;
    assert!(proxy_server::shared_locks_taken().unwrap() > after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_data_takes_no_shared_lock() {
    no_shared_lock_while_bytes_move(Mode::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connect_data_takes_no_shared_lock() {
    no_shared_lock_while_bytes_move(Mode::HttpConnect).await;
}
