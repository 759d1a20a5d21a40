//! Request bodies held shut until their stream is admitted: data before
//! [`Gate::open`] is an error, not something to keep.
//!
//! HTTP/2 lets a client send a stream's data as soon as its headers, up to
//! the windows ([`crate::h2`]: 4 MiB a stream, 8 MiB a connection), and
//! keeps what the server has not read. A stream waiting for its admission
//! (an agent's token review, seconds at worst) would hold that much for as
//! long; a client that needs no certificate can open many. With the gate,
//! the handler reads the body while it decides ([`Gate`] in the request's
//! extensions), and the first data frame ends the wait with an error: the
//! stream then holds nothing, and the data HTTP/2 had buffered goes with it.
//! Clients that wait for the server's headers before sending (agents, ours
//! and ANP's) never notice. Only data counts: an empty frame or the end of
//! the body passes.
//!
//! [`GateLayer`] wraps every request body of a tonic server in a
//! [`GatedBody`] and puts its [`Gate`] in the request's extensions.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, ready},
};

use hyper::body::{Body, Frame, SizeHint};

/// What a gated body's data before [`Gate::open`] becomes.
pub const EARLY_DATA: &str = "the peer sent data before it was admitted";

/// Opens a [`GatedBody`]: once its stream is admitted, data passes.
#[derive(Clone, Debug, Default)]
pub struct Gate(Arc<AtomicBool>);

impl Gate {
    /// Lets the body's data through from now on.
    pub fn open(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// A request body whose data is an error ([`EARLY_DATA`], gRPC
/// `InvalidArgument`) until its [`Gate`] is open.
#[derive(Debug)]
pub struct GatedBody {
    /// The body.
    inner: tonic::body::Body,
    /// Opened by the handler.
    gate: Gate,
    /// The gate was seen open (no more atomic loads).
    open: bool,
}

impl GatedBody {
    /// `inner`, shut until `gate` opens.
    pub fn new(inner: tonic::body::Body, gate: Gate) -> Self {
        Self {
            inner,
            gate,
            open: false,
        }
    }
}

impl Body for GatedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if !this.open && this.gate.0.load(Ordering::Acquire) {
            this.open = true;
        }
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if !this.open
            && let Some(Ok(frame)) = &frame
            && frame.data_ref().is_some_and(|data| !data.is_empty())
        {
            return Poll::Ready(Some(Err(tonic::Status::invalid_argument(EARLY_DATA))));
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Gates every request body of the service it wraps ([`Gated`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct GateLayer;

impl<S> tower::Layer<S> for GateLayer {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Gated(inner)
    }
}

/// A service whose requests come with their body gated and its [`Gate`]
/// in their extensions.
#[derive(Clone, Debug)]
pub struct Gated<S>(S);

impl<S> tower::Service<hyper::Request<tonic::body::Body>> for Gated<S>
where
    S: tower::Service<hyper::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: hyper::Request<tonic::body::Body>) -> Self::Future {
        let gate = Gate::default();
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert(gate.clone());
        let body = tonic::body::Body::new(GatedBody::new(body, gate));
        self.0.call(hyper::Request::from_parts(parts, body))
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    /// A body of these frames, then its end.
    fn body(frames: Vec<Frame<bytes::Bytes>>) -> tonic::body::Body {
        let frames = frames.into_iter().map(Ok::<_, tonic::Status>);
        tonic::body::Body::new(StreamBody::new(futures_util::stream::iter(frames)))
    }

    #[tokio::test]
    async fn data_before_the_gate_opens_is_an_error() {
        let gate = Gate::default();
        let mut gated = GatedBody::new(
            body(vec![Frame::data(bytes::Bytes::from_static(b"early"))]),
            gate.clone(),
        );
        let error = gated.frame().await.unwrap().unwrap_err();
        assert_eq!(error.code(), tonic::Code::InvalidArgument);
        assert_eq!(error.message(), EARLY_DATA);
    }

    #[tokio::test]
    async fn empty_frames_and_the_end_pass_and_data_passes_once_open() {
        let gate = Gate::default();
        let mut gated = GatedBody::new(
            body(vec![
                Frame::data(bytes::Bytes::new()),
                Frame::data(bytes::Bytes::from_static(b"late")),
            ]),
            gate.clone(),
        );
        let empty = gated.frame().await.unwrap().unwrap();
        assert_eq!(empty.into_data().unwrap().len(), 0);
        gate.open();
        let late = gated.frame().await.unwrap().unwrap();
        assert_eq!(late.into_data().unwrap(), "late");
        assert!(gated.frame().await.is_none());
    }
}
