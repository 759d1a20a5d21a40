//! Node-side connections: one [`EndpointConn`] per connection id, kept in
//! the [`Connections`] table of the server stream that dialed it, and the
//! dial itself.

use std::{
    io,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tunnel::flow::{SendCredit, WindowTx};

use crate::table::ConnTable;

/// How long a node-side dial may take (ANP's `dialTimeout`).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Handle of one node-side connection: where its inbound bytes go.
pub struct EndpointConn {
    /// Bytes from the server for the socket; dropping it closes the
    /// connection after the queued bytes are written.
    pub inbound: WindowTx<Bytes>,
    /// Credit for DATA to the server, when flow control was negotiated.
    pub send_credit: Option<SendCredit>,
    /// Ends the connection's task at once (overflow); the error is in `abort_reason`.
    pub abort: CancellationToken,
    /// Cancelled when the server closed the connection: bounds the drain.
    pub closing: CancellationToken,
    /// Why the connection was aborted, for its CLOSE_RSP.
    pub abort_reason: Arc<std::sync::OnceLock<String>>,
}

impl EndpointConn {
    /// Ends the connection's task at once; it answers CLOSE_RSP with
    /// `reason`.
    pub fn abort(self, reason: &str) {
        let _ = self.abort_reason.set(reason.to_owned());
        self.abort.cancel();
    }
}

/// The connection table of one server stream (see [`crate::table`]),
/// shared by the stream's reader and its dial and connection tasks, each
/// holding the lock only for one table call.
#[derive(Clone)]
pub struct Connections(Arc<Mutex<ConnTable<CancellationToken, EndpointConn>>>);

impl Connections {
    /// An empty table; pending dials are cancelled through children of
    /// `stream` (so they end with it).
    pub fn new(flow_control: bool, stream: &CancellationToken) -> Self {
        let stream = stream.clone();
        Self(Arc::new(Mutex::new(ConnTable::new(
            flow_control,
            move || stream.child_token(),
        ))))
    }

    /// The table, locked.
    pub fn lock(&self) -> MutexGuard<'_, ConnTable<CancellationToken, EndpointConn>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Number of open connections.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no connection is open.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Number of dials in progress.
    pub fn dials_in_progress(&self) -> usize {
        self.lock().dials_in_progress()
    }
}

/// Dials a node-side TCP address within [`DIAL_TIMEOUT`].
///
/// # Errors
/// Go-style text (`dial tcp host:port: connect: connection refused`,
/// `… i/o timeout`, `lookup host: no such host`) so that frontends that map
/// error strings, as kube-apiserver's HTTP-CONNECT path does, keep working.
pub async fn dial(protocol: &str, address: &str) -> Result<TcpStream, String> {
    if !matches!(protocol, "tcp" | "tcp4" | "tcp6" | "") {
        return Err(format!(
            "dial {protocol} {address}: unknown network {protocol}"
        ));
    }
    let attempt = async {
        let addrs: Vec<_> = tokio::net::lookup_host(address)
            .await
            .map_err(|e| lookup_error(address, &e))?
            .collect();
        let mut last = None;
        for addr in &addrs {
            match TcpStream::connect(addr).await {
                Ok(stream) => return Ok(stream),
                Err(e) => last = Some((addr, e)),
            }
        }
        match last {
            Some((addr, e)) => Err(format!("dial tcp {addr}: connect: {}", io_text(&e))),
            None => Err(format!(
                "dial tcp {address}: lookup {}: no such host",
                host(address)
            )),
        }
    };
    // One limit for lookup and connect together, as Go's DialTimeout.
    let stream = tokio::time::timeout(DIAL_TIMEOUT, attempt)
        .await
        .map_err(|_| format!("dial tcp {address}: i/o timeout"))??;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

fn host(address: &str) -> &str {
    address
        .rsplit_once(':')
        .map_or(address, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
}

fn lookup_error(address: &str, e: &io::Error) -> String {
    if e.kind() == io::ErrorKind::InvalidInput {
        return format!("dial tcp {address}: address {address}: missing port in address");
    }
    format!("dial tcp {address}: lookup {}: no such host", host(address))
}

/// An io error as Go's syscall text (lower case, no "os error N").
fn io_text(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        io::ErrorKind::ConnectionReset => "connection reset by peer".to_owned(),
        io::ErrorKind::TimedOut => "i/o timeout".to_owned(),
        io::ErrorKind::NetworkUnreachable => "network is unreachable".to_owned(),
        io::ErrorKind::HostUnreachable => "no route to host".to_owned(),
        io::ErrorKind::AddrNotAvailable => "cannot assign requested address".to_owned(),
        _ => {
            let text = e.to_string();
            let text = text.split(" (os error").next().unwrap_or(&text);
            text.to_lowercase()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refused_dials_read_like_go() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let err = dial("tcp", &addr.to_string()).await.unwrap_err();
        assert_eq!(err, format!("dial tcp {addr}: connect: connection refused"));
    }

    #[tokio::test]
    async fn unresolvable_names_read_like_go() {
        let err = dial("tcp", "no-such-host.invalid:80").await.unwrap_err();
        assert!(err.contains("no such host"), "{err}");
        assert!(err.contains("no-such-host.invalid"), "{err}");
    }

    #[tokio::test]
    async fn other_protocols_are_refused() {
        let err = dial("udp", "127.0.0.1:53").await.unwrap_err();
        assert!(err.contains("unknown network udp"), "{err}");
    }
}
