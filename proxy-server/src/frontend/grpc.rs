//! The `ProxyService/Proxy` handler and its driver: one call is one
//! frontend stream.
//!
//! The driver ([`FrontendDriver`]) reads the frontend's packets and owns
//! the table of the stream's connections (connect id → [`Conn`](crate::conn::Conn)),
//! which the agent streams that establish them hand over
//! ([`Attachments`](crate::conn::Attachments)). DATA goes to its
//! connection's agent without any lock another stream takes, waiting only
//! for that connection's credit and its agent's queue; everything else
//! goes to the control core. While uploads wait, the driver reads on into
//! a bounded read-ahead ([`lanes`](super::lanes)), so that one
//! connection whose destination stopped reading does not stop the others
//! on the stream; what the read-ahead holds is taken from the process-wide
//! buffer budget ([`Account`]), and the stream stops reading while it waits
//! for room there. tonic drains the stream's outbound queue, each item
//! taken releasing its window ([`FrontendWriter`]).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt, stream::FuturesUnordered};
use proto::{Packet, proxy_service_server::ProxyService};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug_span, warn};
use tunnel::{budget::Account, ids::ConnId};

use crate::{
    conn::{Conn, ConnTable, FrontendLink, FrontendTx, FrontendWriter, Lookup, frontend_queue},
    control::{Control, Work},
    events::Limit,
    frontend::{
        FrontendGuard,
        lanes::{Lanes, Next, UPLOAD_GRACE},
    },
    metrics::{BlockedGuard, Method, Segment},
    router::FrontendKind,
    stream::{PacketStream, StreamEnd, next_packet, spawn_driver},
    traces::FrontendPeer,
};

/// Serves `ProxyService`.
pub(crate) struct ProxyServiceImpl {
    /// The control core.
    pub(crate) control: Arc<Control>,
    /// Tracker of the drivers.
    pub(crate) tasks: TaskTracker,
    /// Stops every driver.
    pub(crate) shutdown: CancellationToken,
}

#[tonic::async_trait]
impl ProxyService for ProxyServiceImpl {
    type ProxyStream = PacketStream;

    async fn proxy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<PacketStream>, Status> {
        let traceparent = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let peer = request
            .remote_addr()
            .map(|addr| addr.to_string())
            .unwrap_or_default();
        let subject =
            crate::frontend::client_subject(request.peer_certs().as_deref().map(Vec::as_slice));
        let mut inbound = request.into_inner();
        let (tx, rx) = frontend_queue();
        let end = StreamEnd::new(self.shutdown.child_token());
        let metrics = self.control.metrics.clone();
        let budget = self.control.budgets.to_frontend.clone();
        let link = self.control.add_frontend(FrontendKind::Grpc, |id| {
            FrontendTx::new(
                id,
                FrontendKind::Grpc,
                tx,
                end.clone(),
                metrics.clone(),
                budget,
            )
        });
        let writer = FrontendWriter::new(&link.tx, rx);
        // Ended from inside (shutdown, a failure), the stream's status waits
        // until its client has registered the connections just answered
        // (`conn::ANSWER_GRACE`): once it sees the end, konnectivity-client
        // closes the connections it has registered, and a request on one
        // it registers after would wait for ever.
        let last_answer = writer.last_answer();
        self.control.frontend_traced(
            link.id(),
            traceparent.as_deref(),
            FrontendPeer {
                kind: FrontendKind::Grpc,
                peer,
                subject,
            },
        );
        let live = metrics.grpc_stream(Method::Proxy);
        let span = debug_span!("frontend", frontend = %link.id());
        let taker = link.id().taker();
        let mut driver = FrontendDriver::new(link.clone(), self.control.clone());
        let guard = FrontendGuard {
            control: self.control.clone(),
            link,
        };
        Ok(Response::new(spawn_driver(
            &self.tasks,
            &self.control.audit,
            taker,
            span,
            // The driver and its stream live here and are lent to `run`:
            // moved into it, each would take its room twice in the task.
            async move {
                let _live = live;
                let _guard = guard;
                driver.run(&mut inbound).await;
                // Gone before the guards, as when `run` took them.
                drop(driver);
                drop(inbound);
            },
            end.outbound_after(writer, async move { last_answer.fresh_until().await }),
        )))
    }
}

/// How often a stream stopped for its read-ahead, with a lane stalled past
/// the grace that may not be cut yet, looks again: whether it carries
/// others now (a dial may have completed), whether the buffer budget
/// filled. A stream that reads on looks again after [`UPLOAD_GRACE`].
const STOPPED_RECHECK: Duration = Duration::from_secs(1);

/// A wait the driver runs beside reading its stream.
type Wait = Pin<Box<dyn Future<Output = Waited> + Send>>;

/// What a wait ended with.
enum Waited {
    /// A chunk of `conn`'s DATA went to its agent (`true`) or the
    /// connection is gone (`false`).
    Uploaded(ConnId, bool),
    /// A dial went to its agent (or failed).
    Forwarded,
}

/// A wait for room in the buffer budget: the bytes it waits for.
type Owed = Pin<Box<dyn Future<Output = usize> + Send>>;

/// One frontend stream's driver; see the module documentation.
struct FrontendDriver {
    /// The stream.
    link: FrontendLink,
    /// The control core.
    control: Arc<Control>,
    /// The stream's established connections.
    conns: ConnTable,
    /// DATA read and not yet uploaded, by connection.
    ahead: Lanes,
    /// What the read-ahead took from the buffer budget: its cost, once
    /// settled; all of it goes back when the driver ends.
    account: Account,
    /// The wait for what the read-ahead holds beyond what it took, while
    /// the budget is full: the stream is not read meanwhile.
    owed: Option<Owed>,
    /// Uploads and dials waiting for their agent.
    waits: FuturesUnordered<Wait>,
    /// Counts the stream as blocked while the read-ahead is full.
    blocked: Option<BlockedGuard>,
}

impl FrontendDriver {
    fn new(link: FrontendLink, control: Arc<Control>) -> Self {
        let account = Account::new(control.budgets.read_ahead.clone());
        Self {
            link,
            control,
            conns: ConnTable::default(),
            ahead: Lanes::default(),
            account,
            owed: None,
            waits: FuturesUnordered::new(),
            blocked: None,
        }
    }

    /// Reads the frontend's packets until it ends the stream, the stream
    /// fails, is ended inside the server (shutdown included) or its
    /// response is dropped; every wait is raced against that end. Reading
    /// stops while the read-ahead is full. After the frontend ends its
    /// side, what it sent before is still uploaded.
    async fn run(&mut self, inbound: &mut Streaming<Packet>) {
        let tx = self.link.tx.clone();
        let gone = tx.gone();
        tokio::pin!(gone);
        let metrics = self.control.metrics.clone();
        let mut reading = true;
        // The select below races `gone` itself.
        let mut never = std::pin::pin!(std::future::pending::<()>());
        loop {
            self.settle();
            let full = !self.ahead.has_room() || self.owed.is_some();
            if full != self.blocked.is_some() {
                self.blocked = full.then(|| metrics.blocked(Method::Proxy));
            }
            if !reading && self.waits.is_empty() {
                return;
            }
            let cut_check = self.cut_check(full);
            tokio::select! {
                biased;
                () = &mut gone => return,
                Some(waited) = self.waits.next(), if !self.waits.is_empty() => {
                    self.waited(waited);
                }
                taken = owed(&mut self.owed), if self.owed.is_some() => {
                    self.owed = None;
                    self.account.taken_more(taken);
                }
                packet = next_packet(
                    inbound,
                    never.as_mut(),
                    Segment::FromClient,
                    &tx.end,
                    &metrics,
                ), if reading && !full => match packet {
                    Some(packet) => self.handle(packet),
                    None => reading = false,
                },
                () = sleep_until(cut_check), if cut_check.is_some() => self.cut_stalled(full),
            }
        }
    }

    /// Brings what the read-ahead took from the buffer budget to what it
    /// holds: gives back what it no longer holds; takes what it holds more,
    /// or, with the budget full, waits for it (in order of arrival, the
    /// stream not read meanwhile). A wait that is no longer needed is
    /// dropped (its place passes on).
    fn settle(&mut self) {
        let owed = self.account.settle(self.ahead.cost());
        if owed == 0 {
            self.owed = None;
        } else if self.owed.is_none() {
            let budget = self.account.budget().clone();
            if budget.first_wait() {
                warn!(frontend = %self.link.id(), held = budget.held(), "the buffer budget for read-ahead is full: frontend streams stop reading until it has room (--buffer-budget-bytes; logged once, counted in limit_reached_total)");
            }
            self.control.metrics.limit_reached(Limit::BufferBudget);
            self.owed = Some(Box::pin(async move {
                budget.take(owed).await;
                owed
            }));
        }
    }

    /// When a lane may have to be cut: the end of the most stalled lane's
    /// grace (once that has passed, now if it may be cut, see
    /// [`FrontendDriver::may_cut`], else at the next recheck); the end of
    /// the grace of the most stalled lane holding a CLOSE_REQ.
    fn cut_check(&mut self, full: bool) -> Option<Instant> {
        let now = Instant::now();
        let stalled = match self.ahead.most_stalled() {
            None => None,
            Some((_, since)) if since + UPLOAD_GRACE > now => Some(since + UPLOAD_GRACE),
            Some(_) if self.may_cut(full) => Some(now),
            // Not reading: whether it carries others now. Reading: whether
            // the budget filled (rarely, so that thousands of streams with
            // a stalled lane do not wake every second).
            Some(_) if full => Some(now + STOPPED_RECHECK),
            Some(_) => Some(now + UPLOAD_GRACE),
        };
        let closing = self
            .ahead
            .most_stalled_closing()
            .map(|(_, since)| since + UPLOAD_GRACE);
        stalled.into_iter().chain(closing).min()
    }

    /// Whether a lane stalled past the grace may be cut: the buffer budget
    /// is full (what it holds is what other streams wait for), or the
    /// stream stopped reading for it and carries other connections.
    fn may_cut(&mut self, full: bool) -> bool {
        self.owed.is_some() || self.account.budget().is_full() || (full && self.carries_others())
    }

    /// Whether the stream carries more than one open connection.
    fn carries_others(&mut self) -> bool {
        self.take_attachments();
        self.conns.open_count() > 1
    }

    /// Handles one packet: DATA into its connection's lane (or straight to
    /// its agent), a CLOSE_REQ behind its connection's DATA, the rest to
    /// the control core.
    fn handle(&mut self, packet: Packet) {
        // Connections established since the last packet: the frontend may
        // use them from now on.
        self.take_attachments();
        match &packet.payload {
            Some(proto::Payload::Data(data)) if packet.r#type == proto::PacketType::Data as i32 => {
                let id = ConnId(data.connect_id);
                match self.conns.lookup(id) {
                    Lookup::Open(conn) => {
                        conn.named_by_frontend();
                        return self.data(packet, conn);
                    }
                    // Sent before the frontend learnt of the close, or after
                    // the connection was cut: dropped (its CLOSE_RSP, if
                    // held, goes now).
                    Lookup::Closed(conn) => return conn.named_by_frontend(),
                    Lookup::Unknown if id.0 == 0 => return,
                    Lookup::Unknown => {}
                }
            }
            Some(proto::Payload::CloseRequest(close))
                if packet.r#type == proto::PacketType::CloseReq as i32 =>
            {
                let id = ConnId(close.connect_id);
                if let Lookup::Open(conn) | Lookup::Closed(conn) = self.conns.lookup(id) {
                    conn.named_by_frontend();
                }
                let Some(packet) = self.ahead.close(id, packet) else {
                    // Behind the connection's DATA.
                    return;
                };
                return self.control_packet(packet);
            }
            _ => {}
        }
        self.control_packet(packet);
    }

    fn take_attachments(&mut self) {
        for conn in self.link.attachments.take() {
            self.conns.insert(conn);
        }
    }

    /// A packet for the control core, and the waits it needs.
    fn control_packet(&mut self, packet: Packet) {
        for work in self.control.frontend_packet(self.link.id(), packet) {
            match work {
                // DATA for a connection this driver did not have yet.
                Work::Upload { conn, data } => {
                    conn.named_by_frontend();
                    self.conns.insert(conn.clone());
                    self.data(Packet::data(conn.id.0, data), conn);
                }
                work => {
                    let control = self.control.clone();
                    self.waits.push(Box::pin(async move {
                        control.run(work).await;
                        Waited::Forwarded
                    }));
                }
            }
        }
    }

    /// DATA of `conn`: behind its lane if it has one, else straight to its
    /// agent, chunk by chunk while nothing waits; what must wait opens its
    /// lane.
    fn data(&mut self, packet: Packet, conn: Arc<Conn>) {
        let Some(proto::Payload::Data(data)) = packet.payload else {
            return;
        };
        let data = data.data;
        if data.is_empty() {
            // Carries nothing: dropped before the lanes, where it could
            // only stand in the way of what follows it.
            return;
        }
        conn.count_upload(data.len());
        if self.ahead.has_lane(conn.id) {
            self.ahead.queue(conn.id, data);
            return;
        }
        let mut chunks = conn.flow.chunks(data);
        while let Some(piece) = chunks.next() {
            let len = piece.len();
            let mut upload = upload(conn.clone(), piece);
            match upload.as_mut().now_or_never() {
                Some(Waited::Uploaded(_, true)) => {}
                // The connection is gone: the rest is dropped.
                Some(_) => return,
                None => {
                    self.ahead.open(conn, len, chunks.rest(), Instant::now());
                    self.waits.push(upload);
                    return;
                }
            }
        }
    }

    /// A wait ended: a lane's next chunk or CLOSE_REQ.
    fn waited(&mut self, waited: Waited) {
        let Waited::Uploaded(id, ok) = waited else {
            return;
        };
        match self.ahead.uploaded(id, ok, Instant::now()) {
            None => {}
            Some(Next::Upload(conn, chunk)) => self.waits.push(upload(conn, chunk)),
            Some(Next::Close(packet)) => self.control_packet(packet),
        }
    }

    /// Cuts a lane that made no progress for [`UPLOAD_GRACE`] and holds
    /// the frontend's CLOSE_REQ, or, when a stalled lane may be cut (see
    /// [`FrontendDriver::may_cut`]), the one stalled longest, so that the
    /// stream reads on and the budget gets its bytes back.
    fn cut_stalled(&mut self, full: bool) {
        let now = Instant::now();
        let past_grace =
            |(id, since): (ConnId, Instant)| (since + UPLOAD_GRACE <= now).then_some(id);
        let mut stalled = self.ahead.most_stalled_closing().and_then(past_grace);
        if stalled.is_none() && self.may_cut(full) {
            stalled = self.ahead.most_stalled().and_then(past_grace);
        }
        let Some((conn, close)) = stalled.and_then(|id| self.ahead.cut(id)) else {
            return;
        };
        warn!(conn.id = %conn.id, "connection closed: its destination took none of its upload for {UPLOAD_GRACE:?} while it held up its stream, its close or the buffer budget");
        self.control.upload_stalled(&conn);
        if let Some(close) = close {
            self.control_packet(close);
        }
    }
}

/// Waits for the budget the read-ahead owes (never, for `None`); the bytes
/// taken.
async fn owed(owed: &mut Option<Owed>) -> usize {
    match owed {
        Some(wait) => wait.await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at` (never, for `None`).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Uploads one chunk of `conn`'s DATA; ends with the connection.
fn upload(conn: Arc<Conn>, chunk: Bytes) -> Wait {
    Box::pin(async move {
        let ok = conn.upload_chunk(chunk).await;
        Waited::Uploaded(conn.id, ok)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing::streams;

    #[test]
    fn a_frontends_driver_borrows_its_stream() {
        let control = streams::control();
        let (tx, _rx) = frontend_queue();
        let link = control.add_frontend(FrontendKind::Grpc, |id| {
            FrontendTx::new(
                id,
                FrontendKind::Grpc,
                tx,
                StreamEnd::new(CancellationToken::new()),
                control.metrics.clone(),
                control.budgets.to_frontend.clone(),
            )
        });
        let mut driver = FrontendDriver::new(link, control.clone());
        let (_sender, body) = streams::body();
        let mut inbound = streams::streaming(body);
        let run = driver.run(&mut inbound);
        // Taking the driver and its stream by value, it held each twice
        // (1,696 bytes), and the task that awaited it a third time.
        let size = std::mem::size_of_val(&run);
        assert!(size < 1000, "a frontend's driver is {size} bytes");
    }
}
