//! An agent stream's driver ([`BackendDriver`]): reads the agent's
//! packets, handles DATA and credit against the stream's own table of
//! connections, and hands everything else to the control core.

use std::sync::Arc;

use proto::Packet;
use tonic::Streaming;
use tunnel::{blocked::when_blocked, flow, ids::ConnId};

use crate::{
    conn::{Conn, ConnTable, Delivery, Lookup},
    control::Control,
    metrics::{Method, Segment},
    router::BackendId,
    stream::{StreamEnd, next_packet},
};

/// One agent stream's driver; see the module documentation.
pub(super) struct BackendDriver {
    /// The stream.
    pub(super) id: BackendId,
    /// The control core.
    pub(super) control: Arc<Control>,
    /// The stream's established connections.
    pub(super) conns: ConnTable,
    /// The stream's end.
    pub(super) end: Arc<StreamEnd>,
}

/// A wait a packet needs: DATA for a frontend, from an agent without
/// credit, waiting for room in its connection's window, or with the buffer
/// budget full, for room there.
struct Wait {
    /// The connection.
    conn: Arc<Conn>,
    /// The payload.
    data: bytes::Bytes,
    /// The window admitted it already: only the budget is waited for.
    admitted: bool,
}

impl BackendDriver {
    /// Reads the agent's packets until it ends the stream, the stream
    /// fails or is ended inside the server (shutdown included); every wait
    /// is raced against that end.
    pub(super) async fn run(&mut self, inbound: &mut Streaming<Packet>) {
        let end = self.end.clone();
        let ended = end.ended();
        tokio::pin!(ended);
        let metrics = self.control.metrics.clone();
        while let Some(packet) =
            next_packet(inbound, ended.as_mut(), Segment::FromAgent, &end, &metrics).await
        {
            let Some(wait) = self.handle(packet) else {
                continue;
            };
            let http_connect = wait.conn.to_http_connect();
            // Boxed: inline, this rare wait (1 KiB) would double the size
            // of every agent's task, idle or not.
            let waited = Box::pin(when_blocked(self.deliver_wait(wait), || {
                let write = http_connect.then(|| metrics.write_blocked());
                (metrics.blocked(Method::Connect), write)
            }));
            tokio::select! {
                () = &mut ended => return,
                () = waited => {}
            }
        }
    }

    /// Handles one packet; the wait it needs, if any.
    fn handle(&mut self, packet: Packet) -> Option<Wait> {
        if let Some((id, credit)) = flow::parse_credit(&packet) {
            if let Lookup::Open(conn) = self.conns.lookup(ConnId(id)) {
                conn.flow.grant(credit);
            }
            return None;
        }
        if packet.r#type == proto::PacketType::Data as i32 {
            return self.data(packet);
        }
        if packet.r#type == proto::PacketType::CloseRsp as i32
            && let Some(proto::Payload::CloseResponse(rsp)) = &packet.payload
        {
            // The agent is done with it, whoever closed it.
            self.conns.remove(ConnId(rsp.connect_id));
        }
        if let Some(conn) = self.control.backend_packet(self.id, packet) {
            self.conns.insert(conn);
        }
        None
    }

    /// Agent DATA: to its connection's frontend, never waiting with credit.
    fn data(&mut self, packet: Packet) -> Option<Wait> {
        let Some(proto::Payload::Data(data)) = &packet.payload else {
            return None;
        };
        let id = ConnId(data.connect_id);
        let conn = match self.conns.lookup(id) {
            Lookup::Open(conn) => conn,
            // Sent before the agent learnt of the close.
            Lookup::Closed(_) => return None,
            Lookup::Unknown => {
                self.control.backend_packet(self.id, packet);
                return None;
            }
        };
        match conn.deliver(&data.data) {
            Delivery::Queued | Delivery::Gone => None,
            Delivery::Overflow => {
                self.control.overflow(self.id, id);
                None
            }
            Delivery::Wait => Some(Wait {
                conn,
                data: data.data.clone(),
                admitted: false,
            }),
            Delivery::NoBudget => Some(Wait {
                conn,
                data: data.data.clone(),
                admitted: true,
            }),
        }
    }

    /// Waits for room for DATA from an agent without credit (its frontend
    /// must drain within `COMPAT_STALL`), and for room in the buffer budget
    /// (within `COMPAT_STALL` too): the stream is not read meanwhile, as a
    /// stream without per-connection credit would not be.
    async fn deliver_wait(&self, wait: Wait) {
        if wait.conn.deliver_wait(wait.data, wait.admitted).await == Delivery::Overflow {
            self.control.overflow(self.id, wait.conn.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::fuzzing::streams;

    #[test]
    fn an_idle_agents_driver_is_not_sized_by_its_rare_wait() {
        let (_tx, body) = streams::body();
        let mut driver = BackendDriver {
            id: BackendId(1),
            control: streams::control(),
            conns: ConnTable::default(),
            end: StreamEnd::new(CancellationToken::new()),
        };
        let mut inbound = streams::streaming(body);
        let run = driver.run(&mut inbound);
        // Every agent's task holds this future whole: with the wait for
        // room inline it was 1,976 bytes, its idle state 935 (the driver
        // and its stream twice over, when it took them by value).
        let size = std::mem::size_of_val(&run);
        assert!(size < 512, "an agent's driver is {size} bytes");
    }
}
