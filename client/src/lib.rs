//! The frontend side of proxy-server, apart from the server as ANP keeps
//! `konnectivity-client` apart: dialing a node-side address through the
//! tunnel as kube-apiserver does. The operator's `proxy-client` tool is
//! built on it (crate `proxy-client`).
//!
//! # Layout
//! - [`dial`]: a `ProxyService/Proxy` stream or a `CONNECT` per dial, over
//!   the Unix socket or mTLS TCP.

pub mod dial;
