//! The `AgentService/Connect` handler and its driver: one call is one
//! backend (ANP's name for an agent stream).
//!
//! - [`service`]: the handler ([`AgentServiceImpl`]): admits the agent,
//!   registers its stream with the control core and starts its driver.
//! - [`driver`]: the driver ([`BackendDriver`](driver::BackendDriver)),
//!   which reads the agent's packets and owns the table of the stream's
//!   connections (connect id → [`Conn`](crate::conn::Conn): the
//!   frontend's queue and the connection's flow state). DATA and credit
//!   are handled against that table without any lock another stream
//!   takes; everything else goes to the control core (`control`), which
//!   answers a DIAL_RSP with the connection it opened.
//!
//! tonic drains the stream's outbound queue
//! ([`BackendLink`](crate::conn::BackendLink)).

mod driver;
mod service;

use std::{net::SocketAddr, sync::Arc};

use tracing::info;
use tunnel::ids::AgentId;

pub(crate) use self::service::AgentServiceImpl;
use crate::{control::Control, router::BackendId};

/// Tells the control core that an agent stream ended when its driver ends,
/// on error, cancel and panic alike: its connections are closed towards
/// their frontends and its pending dials fail.
struct BackendGuard {
    /// The control core.
    control: Arc<Control>,
    /// The agent stream.
    backend: BackendId,
    /// Its agent, for the log.
    agent_id: AgentId,
    /// Its address, for the log.
    peer: Option<SocketAddr>,
}

impl Drop for BackendGuard {
    fn drop(&mut self) {
        self.control.backend_closed(self.backend);
        info!(agent.id = %self.agent_id, peer.addr = ?self.peer, "agent disconnected");
    }
}
