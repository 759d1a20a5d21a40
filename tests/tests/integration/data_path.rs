//! Moving DATA takes no lock that a third stream takes. The invariant, as
//! the server's lock audit (`proxy_server::audit`, debug builds) checks it
//! per server instance, for every lock of ours taken while bytes move:
//! - a lock of one connection (its flow state, its close) is taken only by
//!   the two streams that connection joins: one frontend, one agent stream;
//! - a lock of one stream is taken only by that stream's own tasks;
//! - the wait list of an agent stream's outbound queue is taken only by
//!   senders that must wait for room (and the releases that serve them):
//!   never while the queue has room;
//! - the control core's lock (the one every stream shares) is not taken.
//!
//! Locks inside h2 (one per HTTP/2 connection, which several frontend
//! streams may share) and tokio's are not ours and not counted; the
//! primitives under our queues and flow waits are ours (`tunnel::sync`).

use std::sync::Arc;

use integration_tests::{
    ServerOpts, TestAgent, TestServer,
    destination::{self, pattern},
};
use proxy_server::{
    audit::{LockAudit, LockKind, Record},
    config::Mode,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LEN: usize = 8 << 20;

/// Checks the invariant on what the audit recorded; returns how many
/// times a wait list was taken.
fn check_invariant(records: &[Record]) -> u64 {
    let mut wait_list = 0;
    for record in records {
        let kinds: Vec<&str> = record.takers.iter().map(|t| t.kind).collect();
        match record.kind {
            LockKind::Shared => panic!("a shared lock was taken while DATA moved: {record:?}"),
            LockKind::WaitList => wait_list += record.count,
            LockKind::Plain => assert!(
                kinds.len() <= 1 || kinds == ["backend", "frontend"],
                "a lock of ours was taken by streams no one connection joins: {record:?}"
            ),
        }
    }
    wait_list
}

/// Echoes `len` bytes through `conn`, byte-exact.
async fn echo_through(conn: &mut Box<dyn edge::io::Io>, len: usize, seed: u64) {
    let data = pattern(len, seed);
    let (mut rd, mut wr) = tokio::io::split(conn);
    let (_, got) = tokio::join!(async { wr.write_all(&data).await.unwrap() }, async {
        let mut got = vec![0u8; len];
        rd.read_exact(&mut got).await.unwrap();
        got
    });
    assert!(got == data, "echoed bytes differ");
}

fn audit(server: &TestServer) -> Arc<LockAudit> {
    assert!(
        LockAudit::records_locks(),
        "the lock audit records in debug builds only"
    );
    server.handle.lock_audit()
}

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
    echo_through(&mut conn, 4, 1).await;

    let audit = audit(&server);
    audit.start();
    echo_through(&mut conn, LEN, 9).await;
    let records = audit.stop();
    assert!(!records.is_empty(), "the audit saw no lock at all");
    let waits = check_invariant(&records);
    assert_eq!(waits, 0, "a wait list was taken with room in the queue");

    // Closing is a control event: it does take the shared lock.
    audit.start();
    drop(conn);
    server.wait_idle().await;
    let records = audit.stop();
    assert!(
        records.iter().any(|r| r.kind == LockKind::Shared),
        "the close took no shared lock: is the audit recording? {records:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_data_takes_no_shared_lock() {
    no_shared_lock_while_bytes_move(Mode::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connect_data_takes_no_shared_lock() {
    no_shared_lock_while_bytes_move(Mode::HttpConnect).await;
}

/// Under backpressure: 32 connections on one agent stream upload at once
/// into an agent queue of 64 KiB, so their senders wait for room. Still no
/// lock a third stream takes, but the queue's wait list, which is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_agent_queue_shares_only_its_wait_list() {
    const CONNS: u64 = 32;
    const EACH: usize = 1 << 20;
    let server = TestServer::start_with(ServerOpts {
        frontend_stall_timeout: None,
        max_agent_queue_bytes: 64 * 1024,
        ..Default::default()
    })
    .await;
    let _agent = TestAgent::start(&server).await;
    let echo = destination::echo().await;
    let mut conns = Vec::new();
    for i in 0..CONNS {
        let mut conn = server.dialer().dial(&echo.address()).await.unwrap();
        echo_through(&mut conn, 4, i).await;
        conns.push(conn);
    }
    let audit = audit(&server);
    audit.start();
    let mut moving = tokio::task::JoinSet::new();
    for (i, mut conn) in conns.into_iter().enumerate() {
        moving.spawn(async move {
            echo_through(&mut conn, EACH, 100 + i as u64).await;
            conn
        });
    }
    let mut conns = Vec::new();
    while let Some(done) = moving.join_next().await {
        conns.push(done.unwrap());
    }
    let records = audit.stop();
    let waits = check_invariant(&records);
    assert!(
        waits > 0,
        "no sender waited for room: the queue never filled ({records:?})"
    );
    let frontends = records
        .iter()
        .filter(|r| r.kind == LockKind::WaitList)
        .flat_map(|r| r.takers.iter().filter(|t| t.kind == "frontend"))
        .count();
    assert!(
        frontends > 1,
        "the wait list was shared by {frontends} frontend(s): not exercised"
    );
    drop(conns);
    server.wait_idle().await;
}
