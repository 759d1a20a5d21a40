//! The reader of a server-side gRPC stream, the same for both services: it
//! hands each packet to the hub and runs the wait the packet needs (a dial
//! waiting for room on its agent stream, DATA waiting for credit or for a
//! window), every await raced against the stream's end.

use std::future::Future;

use proto::Packet;
use tonic::{Status, Streaming};
use tracing::{debug, warn};
use tunnel::blocked::when_blocked;

use crate::{
    hub::{Hub, Work},
    link::StreamEnd,
    metrics::{CONNECT, MethodLabel, PROXY},
};

/// Which service a stream serves: its metric labels and its peer's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// A frontend's `ProxyService/Proxy` stream.
    Frontend,
    /// An agent's `AgentService/Connect` stream.
    Agent,
}

impl Side {
    /// The `segment` label of what the peer sends.
    fn segment(self) -> &'static str {
        match self {
            Self::Frontend => "from_client",
            Self::Agent => "from_agent",
        }
    }

    /// The gRPC method.
    fn method(self) -> MethodLabel {
        match self {
            Self::Frontend => PROXY,
            Self::Agent => CONNECT,
        }
    }

    /// The peer, for logs.
    fn peer(self) -> &'static str {
        match self {
            Self::Frontend => "frontend",
            Self::Agent => "agent",
        }
    }
}

/// Reads `inbound` until the peer ends it, it fails, or `gone` resolves
/// (the stream was ended inside the server, or its response was dropped;
/// shutdown ends it too). `route` hands a packet to the hub and returns the
/// wait it needs, which holds up this stream only. A message over the size
/// limit fails the stream with RESOURCE_EXHAUSTED, as grpc-go does.
pub(crate) async fn read<G: Future<Output = ()>>(
    side: Side,
    mut inbound: Streaming<Packet>,
    hub: &Hub,
    end: &StreamEnd,
    gone: impl Fn() -> G,
    route: impl Fn(&Hub, Packet) -> Option<Work>,
) {
    let metrics = &hub.metrics;
    loop {
        let packet = tokio::select! {
            () = gone() => return,
            packet = inbound.message() => packet,
        };
        match packet {
            Ok(Some(packet)) => {
                metrics.packet(side.segment(), &packet);
                let Some(work) = route(hub, packet) else {
                    continue;
                };
                let waited = when_blocked(hub.run(work), || metrics.blocked(side.method()));
                tokio::select! {
                    () = gone() => return,
                    () = waited => {}
                }
            }
            Ok(None) => return,
            Err(status) => {
                let status = receive_error(status);
                metrics.stream_error(side.segment(), status.code());
                debug!(error = %status, "{} stream failed", side.peer());
                if status.code() == tonic::Code::ResourceExhausted {
                    warn!(error = %status.message(), "{} sent a message over the limit; closing its stream", side.peer());
                    end.fail(status);
                }
                return;
            }
        }
    }
}

/// A receive error as grpc-go reports it: tonic refuses a message over
/// the 4 MiB limit with `OUT_OF_RANGE`, grpc-go (and so ANP) with
/// `RESOURCE_EXHAUSTED`, which is what the peer and the metrics get.
fn receive_error(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange
        && status
            .message()
            .starts_with("Error, decoded message length too large")
    {
        Status::resource_exhausted(format!(
            "grpc: received message larger than max ({})",
            status.message()
        ))
    } else {
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversize_message_is_resource_exhausted_as_in_grpc_go() {
        let tonic_says = Status::out_of_range(
            "Error, decoded message length too large: found 4194305 bytes, the limit is: 4194304 bytes",
        );
        let status = receive_error(tonic_says);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("found 4194305 bytes"), "{status}");
        let other = receive_error(Status::unavailable("gone"));
        assert_eq!(other.code(), tonic::Code::Unavailable);
    }
}
