//! An established connection ([`Conn`]) and the frontend side of the
//! streams it joins.
//!
//! A `Conn` joins one frontend stream to one agent stream: its flow state
//! (`tunnel::flow::Flow`: the window towards the frontend, the credit
//! towards the agent, the stall clock), the agent stream's outbound queue
//! and the frontend's. Both streams' drivers hold it in their own tables,
//! so DATA moves between them through it without any lock another stream
//! takes: the frontend's driver uploads through [`Conn::upload`], the
//! agent stream's driver delivers through [`Conn::deliver`], and the
//! frontend's writer returns the window and credit with
//! [`FrontendItem::taken`]. The control core (`control`) makes it when the
//! router opens the connection and closes it when the router closes it;
//! every wait on its behalf then ends.
//!
//! The sending side of both streams a connection joins is here too:
//! [`BackendLink`] is an agent stream's outbound queue; [`FrontendTx`] is
//! a frontend stream's, and [`FrontendLink`] adds the [`Attachments`]
//! through which the agent stream that established a connection hands it
//! to the frontend's driver.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use proto::Packet;
use tonic::Status;
use tracing::warn;
use tunnel::{
    budget::{Account, Budget},
    flow::{self, Flow, Offer, Refused, Scheme},
    ids::{AgentId, ConnId, DialId},
    queue::{self, Closed, QueueRx, QueueTx, Unread},
};

use crate::{
    events::{DialError, Limit},
    ids::{BackendId, FrontendId},
    metrics::{Direction, Segment, ServerMetrics},
    router::FrontendKind,
    stream::StreamEnd,
};

/// Room for control packets beyond `--max-agent-queue-bytes`: past it the
/// agent has stopped reading.
pub(crate) const BACKEND_CONTROL_RESERVE: usize = 1024 * 1024;

/// Control packets (DIAL_RSP, CLOSE_RSP, DIAL_CLS) a frontend may leave
/// unread before its stream is ended: a frontend that keeps dialing
/// without reading its answers is broken, and must not make the server
/// hold its answers without bound.
pub(crate) const FRONTEND_CONTROL_RESERVE: usize = 256 * 1024;

/// An established connection; see the module documentation.
pub(crate) struct Conn {
    /// The agent-assigned id.
    pub(crate) id: ConnId,
    /// The agent stream it runs over.
    pub(crate) backend: BackendId,
    /// Its flow state in both directions.
    pub(crate) flow: Flow,
    /// Where its DATA and its credit go.
    agent: BackendLink,
    /// Where the agent's DATA goes.
    to_frontend: FrontendTx,
    /// Its agent's DATA on the frontend's queue, and what that took from
    /// the buffer budget (taken by its two streams: the agent's driver
    /// queues, the frontend's writer takes).
    charged: tunnel::sync::Mutex<Charged>,
    /// Payload bytes carried (to the agent, to the frontend), for the
    /// tunnel's span at its end; touched only by its two streams.
    bytes: [AtomicU64; 2],
    /// Whether the frontend has named the connection (DATA, CLOSE_REQ):
    /// it knows it, so its CLOSE_RSP need not wait ([`FrontendWriter`],
    /// which keeps the flag past the connection).
    named: Arc<AtomicBool>,
    /// When it opened (its DIAL_RSP was queued right after).
    opened: tokio::time::Instant,
}

/// A connection's agent DATA queued for its frontend, and what it took
/// from the buffer budget: at least what is queued, given back down to it
/// once the account holds more than twice that (or anything, with nothing
/// queued), so that the shared budget is touched about once per doubling
/// or halving of the queue, not per packet, and an idle connection holds
/// none of it.
struct Charged {
    /// Cost of the DATA queued.
    queued: usize,
    /// What it took.
    account: Account,
}

/// Why agent DATA was not queued towards the frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Queued.
    Queued,
    /// No room yet: the agent has no credit, wait with [`Conn::deliver_wait`].
    Wait,
    /// Within the window, but the buffer budget is full: wait with
    /// [`Conn::deliver_wait`], `admitted`.
    NoBudget,
    /// The frontend fell a window behind, or the budget stayed full for
    /// `flow::COMPAT_STALL`: close the connection.
    Overflow,
    /// The connection or its frontend is gone.
    Gone,
}

impl Conn {
    /// A connection over `agent` to `frontend`, flowing as `agent`'s stream
    /// negotiated.
    pub(crate) fn new(
        id: ConnId,
        backend: BackendId,
        agent: BackendLink,
        to_frontend: FrontendTx,
    ) -> Self {
        let charged = tunnel::sync::Mutex::new(Charged {
            queued: 0,
            account: Account::new(to_frontend.budget.clone()),
        });
        Self {
            id,
            backend,
            flow: Flow::new(agent.scheme),
            agent,
            to_frontend,
            charged,
            bytes: [AtomicU64::new(0), AtomicU64::new(0)],
            named: Arc::new(AtomicBool::new(false)),
            opened: tokio::time::Instant::now(),
        }
    }

    /// Payload bytes it carried: to the agent, to the frontend.
    pub(crate) fn bytes(&self) -> (u64, u64) {
        (
            self.bytes[0].load(Ordering::Relaxed),
            self.bytes[1].load(Ordering::Relaxed),
        )
    }

    /// Whether its frontend is an HTTP-CONNECT client.
    pub(crate) fn to_http_connect(&self) -> bool {
        self.to_frontend.kind == FrontendKind::HttpConnect
    }

    /// Sends frontend DATA to the agent in pieces of the agent's chunk,
    /// each waiting for credit and for room on the agent's queue; every
    /// wait ends when the connection closes (this holds up only the
    /// frontend's own stream). `false` once the connection or the agent's
    /// stream is gone.
    pub(crate) async fn upload(&self, data: Bytes) -> bool {
        self.count_upload(data.len());
        for piece in self.flow.chunks(data) {
            if !self.upload_chunk(piece).await {
                return false;
            }
        }
        true
    }

    /// Counts `len` bytes of frontend DATA on their way to the agent.
    pub(crate) fn count_upload(&self, len: usize) {
        self.bytes[0].fetch_add(len as u64, Ordering::Relaxed);
        self.to_frontend
            .metrics
            .bytes
            .get(Direction::ToAgent)
            .inc_by(len as f64);
    }

    /// Sends one piece of frontend DATA (at most the agent's chunk) to the
    /// agent, waiting for credit and for room on the agent's queue; the
    /// wait ends when the connection closes. `false` once the connection
    /// or the agent's stream is gone.
    ///
    /// # Cancel safety
    /// Not cancel safe: credit taken for a piece dropped while it waits
    /// for room is lost. Run it to completion (it ends with the
    /// connection).
    pub(crate) async fn upload_chunk(&self, piece: Bytes) -> bool {
        let sent = async {
            self.flow.take(flow::cost(piece.len())).await.is_ok()
                && self
                    .agent
                    .send(Packet::data(self.id.0, piece))
                    .await
                    .is_ok()
        };
        tokio::select! {
            () = self.flow.closed() => false,
            sent = sent => sent,
        }
    }

    /// Queues agent DATA for the frontend without waiting: with credit the
    /// agent stays within the window, so this never waits for the window
    /// (past it is [`Delivery::Overflow`]); without, a full window is
    /// [`Delivery::Wait`]. What it queues is taken from the buffer budget
    /// ([`Charged`]); with the budget full it is [`Delivery::NoBudget`].
    pub(crate) fn deliver(self: &Arc<Self>, data: &Bytes) -> Delivery {
        let cost = flow::cost(data.len());
        match self.flow.offer(cost) {
            Offer::Admitted => match self.charge(cost) {
                Ok(()) => self.push(data.clone(), cost),
                Err(_) => Delivery::NoBudget,
            },
            Offer::Wait(_) => Delivery::Wait,
            Offer::Overflow => Delivery::Overflow,
            Offer::Closed => Delivery::Gone,
        }
    }

    /// Queues agent DATA for the frontend, waiting while the frontend
    /// drains (an agent without credit; not if the window already
    /// `admitted` it), up to `flow::COMPAT_STALL` without progress, then
    /// for the buffer budget, up to `flow::COMPAT_STALL` too; the waits end
    /// when the connection closes.
    pub(crate) async fn deliver_wait(self: &Arc<Self>, data: Bytes, admitted: bool) -> Delivery {
        let cost = flow::cost(data.len());
        if !admitted {
            match self.flow.admit(cost).await {
                Ok(()) => {}
                Err(Refused::Overflow) => return Delivery::Overflow,
                Err(Refused::Closed) => return Delivery::Gone,
            }
        }
        if let Err(owed) = self.charge(cost) {
            if let Err(delivery) = self.wait_for_budget(owed).await {
                return delivery;
            }
            let mut charged = self.charged.lock();
            charged.account.taken_more(owed);
            charged.queued += cost;
        }
        self.push(data, cost)
    }

    /// Counts `cost` more DATA queued for the frontend, taking what its
    /// account lacks from the buffer budget; what it lacks if the budget is
    /// full (nothing taken).
    fn charge(&self, cost: usize) -> Result<(), usize> {
        let mut charged = self.charged.lock();
        let want = charged.queued + cost;
        if want > charged.account.taken() {
            let owed = charged.account.settle(want);
            if owed > 0 {
                return Err(owed);
            }
        }
        charged.queued = want;
        Ok(())
    }

    /// `cost` of this connection's DATA left the frontend's queue (taken,
    /// or dropped with it): the account gives back down to what is still
    /// queued once it holds more than twice that.
    fn uncharge(&self, cost: usize) {
        let mut charged = self.charged.lock();
        charged.queued -= cost;
        let queued = charged.queued;
        if queued == 0 || charged.account.taken() > 2 * queued {
            charged.account.settle(queued);
        }
    }

    /// Waits, behind the others, for `owed` of the buffer budget, up to
    /// `flow::COMPAT_STALL` ([`Delivery::Overflow`] after), or until the
    /// connection closes ([`Delivery::Gone`]); the caller adds it to the
    /// connection's account.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is taken if the future is dropped.
    async fn wait_for_budget(&self, owed: usize) -> Result<(), Delivery> {
        let budget = &self.to_frontend.budget;
        if budget.first_wait() {
            warn!(conn.id = %self.id, held = budget.held(), "the buffer budget for agents' DATA is full: agent streams wait until it has room (--buffer-budget-bytes; logged once, counted in limit_reached_total)");
        }
        self.to_frontend.metrics.limit_reached(Limit::BufferBudget);
        tokio::select! {
            biased;
            () = self.flow.closed() => Err(Delivery::Gone),
            () = budget.take(owed) => Ok(()),
            () = tokio::time::sleep(flow::COMPAT_STALL) => Err(Delivery::Overflow),
        }
    }

    /// Pushes DATA the window admitted and the budget counted onto the
    /// frontend's queue (the window, not the queue's reserve, bounds DATA).
    fn push(self: &Arc<Self>, data: Bytes, cost: usize) -> Delivery {
        self.bytes[1].fetch_add(data.len() as u64, Ordering::Relaxed);
        let metrics = &self.to_frontend.metrics;
        metrics
            .bytes
            .get(Direction::ToFrontend)
            .inc_by(data.len() as f64);
        let started = Instant::now();
        let item = FrontendItem::Data {
            packet: Packet::data(self.id.0, data),
            queued: Queued {
                conn: self.clone(),
                cost,
            },
        };
        let pushed = self.to_frontend.push(item, 0);
        metrics
            .frontend_write
            .get()
            .observe(started.elapsed().as_secs_f64());
        if pushed {
            Delivery::Queued
        } else {
            // Refused: the window gets its cost back (the budget got its
            // back with the item).
            let _ = self.flow.drained(cost);
            Delivery::Gone
        }
    }

    /// The frontend took `cost` of this connection's DATA: its window is
    /// released and, when enough has drained, credit goes to the agent.
    fn taken(&self, cost: usize) {
        if let Some(credit) = self.flow.drained(cost) {
            self.agent
                .send_control(flow::credit_packet(self.id.0, credit));
        }
    }

    /// How long the frontend has left this connection's DATA untaken.
    pub(crate) fn stalled_for(&self, now: Instant) -> Duration {
        self.flow.stalled_for(now)
    }

    /// Ends every wait on this connection's behalf.
    pub(crate) fn close(&self) {
        self.flow.close();
    }

    /// Whether the connection was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.flow.is_closed()
    }

    /// The frontend sent a packet naming this connection (DATA, CLOSE_REQ):
    /// its client has the connection, so a CLOSE_RSP its writer holds
    /// goes now ([`FrontendWriter`]). An atomic load once named.
    pub(crate) fn named_by_frontend(&self) {
        if !self.named.load(Ordering::Relaxed) && !self.named.swap(true, Ordering::AcqRel) {
            self.to_frontend.named.notify();
        }
    }

    /// Whether the frontend has named this connection.
    fn is_named(&self) -> bool {
        named(&self.named)
    }

    /// Whether the frontend's naming of this connection may still release
    /// its CLOSE_RSP: not named yet, within the grace of its DIAL_RSP.
    fn may_be_named(&self, now: tokio::time::Instant) -> bool {
        !self.is_named() && now < self.opened + ANSWER_GRACE
    }
}

/// The agent stream is gone; the packet was not sent.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("agent stream closed")]
pub(crate) struct BackendGone;

/// Where packets for one agent stream go.
#[derive(Clone)]
pub(crate) struct BackendLink {
    /// The agent's self-asserted id.
    pub(crate) agent_id: AgentId,
    /// The agent's address, if known.
    pub(crate) peer: Option<SocketAddr>,
    /// What the stream negotiated: every connection on it uses it.
    pub(crate) scheme: Scheme,
    /// Outbound packets, bounded in bytes; tonic drains the receiver into
    /// the stream.
    tx: QueueTx<Packet>,
    /// Ends the stream (agent gone, retired, shutdown, a fault).
    pub(crate) end: Arc<StreamEnd>,
    /// Where packets that cannot be sent are counted.
    metrics: Arc<ServerMetrics>,
}

impl BackendLink {
    pub(crate) fn new(
        agent_id: AgentId,
        peer: Option<SocketAddr>,
        scheme: Scheme,
        tx: QueueTx<Packet>,
        end: Arc<StreamEnd>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            agent_id,
            peer,
            scheme,
            tx,
            end,
            metrics,
        }
    }

    /// Queues a packet for the agent, waiting while the stream's queue is
    /// full (`--max-agent-queue-bytes`). For a frontend's DATA and dials,
    /// whose callers race the wait against their own end.
    ///
    /// # Cancel safety
    /// Nothing is queued if the future is dropped before it completes.
    pub(crate) async fn send(&self, packet: Packet) -> Result<(), BackendGone> {
        let cost = flow::packet_cost(&packet);
        self.tx.send(packet, cost).await.map_err(|Closed(packet)| {
            self.metrics.send_error(Segment::ToAgent, packet.r#type);
            BackendGone
        })
    }

    /// Queues a control packet without waiting: stream readers and cleanup
    /// send these and must not wait on an agent (two full queues waiting
    /// on each other would deadlock). Past the queue's reserve the agent has
    /// stopped reading its stream: the stream is ended with an error.
    pub(crate) fn send_control(&self, packet: Packet) {
        let cost = flow::packet_cost(&packet);
        self.tx.push_or_end(packet, cost, self, |packet| {
            self.metrics.send_error(Segment::ToAgent, packet.r#type);
        });
    }
}

/// Ends an agent stream that the agent does not read.
impl Unread for BackendLink {
    fn is_ended(&self) -> bool {
        self.end.is_ended()
    }

    fn end_unread(&self, queued: usize, first: bool) {
        if first {
            warn!(agent.id = %self.agent_id, queued, "agent does not read its stream; closing it");
            self.metrics.limit_reached(Limit::AgentQueue);
        }
        self.end.fail(Status::resource_exhausted(
            "the agent does not read its stream: its outbound queue is full",
        ));
    }
}

/// An item of a frontend's outbound queue.
pub(crate) enum FrontendItem {
    /// A control packet.
    Packet(Packet),
    /// A dial's successful DIAL_RSP, with the connection it opened.
    Answered {
        /// The DIAL_RSP.
        packet: Packet,
        /// The connection.
        conn: Arc<Conn>,
    },
    /// A dial failed: the server's own reason or the agent's text.
    DialFailed {
        /// The frontend's random.
        dial: DialId,
        /// Why.
        error: DialError,
    },
    /// Agent DATA of a connection, whose cost its window admitted and its
    /// account counts.
    Data {
        /// The DATA packet.
        packet: Packet,
        /// Its connection and cost, uncounted when the item is taken or
        /// dropped.
        queued: Queued,
    },
}

/// Agent DATA of `conn` on its frontend's queue: its cost leaves the
/// connection's account when this is dropped (the item taken, or dropped
/// with the queue when the stream ends).
pub(crate) struct Queued {
    /// The connection.
    pub(crate) conn: Arc<Conn>,
    /// Its cost.
    cost: usize,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.conn.uncharge(self.cost);
    }
}

impl FrontendItem {
    /// The frontend took the item: for DATA the window is released and,
    /// when enough has drained, credit returned to the agent. Its packet,
    /// as it goes on the wire.
    pub(crate) fn taken(self) -> Packet {
        match self {
            Self::Packet(packet) | Self::Answered { packet, .. } => packet,
            Self::DialFailed { dial, error } => {
                Packet::dial_response(dial.0, 0, &error.to_string())
            }
            Self::Data { packet, queued } => {
                queued.conn.taken(queued.cost);
                packet
            }
        }
    }

    /// The packet type, for the metrics.
    fn packet_type(&self) -> i32 {
        match self {
            Self::Packet(packet) | Self::Data { packet, .. } => packet.r#type,
            Self::DialFailed { .. } | Self::Answered { .. } => proto::PacketType::DialRsp as i32,
        }
    }
}

/// How long a connection's CLOSE_RSP may wait behind its DIAL_RSP on a
/// gRPC frontend's stream for the frontend to name the connection.
///
/// kube-apiserver's konnectivity-client registers a connection in the
/// goroutine that dialed it, after its receiving goroutine handed the
/// DIAL_RSP over and went on to the next packet: a CLOSE_RSP that is
/// already there is dropped as not recognized, and the request then waits
/// for ever (issue 50). So a CLOSE_RSP that would follow its DIAL_RSP
/// closely waits until the frontend names the connection (its DATA or
/// CLOSE_REQ: the client has it; kube-apiserver writes its request at
/// once), or until this long after the DIAL_RSP went out, far longer than
/// a goroutine takes to run.
pub(crate) const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// How many closed connections a frontend's writer remembers, to drop
/// their DATA queued behind their CLOSE_RSP (a race is one packet behind).
const RECENTLY_CLOSED: usize = 32;

/// What a gRPC frontend's response stream sends: the items of its queue,
/// each taken as tonic takes it for the HTTP/2 stream (which has a window
/// of its own): counted, its window released and, with credit, credit
/// returned to its agent. A CLOSE_RSP that comes within [`ANSWER_GRACE`]
/// of its connection's DIAL_RSP, before the frontend named the
/// connection, is held until it does or the grace ends; what comes behind
/// it for other connections goes on, and nothing of that connection comes
/// after its CLOSE_RSP, so every connection's packets keep their order;
/// agent DATA that raced in behind its connection's CLOSE_RSP is dropped.
pub(crate) struct FrontendWriter {
    /// The stream's queue.
    rx: QueueRx<FrontendItem>,
    /// Where taken packets are counted.
    metrics: Arc<ServerMetrics>,
    /// Notified when the frontend names a connection.
    named: Arc<tunnel::sync::Signal>,
    /// Connections answered within the grace, not yet named or closed:
    /// each one's id, whether it is named, and when its grace ends (in
    /// order). Not the connections: one holds a sender of this very queue,
    /// and may be gone when its frontend names it.
    fresh: std::collections::VecDeque<(ConnId, Arc<AtomicBool>, tokio::time::Instant)>,
    /// CLOSE_RSPs held, each with whether its connection is named and when
    /// it goes anyway.
    held: Vec<(Packet, Arc<AtomicBool>, tokio::time::Instant)>,
    /// The last connections whose CLOSE_RSP was taken: DATA of theirs that
    /// was queued behind it is dropped.
    closed: std::collections::VecDeque<ConnId>,
    /// The timer of the earliest held CLOSE_RSP.
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// When the grace of the last DIAL_RSP taken ends.
    last_answer: Arc<LastAnswer>,
}

/// When the grace ([`ANSWER_GRACE`]) of the last DIAL_RSP a gRPC
/// frontend's writer took ends: until then its client may not have
/// registered that connection, so the stream's end waits for it. One
/// atomic, written once per DIAL_RSP.
pub(crate) struct LastAnswer {
    /// What the instants count from.
    base: tokio::time::Instant,
    /// The end of the last grace, in nanoseconds from `base` (0: none).
    grace_end: AtomicU64,
}

impl LastAnswer {
    fn new() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            grace_end: AtomicU64::new(0),
        }
    }

    /// A DIAL_RSP was taken at `now`.
    fn answered(&self, now: tokio::time::Instant) {
        let end = (now + ANSWER_GRACE).saturating_duration_since(self.base);
        let nanos = u64::try_from(end.as_nanos()).unwrap_or(u64::MAX);
        self.grace_end.store(nanos, Ordering::Relaxed);
    }

    /// When the grace of the last DIAL_RSP taken ends, if that is after
    /// `now`.
    fn grace_end(&self, now: tokio::time::Instant) -> Option<tokio::time::Instant> {
        let nanos = self.grace_end.load(Ordering::Relaxed);
        let end = self.base + Duration::from_nanos(nanos);
        (nanos > 0 && end > now).then_some(end)
    }

    /// Resolves once the grace of the last DIAL_RSP taken is over (at once
    /// with none).
    pub(crate) async fn fresh_until(&self) {
        if let Some(end) = self.grace_end(tokio::time::Instant::now()) {
            tokio::time::sleep_until(end).await;
        }
    }
}

impl FrontendWriter {
    /// The writer of the frontend `tx` queues for, draining `rx`.
    pub(crate) fn new(tx: &FrontendTx, rx: QueueRx<FrontendItem>) -> Self {
        Self {
            rx,
            metrics: tx.metrics.clone(),
            named: tx.named.clone(),
            fresh: std::collections::VecDeque::new(),
            held: Vec::new(),
            closed: std::collections::VecDeque::new(),
            timer: None,
            last_answer: Arc::new(LastAnswer::new()),
        }
    }

    /// When the grace of its last DIAL_RSP ends (for its stream's end).
    pub(crate) fn last_answer(&self) -> Arc<LastAnswer> {
        self.last_answer.clone()
    }

    /// A held CLOSE_RSP that may go now: its connection named, or its
    /// grace over.
    fn release(&mut self, now: tokio::time::Instant) -> Option<Packet> {
        let at = self
            .held
            .iter()
            .position(|(_, conn, until)| named(conn) || *until <= now)?;
        Some(self.held.swap_remove(at).0)
    }

    /// An item taken from the queue: its packet, or `None` when it is a
    /// CLOSE_RSP to hold.
    fn take(&mut self, item: FrontendItem, now: tokio::time::Instant) -> Option<Packet> {
        while self
            .fresh
            .front()
            .is_some_and(|(_, conn, until)| *until <= now || named(conn))
        {
            self.fresh.pop_front();
        }
        match &item {
            FrontendItem::Answered { conn, .. } => {
                self.last_answer.answered(now);
                self.closed.retain(|id| *id != conn.id);
                let grace = now + ANSWER_GRACE;
                self.fresh.push_back((conn.id, conn.named.clone(), grace));
            }
            // Queued behind its connection's CLOSE_RSP: agent DATA pushed
            // while another stream's task closed the connection (a stalled
            // upload cut, a mismatch, the stall scan). Dropped, so that
            // nothing of a connection follows its CLOSE_RSP.
            FrontendItem::Data { queued, .. }
                if queued.conn.is_closed() && self.closed.contains(&queued.conn.id) =>
            {
                return None;
            }
            _ => {}
        }
        let packet = item.taken();
        let Some(proto::Payload::CloseResponse(close)) = &packet.payload else {
            return Some(packet);
        };
        let id = ConnId(close.connect_id);
        if self.closed.len() == RECENTLY_CLOSED {
            self.closed.pop_front();
        }
        self.closed.push_back(id);
        let Some(at) = self.fresh.iter().rposition(|(fresh, _, _)| *fresh == id) else {
            return Some(packet);
        };
        let Some((_, conn, until)) = self.fresh.remove(at) else {
            return Some(packet);
        };
        if named(&conn) || until <= now {
            return Some(packet);
        }
        self.held.push((packet, conn, until));
        None
    }

    /// Arms the timer for the earliest held CLOSE_RSP and polls it and the
    /// naming signal; ready when one of them fired.
    fn poll_held(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        use std::task::Poll;
        let Some(earliest) = self.held.iter().map(|(_, _, until)| *until).min() else {
            self.timer = None;
            return Poll::Pending;
        };
        if self.named.poll_wait(cx).is_ready() {
            return Poll::Ready(());
        }
        self.poll_timer(earliest, cx)
    }

    /// Polls the writer's one timer, set for `at`.
    fn poll_timer(
        &mut self,
        at: tokio::time::Instant,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        if timer.deadline() != at {
            timer.as_mut().reset(at);
        }
        timer.as_mut().poll(cx)
    }
}

/// Whether the frontend named the connection whose flag `named` is.
fn named(named: &AtomicBool) -> bool {
    named.load(Ordering::Acquire)
}

impl Stream for FrontendWriter {
    type Item = Packet;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Packet>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            let now = tokio::time::Instant::now();
            if let Some(packet) = this.release(now) {
                return Poll::Ready(Some(packet));
            }
            match this.rx.poll_next_unpin(cx) {
                Poll::Ready(Some(item)) => {
                    this.metrics
                        .packets
                        .count(Segment::ToClient, item.packet_type());
                    if let Some(packet) = this.take(item, now) {
                        return Poll::Ready(Some(packet));
                    }
                }
                // The stream is over: what it held goes first, and it ends
                // once the last answer's grace is over.
                Poll::Ready(None) => {
                    if let Some((packet, _, _)) = this.held.pop() {
                        return Poll::Ready(Some(packet));
                    }
                    return match this.last_answer.grace_end(now) {
                        None => Poll::Ready(None),
                        Some(at) => this.poll_timer(at, cx).map(|()| None),
                    };
                }
                Poll::Pending => match this.poll_held(cx) {
                    Poll::Ready(()) => {}
                    Poll::Pending => return Poll::Pending,
                },
            }
        }
    }
}

/// A frontend's outbound queue: nobody waits on it; DATA is admitted by its
/// connection's window and control packets up to the reserve.
pub(crate) fn frontend_queue() -> (QueueTx<FrontendItem>, QueueRx<FrontendItem>) {
    queue::queue(0, FRONTEND_CONTROL_RESERVE)
}

/// Where packets for one frontend stream go.
#[derive(Clone)]
pub(crate) struct FrontendTx {
    /// The frontend.
    pub(crate) id: FrontendId,
    /// Its protocol.
    pub(crate) kind: FrontendKind,
    /// Its outbound queue; the transport drains the receiver.
    tx: QueueTx<FrontendItem>,
    /// Ends its stream (its reader, its outbound packets), with a status.
    pub(crate) end: Arc<StreamEnd>,
    /// Where writes to the frontend are timed and lost packets counted.
    pub(crate) metrics: Arc<ServerMetrics>,
    /// The budget agents' DATA queued for frontends takes its cost from.
    budget: Arc<Budget>,
    /// Notified when the frontend names one of its connections, for its
    /// writer ([`FrontendWriter`]).
    named: Arc<tunnel::sync::Signal>,
}

impl FrontendTx {
    pub(crate) fn new(
        id: FrontendId,
        kind: FrontendKind,
        tx: QueueTx<FrontendItem>,
        end: Arc<StreamEnd>,
        metrics: Arc<ServerMetrics>,
        budget: Arc<Budget>,
    ) -> Self {
        Self {
            id,
            kind,
            tx,
            end,
            metrics,
            budget,
            named: Arc::new(tunnel::sync::Signal::new()),
        }
    }

    /// Queues a dial's successful DIAL_RSP with the connection it opened
    /// (see [`FrontendTx::send_control`]).
    pub(crate) fn answer(&self, packet: Packet, conn: Option<Arc<Conn>>) -> bool {
        let Some(conn) = conn else {
            return self.send_control(packet);
        };
        let cost = flow::packet_cost(&packet);
        self.send_item(FrontendItem::Answered { packet, conn }, cost)
    }

    /// Queues a control packet without waiting; `false` if it could not be
    /// queued. A frontend that leaves [`FRONTEND_CONTROL_RESERVE`] of them
    /// unread has its stream ended with an error.
    pub(crate) fn send_control(&self, packet: Packet) -> bool {
        let cost = flow::packet_cost(&packet);
        self.send_item(FrontendItem::Packet(packet), cost)
    }

    /// Queues the answer to a failed dial (see [`FrontendTx::send_control`]).
    pub(crate) fn dial_failed(&self, dial: DialId, error: DialError) -> bool {
        let cost = error.to_string().len() + 2 * flow::PACKET_OVERHEAD;
        self.send_item(FrontendItem::DialFailed { dial, error }, cost)
    }

    fn send_item(&self, item: FrontendItem, cost: usize) -> bool {
        let started = Instant::now();
        let pushed = self.push(item, cost);
        self.metrics
            .frontend_write
            .get()
            .observe(started.elapsed().as_secs_f64());
        pushed
    }

    /// Pushes `item` of `cost` (0 for DATA, which its window bounds);
    /// `false` if refused (the item is dropped: for DATA its window is
    /// released by the caller). A frontend past the reserve is ended.
    fn push(&self, item: FrontendItem, cost: usize) -> bool {
        self.tx
            .push_or_end(item, cost, self, |item| self.undelivered(&item))
    }

    /// Counts a packet that could not reach a gRPC frontend (its stream is
    /// gone) as ANP counts a failed `Send`.
    fn undelivered(&self, item: &FrontendItem) {
        if self.kind == FrontendKind::Grpc {
            self.metrics
                .send_error(Segment::ToClient, item.packet_type());
        }
    }

    /// Resolves once the stream is over: ended from inside the server, or
    /// its transport dropped the receiving end.
    pub(crate) async fn gone(&self) {
        tokio::select! {
            () = self.tx.closed() => {}
            () = self.end.ended() => {}
        }
    }
}

/// Ends a frontend stream that the frontend does not read.
impl Unread for FrontendTx {
    fn is_ended(&self) -> bool {
        self.end.is_ended()
    }

    fn end_unread(&self, _queued: usize, first: bool) {
        if first {
            warn!(frontend = %self.id, "frontend does not read its stream; closing it");
            self.metrics.limit_reached(Limit::FrontendQueue);
        }
        self.end.fail(Status::resource_exhausted(
            "the frontend does not read its stream: too many answers queued",
        ));
    }
}

/// Connections established for a frontend, handed over by the agent
/// stream that established them until the frontend's driver takes them
/// into its own table. Published before the DIAL_RSP is queued, so the
/// driver has them before the frontend can send DATA on them; taking them
/// locks only when there are some (once per connection).
#[derive(Default)]
pub(crate) struct Attachments {
    /// Whether `conns` has any.
    pending: AtomicBool,
    /// The connections not yet taken.
    conns: tunnel::sync::Mutex<Vec<Arc<Conn>>>,
}

impl Attachments {
    /// Hands `conn` over.
    pub(crate) fn attach(&self, conn: Arc<Conn>) {
        self.conns.lock().push(conn);
        self.pending.store(true, Ordering::Release);
    }

    /// The connections handed over since the last call.
    pub(crate) fn take(&self) -> Vec<Arc<Conn>> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut conns = self.conns.lock();
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut *conns)
    }
}

/// A frontend stream as the control core knows it: its outbound queue and
/// where its connections are handed over.
#[derive(Clone)]
pub(crate) struct FrontendLink {
    /// Its outbound queue.
    pub(crate) tx: FrontendTx,
    /// Its connections, until its driver takes them.
    pub(crate) attachments: Arc<Attachments>,
}

impl FrontendLink {
    /// The link of a frontend whose outbound queue is `tx`.
    pub(crate) fn new(tx: FrontendTx) -> Self {
        Self {
            tx,
            attachments: Arc::default(),
        }
    }

    /// The frontend's id.
    pub(crate) fn id(&self) -> FrontendId {
        self.tx.id
    }
}

/// What a driver's table knows of a connection id.
pub(crate) enum Lookup {
    /// An open connection of the stream.
    Open(Arc<Conn>),
    /// A connection of the stream that was closed (now forgotten): packets
    /// for it that were on their way are dropped.
    Closed(Arc<Conn>),
    /// Not in the table.
    Unknown,
}

/// A driver's table of its stream's connections, keyed by connection id.
/// Connections closed elsewhere are found closed when next used, or swept
/// out as the table grows (amortised O(1) per insert), so a table holds at
/// most about twice its live connections and those closed within the
/// last [`ANSWER_GRACE`] of their opening.
#[derive(Default)]
pub(crate) struct ConnTable {
    /// The connections.
    conns: std::collections::HashMap<ConnId, Arc<Conn>>,
    /// Size after the last sweep.
    swept: usize,
}

impl ConnTable {
    /// Adds a connection (replacing a closed one with the same id).
    /// A closed connection its frontend may still name is kept until then
    /// or the end of its grace ([`ANSWER_GRACE`]), so that the naming
    /// reaches it.
    pub(crate) fn insert(&mut self, conn: Arc<Conn>) {
        self.conns.insert(conn.id, conn);
        if self.conns.len() > 2 * self.swept + 16 {
            let now = tokio::time::Instant::now();
            self.conns
                .retain(|_, conn| !conn.is_closed() || conn.may_be_named(now));
            tunnel::compact(&mut self.conns);
            self.swept = self.conns.len();
        }
    }

    /// What the table knows of `id`; a closed connection leaves it.
    pub(crate) fn lookup(&mut self, id: ConnId) -> Lookup {
        match self.conns.get(&id) {
            None => Lookup::Unknown,
            Some(conn) if conn.is_closed() => {
                let conn = conn.clone();
                self.conns.remove(&id);
                Lookup::Closed(conn)
            }
            Some(conn) => Lookup::Open(conn.clone()),
        }
    }

    /// Connections in the table that are open.
    pub(crate) fn open_count(&self) -> usize {
        self.conns.values().filter(|conn| !conn.is_closed()).count()
    }

    /// Takes `id` out.
    pub(crate) fn remove(&mut self, id: ConnId) -> Option<Arc<Conn>> {
        self.conns.remove(&id)
    }
}

/// An agent stream's link over a fresh queue of `limit` bytes and as much
/// reserve (tests), with the queue's receiver.
#[cfg(any(test, feature = "fuzzing"))]
fn test_backend(
    scheme: flow::Scheme,
    limit: usize,
    metrics: Arc<ServerMetrics>,
) -> (BackendLink, QueueRx<Packet>) {
    let (tx, rx) = queue::queue(limit, limit);
    let link = BackendLink::new(
        AgentId("a".to_owned()),
        None,
        scheme,
        tx,
        StreamEnd::new(tokio_util::sync::CancellationToken::new()),
        metrics,
    );
    (link, rx)
}

/// A connection over a fresh agent stream to a fresh frontend (tests),
/// with the receivers of both queues.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn test_conn(
    id: i64,
    scheme: flow::Scheme,
) -> (Arc<Conn>, QueueRx<Packet>, QueueRx<FrontendItem>) {
    let metrics = Arc::new(ServerMetrics::new(&[]));
    let (agent, agent_rx) = test_backend(scheme, 1 << 20, metrics.clone());
    let (fe_tx, fe_rx) = frontend_queue();
    let frontend = FrontendTx::new(
        FrontendId(1),
        FrontendKind::Grpc,
        fe_tx,
        StreamEnd::new(tokio_util::sync::CancellationToken::new()),
        metrics,
        Arc::new(Budget::new(usize::MAX)),
    );
    let conn = Arc::new(Conn::new(ConnId(id), BackendId(1), agent, frontend));
    (conn, agent_rx, fe_rx)
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;
    use tokio_util::sync::CancellationToken;
    use tunnel::flow::Window;

    use super::*;

    fn agent(scheme: flow::Scheme) -> (BackendLink, QueueRx<Packet>) {
        test_backend(scheme, 1 << 20, Arc::new(ServerMetrics::new(&[])))
    }

    /// An agent stream without credit whose queue takes `limit` bytes.
    fn backend(limit: usize) -> (BackendLink, Arc<ServerMetrics>, QueueRx<Packet>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let compat = Scheme::Compat { ours: Window::V1 };
        let (link, rx) = test_backend(compat, limit, metrics.clone());
        (link, metrics, rx)
    }

    const CLOSE_REQ_LOST: &str = "konnectivity_network_proxy_server_stream_errors_total{code=\"Unavailable\",packet_type=\"CLOSE_REQ\",segment=\"to_agent\"}";

    #[tokio::test]
    async fn a_packet_for_a_gone_agent_is_counted_as_a_send_error() {
        let (backend, metrics, rx) = backend(1024);
        backend.send(Packet::close_request(1)).await.unwrap();
        assert!(!metrics.text().contains("stream_errors_total{"));
        drop(rx);
        assert!(backend.send(Packet::close_request(1)).await.is_err());
        backend.send_control(Packet::close_request(2));
        let text = metrics.text();
        assert!(text.contains(&format!("\n{CLOSE_REQ_LOST} 2\n")), "{text}");
    }

    #[tokio::test]
    async fn an_agent_that_does_not_read_has_its_stream_ended_not_a_task_per_packet() {
        let (backend, metrics, _rx) = backend(64);
        // Control packets never wait; once past the reserve the stream ends.
        let mut sent = 0;
        while !backend.end.is_ended() {
            backend.send_control(Packet::close_request(sent));
            sent += 1;
            assert!(sent < 100, "the queue took {sent} packets");
        }
        assert!(backend.tx.queued() < 2 * 64 + flow::packet_cost(&Packet::close_request(1)));
        let text = metrics.text();
        assert!(
            text.contains("konnectivity_rs_server_limit_reached_total{limit=\"agent_queue\"} 1\n"),
            "{text}"
        );
    }

    fn frontend(kind: FrontendKind) -> (FrontendTx, Arc<ServerMetrics>, QueueRx<FrontendItem>) {
        frontend_with_budget(kind, Arc::new(Budget::new(usize::MAX)))
    }

    fn frontend_with_budget(
        kind: FrontendKind,
        budget: Arc<Budget>,
    ) -> (FrontendTx, Arc<ServerMetrics>, QueueRx<FrontendItem>) {
        let metrics = Arc::new(ServerMetrics::new(&[]));
        let (tx, rx) = frontend_queue();
        let end = StreamEnd::new(CancellationToken::new());
        (
            FrontendTx::new(FrontendId(1), kind, tx, end, metrics.clone(), budget),
            metrics,
            rx,
        )
    }

    fn credit() -> flow::Scheme {
        flow::Scheme::Credit {
            ours: Window::V1,
            theirs: Window::V1,
        }
    }

    #[tokio::test]
    async fn a_packet_for_a_gone_grpc_frontend_is_counted_and_timed() {
        let (fe, metrics, rx) = frontend(FrontendKind::Grpc);
        drop(rx);
        assert!(!fe.send_control(Packet::dial_response(1, 0, "x")));
        fe.send_control(Packet::close_response(2, ""));
        let text = metrics.text();
        let series = |kind: &str| {
            format!(
                "konnectivity_network_proxy_server_stream_errors_total{{code=\"Unavailable\",packet_type=\"{kind}\",segment=\"to_client\"}} 1\n"
            )
        };
        assert!(text.contains(&series("DIAL_RSP")), "{text}");
        assert!(text.contains(&series("CLOSE_RSP")), "{text}");
        // Both writes were timed, as ANP times every frontend send.
        assert!(
            text.contains(
                "konnectivity_network_proxy_server_frontend_write_duration_seconds_count 2\n"
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_http_connect_frontend_has_no_packet_errors() {
        let (fe, metrics, rx) = frontend(FrontendKind::HttpConnect);
        drop(rx);
        fe.send_control(Packet::dial_response(1, 0, "x"));
        assert!(!metrics.text().contains("stream_errors_total{"));
    }

    #[tokio::test]
    async fn a_frontend_that_leaves_its_answers_unread_is_ended_with_an_error() {
        let (fe, metrics, _rx) = frontend(FrontendKind::Grpc);
        let answer = Packet::dial_response(1, 0, &"x".repeat(1000));
        let mut sent = 0;
        while !fe.end.is_ended() {
            fe.send_control(answer.clone());
            sent += 1;
            assert!(
                sent <= FRONTEND_CONTROL_RESERVE / 1000 + 1,
                "{sent} answers queued"
            );
        }
        assert!(sent >= FRONTEND_CONTROL_RESERVE / flow::packet_cost(&answer));
        assert!(
            metrics.text().contains(
                "konnectivity_rs_server_limit_reached_total{limit=\"frontend_queue\"} 1\n"
            )
        );
    }

    /// The frontend taking a connection's DATA returns credit on the
    /// connection's own agent link.
    #[tokio::test]
    async fn a_taken_item_returns_credit_to_its_agent() {
        let (agent, mut agent_rx) = agent(credit());
        let (fe, _metrics, mut rx) = frontend(FrontendKind::Grpc);
        let conn = Arc::new(Conn::new(ConnId(3), BackendId(1), agent, fe));
        assert_eq!(
            conn.deliver(&Bytes::from_static(b"hello")),
            Delivery::Queued
        );
        assert_eq!(conn.flow.queued(), flow::cost(5));
        let packet = rx.recv().await.unwrap().taken();
        assert_eq!(packet.r#type, proto::PacketType::Data as i32);
        assert_eq!(conn.flow.queued(), 0);
        let credit = agent_rx.recv().await.expect("a credit packet");
        assert_eq!(flow::parse_credit(&credit), Some((3, flow::cost(5))));
    }

    /// Agent DATA queued for a frontend takes its cost from the budget;
    /// what the frontend takes gives it back once the account holds more
    /// than twice what is still queued, and all of it when nothing is (or
    /// when the items are dropped with their queue): the shared budget is
    /// touched about once per doubling or halving, not per packet.
    #[tokio::test]
    async fn agent_data_queued_for_a_frontend_takes_from_the_budget_and_gives_it_back() {
        let budget = Arc::new(Budget::new(1 << 20));
        let (agent, _agent_rx) = agent(credit());
        let (fe, _metrics, mut rx) = frontend_with_budget(FrontendKind::Grpc, budget.clone());
        let conn = Arc::new(Conn::new(ConnId(3), BackendId(1), agent, fe));
        let data = Bytes::from(vec![0u8; 1000]);
        let cost = flow::cost(1000);
        for _ in 0..4 {
            assert_eq!(conn.deliver(&data), Delivery::Queued);
        }
        assert_eq!(budget.held(), 4 * cost);
        rx.recv().await.unwrap().taken();
        assert_eq!(budget.held(), 4 * cost, "3 queued: no more than twice");
        rx.recv().await.unwrap().taken();
        assert_eq!(budget.held(), 4 * cost, "2 queued: no more than twice");
        rx.recv().await.unwrap().taken();
        assert_eq!(budget.held(), cost, "1 queued: given back down to it");
        assert_eq!(conn.deliver(&data), Delivery::Queued);
        assert_eq!(budget.held(), 2 * cost);
        rx.recv().await.unwrap().taken();
        rx.recv().await.unwrap().taken();
        assert_eq!(budget.held(), 0, "nothing queued, nothing held");
        assert_eq!(conn.deliver(&data), Delivery::Queued);
        drop(rx);
        assert_eq!(budget.held(), 0, "a dropped item gives its charge back");
    }

    /// With the budget full, agent DATA waits for room (the agent's stream
    /// waits with it), gets it in order of arrival, and gives up after
    /// `COMPAT_STALL`, so that the connection is closed as an overflow.
    #[tokio::test(start_paused = true)]
    async fn agent_data_waits_for_a_full_budget_then_overflows() {
        let budget = Arc::new(Budget::new(flow::cost(1000)));
        let (agent, _agent_rx) = agent(credit());
        let (fe, metrics, mut rx) = frontend_with_budget(FrontendKind::Grpc, budget.clone());
        let conn = Arc::new(Conn::new(ConnId(3), BackendId(1), agent, fe));
        let data = Bytes::from(vec![0u8; 1000]);
        assert_eq!(conn.deliver(&data), Delivery::Queued);
        assert!(budget.is_full());
        assert_eq!(conn.deliver(&data), Delivery::NoBudget);
        // Room comes: the wait goes on.
        let waiting = tokio::spawn({
            let (conn, data) = (conn.clone(), data.clone());
            async move { conn.deliver_wait(data, true).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(budget.waiting(), 1);
        rx.recv().await.unwrap().taken();
        assert_eq!(waiting.await.unwrap(), Delivery::Queued);
        assert!(
            metrics.text().contains(
                "konnectivity_rs_server_limit_reached_total{limit=\"buffer_budget\"} 1\n"
            )
        );
        // What it queued holds the budget; no room for COMPAT_STALL: an
        // overflow.
        assert_eq!(conn.deliver(&data), Delivery::NoBudget);
        let started = tokio::time::Instant::now();
        assert_eq!(conn.deliver_wait(data, true).await, Delivery::Overflow);
        assert_eq!(started.elapsed(), flow::COMPAT_STALL);
        assert_eq!(budget.waiting(), 0);
    }

    #[tokio::test]
    async fn an_agent_past_its_window_is_an_overflow_and_nothing_is_queued() {
        let (agent, _agent_rx) = agent(credit());
        let (fe, _metrics, mut rx) = frontend(FrontendKind::Grpc);
        let conn = Arc::new(Conn::new(ConnId(3), BackendId(1), agent, fe));
        let chunk = Bytes::from(vec![0u8; 256 * 1024 - flow::PACKET_OVERHEAD]);
        for _ in 0..4 {
            assert_eq!(conn.deliver(&chunk), Delivery::Queued);
        }
        assert_eq!(conn.deliver(&chunk), Delivery::Overflow);
        for _ in 0..4 {
            assert!(rx.recv().await.is_some());
        }
    }

    #[tokio::test]
    async fn an_upload_ends_when_the_connection_closes_while_it_waits_for_credit() {
        let (agent, mut agent_rx) = agent(flow::Scheme::Credit {
            ours: Window::V1,
            theirs: Window::new(64 * 1024, 16 * 1024).unwrap(),
        });
        let (fe, _metrics, _rx) = frontend(FrontendKind::Grpc);
        let conn = Arc::new(Conn::new(ConnId(3), BackendId(1), agent, fe));
        let upload = tokio::spawn({
            let conn = conn.clone();
            async move { conn.upload(Bytes::from(vec![1u8; 1 << 20])).await }
        });
        // The agent's window: 64 KiB in 16 KiB pieces, then a wait.
        let mut got = 0;
        while got + flow::cost(16 * 1024) <= 64 * 1024 {
            let packet = agent_rx.recv().await.unwrap();
            let proto::Payload::Data(data) = packet.payload.unwrap() else {
                panic!("not DATA");
            };
            assert_eq!(data.data.len(), 16 * 1024);
            got += flow::cost(data.data.len());
        }
        assert!(!upload.is_finished());
        conn.close();
        assert!(!upload.await.unwrap(), "the upload saw the close");
    }

    #[test]
    fn attachments_are_taken_once() {
        let (agent, _agent_rx) = agent(credit());
        let (fe, _metrics, _rx) = frontend(FrontendKind::Grpc);
        let attachments = Attachments::default();
        assert!(attachments.take().is_empty());
        attachments.attach(Arc::new(Conn::new(ConnId(1), BackendId(1), agent, fe)));
        assert_eq!(attachments.take().len(), 1);
        assert!(attachments.take().is_empty());
    }

    #[test]
    fn a_table_forgets_closed_connections() {
        let (agent, _agent_rx) = agent(credit());
        let (fe, _metrics, _rx) = frontend(FrontendKind::Grpc);
        let mut table = ConnTable::default();
        let conns: Vec<Arc<Conn>> = (1..=1000)
            .map(|id| {
                Arc::new(Conn::new(
                    ConnId(id),
                    BackendId(1),
                    agent.clone(),
                    fe.clone(),
                ))
            })
            .collect();
        for conn in &conns {
            conn.named_by_frontend();
            conn.close();
            table.insert(conn.clone());
        }
        assert!(table.conns.len() <= 32, "{} kept", table.conns.len());
        let open = Arc::new(Conn::new(ConnId(5000), BackendId(1), agent, fe));
        table.insert(open.clone());
        assert!(matches!(table.lookup(ConnId(5000)), Lookup::Open(_)));
        open.close();
        assert!(matches!(table.lookup(ConnId(5000)), Lookup::Closed(_)));
        assert!(matches!(table.lookup(ConnId(5000)), Lookup::Unknown));
    }

    /// A connection `id` answered on a fresh gRPC frontend: the frontend's
    /// writer, after it took the DIAL_RSP; the connection's CLOSE_RSP
    /// queued behind it.
    async fn answered_then_closed(id: i64) -> (Arc<Conn>, FrontendWriter) {
        let (conn, _agent_rx, fe_rx) = test_conn(id, credit());
        let mut writer = FrontendWriter::new(&conn.to_frontend, fe_rx);
        let rsp = Packet::dial_response(7, id, "");
        assert!(conn.to_frontend.answer(rsp, Some(conn.clone())));
        assert!(matches!(
            writer.next().await.unwrap().into_kind(),
            proto::packet::PacketKind::DialRsp(_)
        ));
        assert!(
            conn.to_frontend
                .send_control(Packet::close_response(id, "gone"))
        );
        (conn, writer)
    }

    fn is_close_of(packet: Option<Packet>, id: i64) -> bool {
        matches!(
            packet.map(Packet::into_kind),
            Some(proto::packet::PacketKind::CloseRsp(rsp)) if rsp.connect_id == id
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_close_right_behind_its_answer_waits_for_the_frontend_to_name_the_connection() {
        let (conn, mut writer) = answered_then_closed(3).await;
        assert!(
            writer.next().now_or_never().is_none(),
            "the close went at once"
        );
        // Another connection's packet behind it goes on.
        conn.to_frontend.send_control(Packet::close_dial(9));
        assert!(matches!(
            writer
                .next()
                .now_or_never()
                .flatten()
                .map(Packet::into_kind),
            Some(proto::packet::PacketKind::DialCls(_))
        ));
        assert!(writer.next().now_or_never().is_none());
        let started = tokio::time::Instant::now();
        conn.named_by_frontend();
        assert!(is_close_of(writer.next().await, 3));
        assert_eq!(started.elapsed(), Duration::ZERO, "it waited for the grace");
    }

    #[tokio::test(start_paused = true)]
    async fn a_close_right_behind_its_answer_goes_when_the_grace_ends() {
        let started = tokio::time::Instant::now();
        let (_conn, mut writer) = answered_then_closed(3).await;
        assert!(is_close_of(writer.next().await, 3));
        assert_eq!(started.elapsed(), ANSWER_GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_close_of_a_named_or_older_connection_is_not_held() {
        for named in [true, false] {
            let (conn, mut writer) = {
                let (conn, _agent_rx, fe_rx) = test_conn(4, credit());
                let writer = FrontendWriter::new(&conn.to_frontend, fe_rx);
                (conn, writer)
            };
            conn.to_frontend
                .answer(Packet::dial_response(7, 4, ""), Some(conn.clone()));
            assert!(writer.next().await.is_some());
            if named {
                conn.named_by_frontend();
            } else {
                tokio::time::advance(ANSWER_GRACE).await;
            }
            conn.to_frontend.send_control(Packet::close_response(4, ""));
            let started = tokio::time::Instant::now();
            assert!(is_close_of(writer.next().await, 4));
            assert_eq!(started.elapsed(), Duration::ZERO, "named: {named}");
        }
    }

    /// A closed connection its frontend has not named is kept within its
    /// grace, so that the frontend's naming releases its CLOSE_RSP.
    #[tokio::test(start_paused = true)]
    async fn a_table_keeps_a_closed_connection_its_frontend_may_still_name() {
        let (agent, _agent_rx) = agent(credit());
        let (fe, _metrics, _rx) = frontend(FrontendKind::Grpc);
        let closed = |id: i64, named: bool| {
            let conn = Arc::new(Conn::new(
                ConnId(id),
                BackendId(1),
                agent.clone(),
                fe.clone(),
            ));
            if named {
                conn.named_by_frontend();
            }
            conn.close();
            conn
        };
        let mut table = ConnTable::default();
        table.insert(closed(1, false));
        // Enough named closed ones after it for the table to sweep.
        (2..66).for_each(|id| table.insert(closed(id, true)));
        assert!(matches!(table.lookup(ConnId(1)), Lookup::Closed(_)));
        table.insert(closed(1, false));
        tokio::time::advance(ANSWER_GRACE).await;
        (100..164).for_each(|id| table.insert(closed(id, true)));
        assert!(matches!(table.lookup(ConnId(1)), Lookup::Unknown));
    }

    /// Agent DATA queued behind its connection's CLOSE_RSP (pushed while
    /// another stream's task closed the connection) is not sent.
    #[tokio::test(start_paused = true)]
    async fn nothing_of_a_connection_follows_its_close() {
        let (conn, mut writer) = answered_then_closed(6).await;
        conn.named_by_frontend();
        conn.close();
        let cost = flow::cost(4);
        assert!(conn.charge(cost).is_ok());
        let raced = FrontendItem::Data {
            packet: Packet::data(6, Bytes::from_static(b"late")),
            queued: Queued {
                conn: conn.clone(),
                cost,
            },
        };
        assert!(conn.to_frontend.push(raced, 0));
        conn.to_frontend.send_control(Packet::close_dial(9));
        assert!(is_close_of(writer.next().await, 6));
        assert!(matches!(
            writer.next().await.map(Packet::into_kind),
            Some(proto::packet::PacketKind::DialCls(_))
        ));
        assert_eq!(conn.charged.lock().queued, 0, "the dropped DATA's cost");
    }

    /// A gRPC frontend's stream ended from inside right after a DIAL_RSP
    /// ends once that answer's grace is over (its client has registered
    /// the connection, which the end then closes); with no answer that
    /// recent, at once.
    #[tokio::test(start_paused = true)]
    async fn a_stream_ended_right_after_an_answer_ends_after_its_grace() {
        for answer in [true, false] {
            let (conn, _agent_rx, fe_rx) = test_conn(8, credit());
            let writer = FrontendWriter::new(&conn.to_frontend, fe_rx);
            let last = writer.last_answer();
            let end = conn.to_frontend.end.clone();
            let mut out = Box::pin(
                end.clone()
                    .outbound_after(writer, async move { last.fresh_until().await }),
            );
            if answer {
                conn.to_frontend
                    .answer(Packet::dial_response(7, 8, ""), Some(conn.clone()));
                assert!(matches!(out.next().await, Some(Ok(_))));
            }
            let started = tokio::time::Instant::now();
            end.fail(Status::unavailable("shutting down"));
            let status = out.next().await.unwrap().unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unavailable);
            let waited = if answer { ANSWER_GRACE } else { Duration::ZERO };
            assert_eq!(started.elapsed(), waited, "answer: {answer}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_close_goes_before_the_stream_ends() {
        let (conn, mut writer) = answered_then_closed(5).await;
        assert!(writer.next().now_or_never().is_none());
        // Every sender gone (the writer holds none): the queue ends.
        drop(conn);
        assert!(is_close_of(writer.next().await, 5));
        assert!(writer.next().await.is_none());
    }
}
