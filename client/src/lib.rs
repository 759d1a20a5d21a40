//! The frontend side of proxy-server, apart from the server as ANP keeps
//! `konnectivity-client` apart: dialing a node-side address through the
//! tunnel as kube-apiserver does, and the operator's `proxy-client` tool
//! built on it.
//!
//! # Layout
//! - [`dial`]: a `ProxyService/Proxy` stream or a `CONNECT` per dial, over
//!   the Unix socket or mTLS TCP.
//! - [`tool`]: `proxy-client`'s commands (request, SOCKS5 and HTTP proxy).

pub mod dial;
pub mod tool;
