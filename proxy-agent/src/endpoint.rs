//! Node-side connections: one [`EndpointConn`] per connection id, kept by the
//! [`ConnectionManager`] of the server stream that dialed it.

use std::{
    collections::HashMap,
    io,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tunnel::{
    flow::{SendCredit, WindowTx},
    ids::{ConnId, DialId},
};

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

/// The connections and pending dials of one server stream.
#[derive(Default)]
pub struct ConnectionManager {
    /// Established connections.
    conns: Mutex<HashMap<ConnId, EndpointConn>>,
    /// Dials in progress, cancelled by DIAL_CLS.
    dials: Mutex<HashMap<DialId, CancellationToken>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ConnectionManager {
    /// Registers an established connection.
    pub fn insert(&self, id: ConnId, conn: EndpointConn) {
        lock(&self.conns).insert(id, conn);
    }

    /// The receive queue of a connection.
    pub fn inbound(&self, id: ConnId) -> Option<WindowTx<Bytes>> {
        lock(&self.conns).get(&id).map(|c| c.inbound.clone())
    }

    /// Removes a connection and aborts it; its task answers CLOSE_RSP with
    /// `reason`.
    pub fn abort(&self, id: ConnId, reason: &str) {
        if let Some(conn) = lock(&self.conns).remove(&id) {
            let _ = conn.abort_reason.set(reason.to_owned());
            conn.abort.cancel();
        }
    }

    /// Adds credit the server returned for a connection.
    pub fn grant(&self, id: ConnId, credit: usize) {
        if let Some(send_credit) = lock(&self.conns)
            .get(&id)
            .and_then(|c| c.send_credit.clone())
        {
            send_credit.grant(credit);
        }
    }

    /// Removes a connection; dropping the result starts its close.
    pub fn remove(&self, id: ConnId) -> Option<EndpointConn> {
        lock(&self.conns).remove(&id)
    }

    /// Number of open connections.
    pub fn len(&self) -> usize {
        lock(&self.conns).len()
    }

    /// Whether no connection is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers a dial in progress.
    pub fn start_dial(&self, id: DialId, cancel: CancellationToken) {
        lock(&self.dials).insert(id, cancel);
    }

    /// Forgets a finished dial.
    pub fn finish_dial(&self, id: DialId) {
        lock(&self.dials).remove(&id);
    }

    /// Cancels a dial; `false` if it is not in progress.
    pub fn cancel_dial(&self, id: DialId) -> bool {
        lock(&self.dials).remove(&id).map(|c| c.cancel()).is_some()
    }

    /// Number of dials in progress.
    pub fn dials_in_progress(&self) -> usize {
        lock(&self.dials).len()
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

/// Shared handle so tasks can reach the manager of their stream.
pub type SharedConnections = Arc<ConnectionManager>;

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

    #[test]
    fn dial_cancellation() {
        let m = ConnectionManager::default();
        let token = CancellationToken::new();
        m.start_dial(DialId(5), token.clone());
        assert_eq!(m.dials_in_progress(), 1);
        assert!(m.cancel_dial(DialId(5)));
        assert!(token.is_cancelled());
        assert!(!m.cancel_dial(DialId(5)));
        assert_eq!(m.dials_in_progress(), 0);
    }
}
