//! The frontend transports: kube-apiserver's side of the server.
//!
//! - [`grpc`]: `ProxyService/Proxy` streams (konnectivity-client).
//! - [`http_connect`]: `CONNECT host:port HTTP/1.1` (`--mode=http-connect`).
//! - [`authority`]: lets any `:authority` through to h2 on the Unix socket.

pub(crate) mod authority;
pub(crate) mod grpc;
pub(crate) mod http_connect;
