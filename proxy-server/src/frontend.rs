//! The frontend transports: kube-apiserver's side of the server.
//!
//! - [`grpc`]: `ProxyService/Proxy` streams (konnectivity-client), and
//!   [`lanes`]: what a stream reads ahead of its waiting uploads, a lane per connection.
//! - [`http_connect`]: `CONNECT host:port HTTP/1.1` (`--mode=http-connect`).
//! - [`cap`]: `--max-http-connections`, the frontend connections open at
//!   once in either mode.
//!
//! The layer that lets any `:authority` through to h2 on the Unix socket is
//! its own crate, `authority`.

pub(crate) mod cap;
pub(crate) mod grpc;
pub(crate) mod http_connect;
pub(crate) mod lanes;

use std::sync::Arc;

use crate::{conn::FrontendLink, control::Control};

/// Tells the control core that a frontend ended and ends its stream's
/// outbound side when the frontend's task ends, on error, cancel and panic
/// alike; it never waits.
pub(crate) struct FrontendGuard {
    /// The control core.
    pub(crate) control: Arc<Control>,
    /// The frontend.
    pub(crate) link: FrontendLink,
}

impl Drop for FrontendGuard {
    fn drop(&mut self) {
        self.control.frontend_closed(self.link.id());
        self.link.tx.end.end();
    }
}

/// A frontend's socket: who is at its other end, for its tunnels' audit
/// records (`traces::FrontendPeer`).
pub(crate) trait FrontendSocket {
    /// The peer's `ip:port` (empty on the Unix socket, whose peers have
    /// none: the record names the socket) and its client certificate's
    /// subject, if it gave one.
    fn peer(&self) -> (String, Option<String>);

    /// Makes the socket's close a reset (RST) rather than a FIN, for a
    /// tunnel that broke: a client reading it gets an error, not an end of
    /// file that looks like the destination's. A Unix socket has no reset:
    /// its peer reads an end of file.
    fn reset_on_close(&self);
}

impl FrontendSocket for tokio::net::UnixStream {
    fn peer(&self) -> (String, Option<String>) {
        (String::new(), None)
    }

    fn reset_on_close(&self) {}
}

impl FrontendSocket for edge::listen::TlsConn {
    fn peer(&self) -> (String, Option<String>) {
        let (io, session) = self.get_ref();
        let addr = io
            .get_ref()
            .get_ref()
            .peer_addr()
            .map(|addr| addr.to_string())
            .unwrap_or_default();
        (addr, client_subject(session.peer_certificates()))
    }

    fn reset_on_close(&self) {
        // No close_notify either: the TLS stream is dropped, not shut down.
        let _ = self.get_ref().0.get_ref().get_ref().set_zero_linger();
    }
}

/// The subject of the leaf of a client's certificate chain, if any.
pub(crate) fn client_subject(
    chain: Option<&[rustls::pki_types::CertificateDer<'_>]>,
) -> Option<String> {
    chain?.first().and_then(ops::tls::files::subject)
}
