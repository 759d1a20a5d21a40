//! gRPC metadata keys of the `AgentService/Connect` handshake.
//!
//! gRPC lower-cases keys on the wire, so these are the lower-case forms of
//! ANP's `agentID`, `agentIdentifiers`, `serverID`, `serverCount`.

/// Agent → server request metadata: the agent's id; exactly one value.
pub const AGENT_ID: &str = "agentid";
/// Agent → server request metadata: URL query string of identifiers
/// (`host=a&ipv4=1.2.3.4&cidr=10.0.0.0/8&default-route=true`); at most one value.
pub const AGENT_IDENTIFIERS: &str = "agentidentifiers";
/// Agent → server request metadata: `Bearer <token>` for service-account auth.
pub const AUTHORIZATION: &str = "authorization";
/// Server → agent response header: the server's id; exactly one value.
pub const SERVER_ID: &str = "serverid";
/// Server → agent response header: decimal number of server replicas.
pub const SERVER_COUNT: &str = "servercount";
/// Prefix of the `authorization` value.
pub const BEARER_PREFIX: &str = "Bearer ";
