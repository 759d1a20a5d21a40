//! The frontend transports: kube-apiserver's side of the server.
//!
//! - [`grpc`]: `ProxyService/Proxy` streams (konnectivity-client), and
//!   [`lanes`]: what a stream reads ahead of its waiting uploads, a lane per connection.
//! - [`http_connect`]: `CONNECT host:port HTTP/1.1` (`--mode=http-connect`).
//!
//! The layer that lets any `:authority` through to h2 on the Unix socket is
//! its own crate, `authority`.

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
