//! Where `proxy-server`, `proxy-agent` and their clients meet the network:
//! listeners, TLS accept and its admission, HTTP/2 settings and channels
//! over a connection already made, egress proxies, I/O wrappers. No packet
//! and no flow control (those are `tunnel`'s), no flags and no telemetry
//! (those are `ops`'s).
//!
//! # Layout
//! - [`listen`]: binding listeners; accepting TCP, and TLS for tonic
//!   without letting one peer hold up the others.
//! - [`admission`]: how many connections a TLS listener holds before
//!   their handshakes end, in which order it works on them, and which it
//!   drops at the cap.
//! - [`h2`]: HTTP/2 frame size, windows and keepalive as both binaries set
//!   them; a gRPC channel over a connection already made.
//! - [`gate`]: request bodies whose data is an error until their stream is
//!   admitted, so that a stream waiting for admission holds none.
//! - [`read_ahead`]: up to 64 KiB per read system call under TLS, no
//!   buffer while idle.
//! - [`egress`]: reaching the server through SOCKS5/HTTP proxies.
//! - [`io`]: the `Io` trait; forwarding the I/O of wrappers (macros).

pub mod admission;
pub mod egress;
pub mod gate;
pub mod h2;
pub mod io;
pub mod listen;
pub mod read_ahead;
