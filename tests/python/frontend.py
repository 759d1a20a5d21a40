#!/usr/bin/env python3
"""A Konnectivity frontend that shares no code with konnectivity-rs.

gRPC cases use grpcio (gRPC C-core) with stubs generated at run time from
konnectivity.proto; the CONNECT cases use the standard library only. Each run
prints one JSON line on stdout ({"case": ..., "ok": true|false, ...}) and
exits 0 only when the case passed.

gRPC behaves like kube-apiserver's konnectivity-client: a single-use tunnel is
one channel and one bidirectional Proxy stream carrying one dial: DIAL_REQ,
wait for DIAL_RSP, DATA both ways, CLOSE_REQ, wait for CLOSE_RSP.

Cases:
  echo          dial an echo backend, send --bytes, read them back byte-exact
  dial-error    dial --address (expected closed), expect a DIAL_RSP error
  concurrent    --tunnels single-use tunnels at once, each on its own channel
  multi-stream  --streams Proxy streams on one channel, sequential then
                concurrent, one dial each
  shared-stream two connections on ONE Proxy stream: one to
                --stalled-address (a destination that never reads) uploads
                --bytes, then sends CLOSE_REQ; meanwhile the other, to the
                echo --address, makes --round-trips round trips. Reports
                the round trips made and the stalled one's CLOSE_RSP error
  flood         one connection to --address on one Proxy stream; once its
                standard input gives a line (the test stalled the
                connection), --upload-bytes in 32 KiB DATA, then --empty
                empty DATA, --tiny 1-byte DATA and --padded 1-byte DATA
                each carrying an unknown field of --padding bytes (packets
                built by hand: protobuf skips fields it does not know);
                then waits for its standard input to close, and reports
                what it sent
  streams       --streams Proxy streams over --connections channels
                (round robin), each dialing --stalled-address; at a first
                line on standard input (the test stalled them), each
                uploads --bytes in 16 KiB DATA; at a second, two
                connections to --address make --round-trips echo round
                trips each beside them, in turn: one on a new stream of the
                first flooding channel, one on a channel of its own (each
                dial's time is reported, and the slowest round trip); then
                waits for its standard input to close (grpc.aio, one event
                loop)
  authority     the :authority grpcio sends for --target/--authority, read
                off a socket this script listens on (no proxy involved)
  connect-echo  HTTP CONNECT over --socket to an echo backend, byte-exact
  connect-error HTTP CONNECT over --socket to --address, expect a refusal
  connect-broken HTTP CONNECT over --socket or --tcp (TLS) to an echo
                --address, send --bytes, read until the tunnel ends (the test
                kills the agent) and report how: "reset" or "eof"
"""

import argparse
import hashlib
import json
import os
import queue
import random
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
CHUNK = 32 * 1024
SYSRAND = random.SystemRandom()


class Failure(Exception):
    """A case failed; the message says where."""


def load_stubs():
    """Generates the Python stubs of konnectivity.proto into a temporary
    directory and imports them; returns (messages, services)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="konnectivity-stubs-") as out:
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"--proto_path={PROTO_DIR}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                os.path.join(PROTO_DIR, "konnectivity.proto"),
            ]
        )
        if code != 0:
            raise Failure(f"grpc_tools.protoc failed on konnectivity.proto (exit {code})")
        sys.path.insert(0, out)
        try:
            import konnectivity_pb2
            import konnectivity_pb2_grpc
        finally:
            sys.path.remove(out)
    return konnectivity_pb2, konnectivity_pb2_grpc


def payload(length, seed):
    """length deterministic bytes for seed."""
    return random.Random(seed).randbytes(length)


def sha256(data):
    return hashlib.sha256(data).hexdigest()


class Frontend:
    """Opens channels and single-use tunnels as the command line says."""

    def __init__(self, args):
        import grpc

        self.grpc = grpc
        self.pb, self.services = load_stubs()
        self.args = args

    def channel(self):
        """A new channel to --target (its own connection)."""
        grpc = self.grpc
        args = self.args
        options = [
            # A fresh connection per channel, as kube-apiserver's single-use
            # tunnels get, rather than one shared subchannel.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if args.authority is not None:
            options.append(("grpc.default_authority", args.authority))
        if args.ca:
            with open(args.ca, "rb") as f:
                ca = f.read()
            cert = key = None
            if args.cert:
                with open(args.cert, "rb") as f:
                    cert = f.read()
                with open(args.key, "rb") as f:
                    key = f.read()
            if args.server_name:
                options.append(("grpc.ssl_target_name_override", args.server_name))
            credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert
            )
            return grpc.secure_channel(args.target, credentials, options=options)
        return grpc.insecure_channel(args.target, options=options)

    def tunnel(self, channel):
        return Tunnel(self, channel)


class Tunnel:
    """One Proxy stream carrying one dial.

    A reader thread moves packets from the response stream into `inbox`, and
    ends it with ("end", code, details); a bounded `outbox` feeds the request
    stream, None ends it (half-close).
    """

    def __init__(self, frontend, channel):
        self.pb = frontend.pb
        self.timeout = frontend.args.timeout
        self.outbox = queue.Queue(maxsize=16)
        self.inbox = queue.Queue()
        self.connect_id = None
        stub = frontend.services.ProxyServiceStub(channel)
        metadata = None
        if frontend.args.traceparent:
            # What kube-apiserver's gRPC client sends when its tracing is on.
            metadata = [("traceparent", frontend.args.traceparent)]
        self.call = stub.Proxy(self._requests(), timeout=self.timeout, metadata=metadata)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _requests(self):
        while True:
            packet = self.outbox.get()
            if packet is None:
                return
            yield packet

    def _read(self):
        grpc = sys.modules["grpc"]
        try:
            for packet in self.call:
                self.inbox.put(("packet", packet))
            self.inbox.put(("end", "OK", ""))
        except grpc.RpcError as e:
            self.inbox.put(("end", e.code().name, e.details() or ""))

    def send(self, packet):
        self.outbox.put(packet, timeout=self.timeout)

    def recv(self, what):
        """The next packet; raises Failure naming `what` if the stream ends
        or nothing comes within the timeout."""
        try:
            item = self.inbox.get(timeout=self.timeout)
        except queue.Empty:
            raise Failure(f"timed out after {self.timeout}s waiting for {what}") from None
        if item[0] == "end":
            self.inbox.put(item)
            raise Failure(f"stream ended ({item[1]}: {item[2]}) while waiting for {what}")
        return item[1]

    def dial(self, address):
        """Sends DIAL_REQ and returns the DIAL_RSP's DialResponse."""
        pb = self.pb
        random_id = SYSRAND.getrandbits(63)
        self.send(
            pb.Packet(
                type=pb.DIAL_REQ,
                dialRequest=pb.DialRequest(protocol="tcp", address=address, random=random_id),
            )
        )
        packet = self.recv("DIAL_RSP")
        if packet.type != pb.DIAL_RSP:
            raise Failure(f"expected DIAL_RSP, got {pb.PacketType.Name(packet.type)}")
        response = packet.dialResponse
        if response.random != random_id:
            raise Failure(f"DIAL_RSP for dial {response.random}, sent {random_id}")
        if not response.error:
            self.connect_id = response.connectID
            if self.connect_id <= 0:
                raise Failure(f"DIAL_RSP without error has connectID {self.connect_id}")
        return response

    def echo(self, data):
        """Writes data (from a writer thread) while reading the same number
        of bytes back; returns what came back."""
        pb = self.pb
        errors = []

        def write():
            try:
                for start in range(0, len(data), CHUNK):
                    self.send(
                        pb.Packet(
                            type=pb.DATA,
                            data=pb.Data(
                                connectID=self.connect_id, data=data[start : start + CHUNK]
                            ),
                        )
                    )
            except Exception as e:  # reported by the reading side
                errors.append(e)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        got = bytearray()
        while len(got) < len(data):
            packet = self.recv(f"DATA (have {len(got)} of {len(data)} bytes)")
            if packet.type == pb.DATA:
                if packet.data.connectID != self.connect_id:
                    raise Failure(
                        f"DATA for connectID {packet.data.connectID}, ours is {self.connect_id}"
                    )
                got += packet.data.data
            elif packet.type == pb.CLOSE_RSP:
                raise Failure(
                    f"CLOSE_RSP ({packet.closeResponse.error!r}) after {len(got)} of "
                    f"{len(data)} bytes"
                )
            else:
                raise Failure(f"unexpected {pb.PacketType.Name(packet.type)} during DATA")
        writer.join(self.timeout)
        if errors:
            raise Failure(f"writing DATA: {errors[0]!r}")
        return bytes(got)

    def close(self):
        """CLOSE_REQ, then waits for CLOSE_RSP; returns its error (empty on
        success)."""
        pb = self.pb
        self.send(
            pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=self.connect_id))
        )
        while True:
            packet = self.recv("CLOSE_RSP")
            if packet.type == pb.CLOSE_RSP:
                if packet.closeResponse.connectID != self.connect_id:
                    raise Failure(
                        f"CLOSE_RSP for connectID {packet.closeResponse.connectID}, "
                        f"ours is {self.connect_id}"
                    )
                return packet.closeResponse.error
            if packet.type != pb.DATA:
                raise Failure(f"unexpected {pb.PacketType.Name(packet.type)} waiting for CLOSE_RSP")

    def finish(self):
        """Half-closes the request stream and waits briefly for the server to
        end the response stream; returns its status (or "open"), then makes
        sure the call is over."""
        self.outbox.put(None)
        status = "open"
        deadline = time.monotonic() + min(self.timeout, 5.0)
        while time.monotonic() < deadline:
            try:
                item = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item[0] == "end":
                status = item[1]
                break
        self.call.cancel()
        return status


def echo_once(frontend, channel, address, length, seed):
    """One single-use tunnel's life on `channel`; returns a result dict."""
    tunnel = frontend.tunnel(channel)
    response = tunnel.dial(address)
    if response.error:
        tunnel.finish()
        raise Failure(f"dial {address} failed: {response.error}")
    data = payload(length, seed)
    got = tunnel.echo(data)
    close_error = tunnel.close()
    stream_end = tunnel.finish()
    result = {
        "connect_id": tunnel.connect_id,
        "sent": len(data),
        "received": len(got),
        "sent_sha256": sha256(data),
        "received_sha256": sha256(got),
        "matched": got == data,
        "close_error": close_error,
        "stream_end": stream_end,
    }
    if got != data:
        raise Failure(f"echoed bytes differ: {json.dumps(result)}")
    if close_error:
        raise Failure(f"CLOSE_RSP error {close_error!r}")
    return result


def stream_ends(results):
    """{status the server ended a stream with: how many}."""
    ends = {}
    for r in results:
        if r:
            ends[r["stream_end"]] = ends.get(r["stream_end"], 0) + 1
    return ends


def run_many(jobs):
    """Runs the callables at once (a thread each); returns (results, errors)
    with errors as {message: how many jobs failed with it}."""
    results = [None] * len(jobs)
    errors = {}
    lock = threading.Lock()

    def run(i, job):
        try:
            results[i] = job()
        except Exception as e:
            with lock:
                errors[str(e)] = errors.get(str(e), 0) + 1

    threads = [threading.Thread(target=run, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def case_echo(args):
    frontend = Frontend(args)
    channel = frontend.channel()
    try:
        return echo_once(frontend, channel, args.address, args.bytes, seed=1)
    finally:
        channel.close()


def case_dial_error(args):
    frontend = Frontend(args)
    channel = frontend.channel()
    try:
        tunnel = frontend.tunnel(channel)
        response = tunnel.dial(args.address)
        stream_end = tunnel.finish()
        if not response.error:
            raise Failure(f"dial {args.address} succeeded (connectID {response.connectID})")
        return {"error": response.error, "connect_id": response.connectID, "stream_end": stream_end}
    finally:
        channel.close()


def case_concurrent(args):
    frontend = Frontend(args)

    def job(i):
        def run():
            channel = frontend.channel()
            try:
                return echo_once(frontend, channel, args.address, args.bytes, seed=100 + i)
            finally:
                channel.close()

        return run

    results, errors = run_many([job(i) for i in range(args.tunnels)])
    matched = sum(1 for r in results if r and r["matched"])
    out = {
        "tunnels": args.tunnels,
        "matched": matched,
        "bytes_each": args.bytes,
        "distinct_connect_ids": len({r["connect_id"] for r in results if r}),
        "stream_ends": stream_ends(results),
        "errors": errors,
    }
    if errors or matched != args.tunnels:
        raise Failure(json.dumps(out))
    return out


def case_multi_stream(args):
    frontend = Frontend(args)
    channel = frontend.channel()
    try:
        sequential = [
            echo_once(frontend, channel, args.address, args.bytes, seed=200 + i)
            for i in range(args.streams)
        ]
        results, errors = run_many(
            [
                (lambda i=i: echo_once(frontend, channel, args.address, args.bytes, seed=300 + i))
                for i in range(args.streams)
            ]
        )
        out = {
            "streams": args.streams,
            "bytes_each": args.bytes,
            "sequential_matched": sum(1 for r in sequential if r["matched"]),
            "concurrent_matched": sum(1 for r in results if r and r["matched"]),
            "stream_ends": stream_ends(sequential + results),
            "errors": errors,
        }
        if errors or out["concurrent_matched"] != args.streams:
            raise Failure(json.dumps(out))
        return out
    finally:
        channel.close()


# --- flood and streams: the server's memory under load --------------------


def varint(n):
    """n as a protobuf varint."""
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def data_wire(pb, connect_id, data, padding=0):
    """A DATA packet's wire form, built by hand; with `padding`, its Data
    message carries an unknown field (number 15) of that many bytes, which
    a receiver must skip."""
    inner = pb.Data(connectID=connect_id, data=data).SerializeToString()
    if padding:
        inner += varint((15 << 3) | 2) + varint(padding) + bytes(padding)
    # Packet: type (field 1), then data (field 4, length-delimited).
    return pb.Packet(type=pb.DATA).SerializeToString() + varint((4 << 3) | 2) + varint(len(inner)) + inner


def wait_for_stdin_to_close():
    """Blocks until the test closes this process's standard input."""
    sys.stdin.buffer.read()


def case_flood(args):
    """See the module docstring (flood)."""
    frontend = Frontend(args)
    pb = frontend.pb
    channel = frontend.channel()
    proxy = channel.stream_stream(
        "/ProxyService/Proxy", request_serializer=None, response_deserializer=pb.Packet.FromString
    )
    random_id = SYSRAND.getrandbits(63)
    dialed = threading.Event()
    go = threading.Event()
    finish = threading.Event()
    state = {"connect_id": None, "dial_error": None, "end": None}
    sent = {"upload": 0, "empty": 0, "tiny": 0, "padded": 0}

    def requests():
        dial = pb.Packet(
            type=pb.DIAL_REQ,
            dialRequest=pb.DialRequest(protocol="tcp", address=args.address, random=random_id),
        )
        yield dial.SerializeToString()
        if not dialed.wait(args.timeout) or state["connect_id"] is None:
            return
        go.wait()
        if finish.is_set():
            return
        conn = state["connect_id"]
        block = data_wire(pb, conn, payload(CHUNK, 9))
        while sent["upload"] < args.upload_bytes:
            yield block
            sent["upload"] += CHUNK
        floods = (
            ("empty", args.empty, data_wire(pb, conn, b"")),
            ("tiny", args.tiny, data_wire(pb, conn, b"x")),
            ("padded", args.padded, data_wire(pb, conn, b"x", args.padding)),
        )
        for kind, count, message in floods:
            for _ in range(count):
                if finish.is_set():
                    return
                yield message
                sent[kind] += 1
        finish.wait()

    call = proxy(requests())

    def read():
        grpc = sys.modules["grpc"]
        try:
            for packet in call:
                if packet.type == pb.DIAL_RSP and packet.dialResponse.random == random_id:
                    if packet.dialResponse.error:
                        state["dial_error"] = packet.dialResponse.error
                    else:
                        state["connect_id"] = packet.dialResponse.connectID
                    dialed.set()
            state["end"] = "OK"
        except grpc.RpcError as e:
            state["end"] = e.code().name

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not dialed.wait(args.timeout):
            raise Failure(f"no DIAL_RSP within {args.timeout}s")
        if state["dial_error"]:
            raise Failure(f"dial {args.address} failed: {state['dial_error']}")
        sys.stdin.buffer.readline()
        go.set()
        wait_for_stdin_to_close()
    finally:
        finish.set()
        go.set()
        call.cancel()
        channel.close()
    return {"connect_id": state["connect_id"], "sent": sent, "stream_end": state["end"]}


def case_streams(args):
    """See the module docstring (streams)."""
    import asyncio

    return asyncio.run(streams(args))


async def streams(args):
    import asyncio

    import grpc

    pb, _ = load_stubs()
    loop = asyncio.get_running_loop()

    async def stdin_line():
        return await loop.run_in_executor(None, sys.stdin.buffer.readline)

    block = 16 * 1024

    def aio_channel():
        options = [("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(args.target, options=options)

    def proxy(channel):
        return channel.stream_stream(
            "/ProxyService/Proxy",
            request_serializer=pb.Packet.SerializeToString,
            response_deserializer=pb.Packet.FromString,
        )

    async def dial(call, address):
        random_id = SYSRAND.getrandbits(63)
        await call.write(
            pb.Packet(
                type=pb.DIAL_REQ,
                dialRequest=pb.DialRequest(protocol="tcp", address=address, random=random_id),
            )
        )
        while True:
            packet = await asyncio.wait_for(call.read(), args.timeout)
            if packet is grpc.aio.EOF:
                raise Failure(f"stream ended waiting for the DIAL_RSP of {address}")
            if packet.type == pb.DIAL_RSP and packet.dialResponse.random == random_id:
                if packet.dialResponse.error:
                    raise Failure(f"dial {address} failed: {packet.dialResponse.error}")
                return packet.dialResponse.connectID

    flood_channels = [aio_channel() for _ in range(args.connections)]
    sent = {"bytes": 0, "dialed": 0}
    calls = []
    data = payload(block, 11)
    go = asyncio.Event()

    # Dials in flight at once: under the server's --max-pending-dials-per-agent
    # (2048), which a burst of thousands would pass (and be refused).
    dialing = asyncio.Semaphore(256)

    async def upload(channel):
        call = proxy(channel)()
        calls.append(call)
        async with dialing:
            conn = await dial(call, args.stalled_address)
        sent["dialed"] += 1
        await go.wait()
        message = pb.Packet(type=pb.DATA, data=pb.Data(connectID=conn, data=data))
        for _ in range(args.bytes // block):
            await call.write(message)
            sent["bytes"] += block

    def failed(tasks):
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise Failure(f"a flood stream failed: {task.exception()!r}")

    uploads = [
        asyncio.ensure_future(upload(flood_channels[i % len(flood_channels)])) for i in range(args.streams)
    ]
    await stdin_line()
    failed(uploads)
    go.set()
    await stdin_line()
    failed(uploads)
    # The streams stay open and held up: two healthy connections make their
    # round trips beside them, in turn: one on a new stream of a flooding
    # HTTP/2 connection, one on a stream (and an HTTP/2 connection) of its
    # own.
    healthy_channel = aio_channel()
    healthy = {}
    dials = {}
    for name, channel in (("same_connection", flood_channels[0]), ("own_connection", healthy_channel)):
        started = time.monotonic()
        call = proxy(channel)()
        healthy[name] = (call, await dial(call, args.address), [])
        dials[name] = time.monotonic() - started
    for i in range(args.round_trips):
        for name, (call, conn, trips) in healthy.items():
            message = payload(100, 2000 + i)
            started = time.monotonic()
            await call.write(pb.Packet(type=pb.DATA, data=pb.Data(connectID=conn, data=message)))
            got = b""
            while len(got) < len(message):
                packet = await asyncio.wait_for(call.read(), args.timeout)
                if packet is grpc.aio.EOF:
                    raise Failure(f"the healthy stream ({name}) ended in round trip {i}")
                if packet.type != pb.DATA:
                    kind = pb.PacketType.Name(packet.type)
                    raise Failure(f"the healthy connection ({name}) got {kind} in round trip {i}")
                got += packet.data.data
            if got != message:
                raise Failure(f"round trip {i} ({name}) echoed other bytes")
            trips.append(time.monotonic() - started)
    for call, _, _ in healthy.values():
        call.cancel()
    await loop.run_in_executor(None, wait_for_stdin_to_close)
    failed(uploads)
    for task in uploads:
        task.cancel()
    for flood in calls:
        flood.cancel()
    await healthy_channel.close()
    for channel in flood_channels:
        await channel.close()
    report = {"streams_dialed": sent["dialed"], "bytes_sent": sent["bytes"]}
    for name, (_, _, trips) in healthy.items():
        report[f"round_trips_{name}"] = len(trips)
        report[f"slowest_round_trip_{name}"] = round(max(trips), 3) if trips else None
        report[f"dial_{name}"] = round(dials[name], 3)
    return report


# --- authority: what grpcio puts in :authority, read off the wire ---------

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADERS = 0x1
FRAME_SETTINGS = 0x4
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20


def case_shared_stream(args):
    """See the module docstring (shared-stream)."""
    pb_frontend = Frontend(args)
    pb = pb_frontend.pb
    channel = pb_frontend.channel()
    tunnel = pb_frontend.tunnel(channel)
    try:
        response = tunnel.dial(args.stalled_address)
        if response.error:
            raise Failure(f"dial {args.stalled_address} failed: {response.error}")
        stalled = tunnel.connect_id
        response = tunnel.dial(args.address)
        if response.error:
            raise Failure(f"dial {args.address} failed: {response.error}")
        echo = tunnel.connect_id
        # One reader for the stream: DATA and CLOSE_RSP by connection.
        inboxes = {stalled: queue.Queue(), echo: queue.Queue()}

        def demux():
            while True:
                item = tunnel.inbox.get()
                if item[0] == "end":
                    for box in inboxes.values():
                        box.put(("end", item[1], item[2]))
                    return
                packet = item[1]
                if packet.type == pb.DATA:
                    box = inboxes.get(packet.data.connectID)
                elif packet.type == pb.CLOSE_RSP:
                    box = inboxes.get(packet.closeResponse.connectID)
                else:
                    box = None
                if box is not None:
                    box.put(("packet", packet))

        threading.Thread(target=demux, daemon=True).start()
        sent = {"bytes": 0, "close_at": None}
        half = threading.Event()

        def upload():
            block = payload(CHUNK, 7)
            while sent["bytes"] < args.bytes:
                tunnel.send(pb.Packet(type=pb.DATA, data=pb.Data(connectID=stalled, data=block)))
                sent["bytes"] += len(block)
                if sent["bytes"] >= args.bytes // 2:
                    half.set()
            half.set()
            tunnel.send(pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=stalled)))
            sent["close_at"] = time.monotonic()

        writer = threading.Thread(target=upload, daemon=True)
        writer.start()
        if not half.wait(args.timeout):
            raise Failure(f"the stalled connection's upload did not get to {args.bytes // 2} bytes")

        def take(box, what):
            try:
                item = box.get(timeout=args.timeout)
            except queue.Empty:
                raise Failure(f"timed out after {args.timeout}s waiting for {what}") from None
            if item[0] == "end":
                raise Failure(f"stream ended ({item[1]}: {item[2]}) while waiting for {what}")
            return item[1]

        trips = []
        for i in range(args.round_trips):
            message = payload(100, 1000 + i)
            started = time.monotonic()
            tunnel.send(pb.Packet(type=pb.DATA, data=pb.Data(connectID=echo, data=message)))
            got = b""
            while len(got) < len(message):
                packet = take(inboxes[echo], f"echo of round trip {i}")
                if packet.type != pb.DATA:
                    raise Failure(f"the echo connection got {pb.PacketType.Name(packet.type)} in round trip {i}")
                got += packet.data.data
            if got != message:
                raise Failure(f"round trip {i} echoed other bytes")
            trips.append(time.monotonic() - started)
        packet = take(inboxes[stalled], "the stalled connection's CLOSE_RSP")
        while packet.type == pb.DATA:
            packet = take(inboxes[stalled], "the stalled connection's CLOSE_RSP")
        if packet.type != pb.CLOSE_RSP:
            raise Failure(f"the stalled connection got {pb.PacketType.Name(packet.type)}")
        closed_at = time.monotonic()
        writer.join(args.timeout)
        return {
            "round_trips": len(trips),
            "slowest_round_trip": round(max(trips), 3) if trips else None,
            "stalled_sent": sent["bytes"],
            "close_req_sent": sent["close_at"] is not None,
            "close_error": packet.closeResponse.error,
        }
    finally:
        tunnel.call.cancel()
        channel.close()


def read_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise Failure(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def hpack_int(block, pos, prefix_bits):
    """RFC 7541 5.1 integer with an N-bit prefix at block[pos]."""
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def hpack_string(block, pos):
    huffman = bool(block[pos] & 0x80)
    length, pos = hpack_int(block, pos, 7)
    raw = block[pos : pos + length]
    if huffman:
        raise Failure(
            f"the header value is Huffman-coded ({raw.hex()}); this probe reads only literals"
        )
    return raw.decode("latin-1"), pos + length


def authority_in(block):
    """The :authority value in the first header block of a connection (empty
    dynamic table: the name is static index 1 or a literal)."""
    pos = 0
    while pos < len(block):
        byte = block[pos]
        if byte & 0x80:  # indexed field: a whole static entry, not :authority's value
            index, pos = hpack_int(block, pos, 7)
            if index == 1:
                raise Failure("':authority' sent as an indexed field with the empty value")
            continue
        if byte & 0xE0 == 0x20:  # dynamic table size update
            _, pos = hpack_int(block, pos, 5)
            continue
        prefix = 6 if byte & 0x40 else 4
        index, pos = hpack_int(block, pos, prefix)
        if index == 0:
            name, pos = hpack_string(block, pos)
        else:
            name = ":authority" if index == 1 else None
        if name == ":authority":
            value, pos = hpack_string(block, pos)
            return value
        # Skip the value without decoding it (it may be Huffman-coded).
        length, pos = hpack_int(block, pos, 7)
        pos += length
    raise Failure("no :authority in the first HEADERS frame")


def case_authority(args):
    """Listens on a Unix socket (target unix:PATH) and returns the :authority
    of the first request grpcio sends there."""
    if not args.target.startswith("unix:"):
        raise Failure("the authority probe listens on unix: targets only")
    path = args.target[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(args.timeout)
    found = {}

    def serve():
        try:
            conn, _ = listener.accept()
            conn.settimeout(args.timeout)
            with conn:
                if read_exact(conn, len(HTTP2_PREFACE)) != HTTP2_PREFACE:
                    raise Failure("no HTTP/2 client preface")
                conn.sendall(struct.pack(">I", 0)[1:] + bytes([FRAME_SETTINGS, 0]) + bytes(4))
                while True:
                    head = read_exact(conn, 9)
                    length = int.from_bytes(head[:3], "big")
                    kind, flags = head[3], head[4]
                    body = read_exact(conn, length)
                    if kind == FRAME_SETTINGS and not flags & FLAG_ACK:
                        conn.sendall(bytes(3) + bytes([FRAME_SETTINGS, FLAG_ACK]) + bytes(4))
                    if kind != FRAME_HEADERS:
                        continue
                    if not flags & FLAG_END_HEADERS:
                        raise Failure("HEADERS continued in CONTINUATION frames")
                    start, end = 0, len(body)
                    if flags & FLAG_PADDED:
                        start, end = 1, len(body) - body[0]
                    if flags & FLAG_PRIORITY:
                        start += 5
                    found["authority"] = authority_in(body[start:end])
                    return
        except Exception as e:
            found["error"] = str(e)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    frontend = Frontend(args)
    channel = frontend.channel()
    try:
        call = frontend.services.ProxyServiceStub(channel).Proxy(iter(()), timeout=args.timeout)
        server.join(args.timeout)
        call.cancel()
    finally:
        channel.close()
        listener.close()
        os.unlink(path)
    if "error" in found:
        raise Failure(found["error"])
    if "authority" not in found:
        raise Failure("grpcio sent no request to the probe socket")
    return {"socket": path, "authority": found["authority"]}


# --- HTTP CONNECT, standard library only ----------------------------------


def connect_socket(args):
    """The Unix socket --socket, or --tcp with TLS (--ca, --cert, --key)."""
    if args.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(args.timeout)
        sock.connect(args.socket)
        return sock
    host, _, port = args.tcp.rpartition(":")
    raw = socket.create_connection((host, int(port)), timeout=args.timeout)
    context = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        context.load_cert_chain(args.cert, args.key)
    return BioTls(raw, context, args.server_name or host)


class BioTls:
    """TLS over a socket the case reads itself (ssl.MemoryBIO), so that a
    reset (ConnectionResetError from the socket) is told from a FIN (b"");
    ssl.SSLSocket reports both as one SSLEOFError. recv returns b"" at a
    FIN or the peer's close_notify."""

    def __init__(self, sock, context, server_name):
        self.sock = sock
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=server_name)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise Failure("the server closed during the TLS handshake")
        self._flush()

    def _flush(self):
        pending = self.outgoing.read()
        if pending:
            self.sock.sendall(pending)

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            return False
        self.incoming.write(data)
        return True

    def sendall(self, data):
        view = memoryview(data)
        while view:
            n = self.tls.write(view[:16384])
            view = view[n:]
            self._flush()

    def recv(self, n):
        while True:
            try:
                return self.tls.read(n)
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    return b""
            except ssl.SSLZeroReturnError:
                return b""

    def settimeout(self, timeout):
        self.sock.settimeout(timeout)

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect_request(args):
    """Opens --socket (or --tcp), sends CONNECT as kube-apiserver does and
    reads the response head; returns (socket, head, bytes after the head)."""
    sock = connect_socket(args)
    # kube-apiserver adds a W3C traceparent header when its tracing is on.
    trace = f"traceparent: {args.traceparent}\r\n" if args.traceparent else ""
    sock.sendall(f"CONNECT {args.address} HTTP/1.1\r\nHost: 127.0.0.1\r\n{trace}\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    head, sep, rest = buf.partition(b"\r\n\r\n")
    if not sep:
        raise Failure(f"connection closed before a full response head: {buf!r}")
    return sock, head.decode("latin-1"), rest


def status_of(head):
    parts = head.split("\r\n", 1)[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Failure(f"not an HTTP/1.x status line: {head!r}")
    return int(parts[1])


def case_connect_echo(args):
    sock, head, early = connect_request(args)
    with sock:
        if status_of(head) != 200:
            raise Failure(f"CONNECT answered {head!r}")
        if early:
            raise Failure(f"{len(early)} bytes arrived with the 200 before any were sent")
        data = payload(args.bytes, seed=7)
        errors = []

        def write():
            try:
                sock.sendall(data)
            except OSError as e:
                errors.append(e)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        got = bytearray()
        while len(got) < len(data):
            chunk = sock.recv(min(65536, len(data) - len(got)))
            if not chunk:
                raise Failure(f"tunnel closed after {len(got)} of {len(data)} bytes")
            got += chunk
        writer.join(args.timeout)
        if errors:
            raise Failure(f"writing to the tunnel: {errors[0]!r}")
        result = {
            "head": head,
            "sent": len(data),
            "received": len(got),
            "sent_sha256": sha256(data),
            "received_sha256": sha256(bytes(got)),
            "matched": bytes(got) == data,
        }
        if not result["matched"]:
            raise Failure(f"echoed bytes differ: {json.dumps(result)}")
        return result


def case_connect_error(args):
    sock, head, rest = connect_request(args)
    with sock:
        status = status_of(head)
        body = bytearray(rest)
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            body += chunk
    headers = {}
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    result = {
        "status": status,
        "status_line": head.split("\r\n", 1)[0],
        "headers": headers,
        "body": body.decode("utf-8", "replace"),
    }
    if status == 200:
        raise Failure(f"CONNECT {args.address} was established: {json.dumps(result)}")
    return result


def case_connect_broken(args):
    """CONNECT, send --bytes to an echo destination, then read until the
    tunnel ends (the test kills its agent meanwhile): reports how it ended,
    "reset" (an error) or "eof" (an end that looks like the destination's)."""
    sock, head, early = connect_request(args)
    with sock:
        if status_of(head) != 200:
            raise Failure(f"CONNECT answered {head!r}")
        data = payload(args.bytes, seed=11)
        got = bytearray(early)
        try:
            sock.sendall(data)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    ending = "eof"
                    break
                got += chunk
        except ConnectionResetError:
            ending = "reset"
        except ssl.SSLError as e:
            ending = f"TLS error: {e!r}"
        except socket.timeout:
            ending = "timeout"
    return {
        "ending": ending,
        "received": len(got),
        "echoed": bytes(got) == data[: len(got)],
    }


CASES = {
    "echo": case_echo,
    "dial-error": case_dial_error,
    "concurrent": case_concurrent,
    "multi-stream": case_multi_stream,
    "authority": case_authority,
    "shared-stream": case_shared_stream,
    "flood": case_flood,
    "streams": case_streams,
    "connect-echo": case_connect_echo,
    "connect-error": case_connect_error,
    "connect-broken": case_connect_broken,
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--target", help="gRPC target: unix:/path/to.sock or 127.0.0.1:port")
    p.add_argument("--authority", help="channel option grpc.default_authority")
    p.add_argument("--ca", help="PEM CA that signed the server certificate (turns TLS on)")
    p.add_argument("--cert", help="PEM client certificate (with --ca; none if left out)")
    p.add_argument("--key", help="PEM key of --cert")
    p.add_argument("--server-name", help="channel option grpc.ssl_target_name_override")
    p.add_argument("--socket", help="Unix socket of a server in http-connect mode")
    p.add_argument("--tcp", help="host:port of a server in http-connect mode on TCP (TLS: --ca)")
    p.add_argument("--address", help="host:port to dial through the tunnel")
    p.add_argument("--traceparent", help="a W3C traceparent sent with each Proxy stream or CONNECT")
    p.add_argument("--bytes", type=int, default=1 << 20, help="bytes to echo per tunnel")
    p.add_argument("--tunnels", type=int, default=50, help="concurrent: how many tunnels")
    p.add_argument("--streams", type=int, default=8, help="multi-stream: streams per phase")
    p.add_argument("--connections", type=int, default=1, help="streams: channels the flood uses")
    p.add_argument("--stalled-address", help="shared-stream: a destination that never reads")
    p.add_argument("--round-trips", type=int, default=20, help="shared-stream, streams: echo round trips")
    p.add_argument("--upload-bytes", type=int, default=0, help="flood: bytes uploaded first")
    p.add_argument("--empty", type=int, default=0, help="flood: empty DATA packets")
    p.add_argument("--tiny", type=int, default=0, help="flood: 1-byte DATA packets")
    p.add_argument("--padded", type=int, default=0, help="flood: padded 1-byte DATA packets")
    p.add_argument("--padding", type=int, default=0, help="flood: bytes of each padded packet's unknown field")
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds any one wait, or one stream in all, may take"
    )
    args = p.parse_args(argv)
    grpc_case = not args.case.startswith("connect-")
    if grpc_case and not args.target:
        p.error(f"{args.case} needs --target")
    if not grpc_case and bool(args.socket) == bool(args.tcp):
        p.error(f"{args.case} needs --socket or --tcp")
    if args.tcp and not args.ca:
        p.error("--tcp needs --ca (TLS)")
    if args.case != "authority" and not args.address:
        p.error(f"{args.case} needs --address")
    if bool(args.cert) != bool(args.key):
        p.error("--cert and --key go together")
    if args.cert and not args.ca:
        p.error("--cert needs --ca (TLS)")
    return args


def main(argv):
    args = parse_args(argv)
    started = time.monotonic()
    try:
        result = {"case": args.case, "ok": True, **CASES[args.case](args)}
    except Exception as e:
        result = {"case": args.case, "ok": False, "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
