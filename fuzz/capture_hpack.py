#!/usr/bin/env python3
"""Captures the HPACK header blocks grpc-go writes (tests/go/frontend, built
as target/go-frontend by scripts/test) and writes them as inputs of the
`hpack` fuzz target: fuzz/regressions/hpack/grpc-go-* (kept and replayed
whatever their coverage) and fuzz/corpus/hpack/seed-grpc-go-* (where the
fuzzer starts from them).

How: a capture listener on a Unix socket plays the server's first moves of
HTTP/2 (its SETTINGS, the ACK of the client's), records the block of every
HEADERS frame with its CONTINUATIONs, and answers nothing else; the
frontend dials through it as kube-apiserver does (the socket path as the
target, so grpc-go picks its own :authority) and opens its tunnels, each a
Proxy stream whose DIAL_REQ waits for an answer that never comes. Once the
blocks stop coming the listener closes the connection and the frontend is
stopped. With -reuse, every tunnel is a stream on one connection: the
later blocks refer to the dynamic table the first ones filled.

    fuzz/capture_hpack.py      # needs target/go-frontend; only Python 3
"""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
FRONTEND = os.path.join(HERE, "..", "target", "go-frontend")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The fuzz input's first byte: a 4096-byte table (grpc-go's assumption
# while the server announces no other) and a 16 KiB list.
CHOICE = 13
QUIET = 1.0


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def read_exact(conn, n):
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def serve(conn, blocks, want):
    """Records the header blocks of one connection until `want` of them
    came or it is quiet for QUIET seconds."""
    conn.settimeout(QUIET)
    try:
        if read_exact(conn, len(PREFACE)) != PREFACE:
            return
        conn.sendall(frame(4, 0, 0))  # our SETTINGS: none
        pending = None
        while len(blocks) < want:
            head = read_exact(conn, 9)
            length = int.from_bytes(head[:3], "big")
            kind, flags = head[3], head[4]
            payload = read_exact(conn, length)
            if kind == 4 and not flags & 1:
                conn.sendall(frame(4, 1, 0))  # ACK their SETTINGS
            elif kind == 1:  # HEADERS
                if flags & 0x8:  # PADDED
                    pad = payload[0]
                    payload = payload[1:len(payload) - pad]
                if flags & 0x20:  # PRIORITY
                    payload = payload[5:]
                pending = payload
            elif kind == 9 and pending is not None:  # CONTINUATION
                pending += payload
            if pending is not None and kind in (1, 9) and flags & 0x4:  # END_HEADERS
                blocks.append(pending)
                pending = None
    except (EOFError, socket.timeout, OSError):
        pass
    finally:
        conn.close()


def capture(args, want):
    """The header blocks of the first connection `target/go-frontend args`
    opens to the capture listener."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "konnectivity-server.socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(16)
        frontend = subprocess.Popen(
            [FRONTEND, "-uds", path] + args,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        blocks = []
        try:
            listener.settimeout(30)
            conn, _ = listener.accept()
            serve(conn, blocks, want)
        finally:
            frontend.kill()
            frontend.wait()
            listener.close()
        return blocks


def write(name, blocks):
    data = bytes([CHOICE]) + b"".join(struct.pack(">H", len(b)) + b for b in blocks)
    for directory, prefix in (("regressions", ""), ("corpus", "seed-")):
        d = os.path.join(HERE, directory, "hpack")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, prefix + name), "wb") as f:
            f.write(data)
    print(f"{name}: {len(blocks)} blocks, {[len(b) for b in blocks]} bytes", file=sys.stderr)


def main():
    if not os.path.exists(FRONTEND):
        sys.exit(f"{FRONTEND} is missing: scripts/test builds it (tests/go/frontend)")
    dest = ["-addr", "127.0.0.1:9"]
    # One tunnel on a connection of its own: the first block of a connection.
    write("grpc-go-one-tunnel", capture(["dial-error"] + dest, 1))
    # Eight tunnels on one connection: blocks that index its dynamic table.
    reuse = ["-reuse", "dials", "-concurrency", "8", "-count", "8"] + dest
    write("grpc-go-eight-tunnels-one-connection", capture(reuse, 8))


if __name__ == "__main__":
    main()
