"""A TLS client on Python's ssl module (OpenSSL), which shares no code with
ours: it connects to the agent port with the agent's certificate, keeps the
TLS 1.3 session the server gave it, prints "ready", waits for a line on
stdin (the test restarts the server meanwhile), connects again offering
that session, and prints one JSON line: {"reused": bool}."""

import argparse
import json
import socket
import ssl
import sys


def connect(ctx, port, session=None):
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    tls = ctx.wrap_socket(raw, server_hostname="localhost", session=session)
    # TLS 1.3 tickets come after the handshake, before the server's HTTP/2
    # SETTINGS: reading those reads them.
    tls.recv(9)
    return tls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args()
    ctx = ssl.create_default_context(cafile=a.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(a.cert, a.key)
    ctx.set_alpn_protocols(["h2"])
    first = connect(ctx, a.port)
    session = first.session
    first.close()
    print("ready", flush=True)
    sys.stdin.readline()
    second = connect(ctx, a.port, session)
    print(json.dumps({"reused": second.session_reused, "had_ticket": session.has_ticket}), flush=True)
    second.close()


if __name__ == "__main__":
    main()
