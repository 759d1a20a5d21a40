"""A TLS client on Python's ssl module (OpenSSL), which shares no code with
ours: it connects to the agent port once with TLS 1.2 and once with TLS 1.3,
the agent's certificate, and prints one JSON line per connection:
{"version": "TLSv1.2", "has_ticket": bool}. A TLS 1.2 ticket would carry the
session's master secret."""

import argparse
import json
import socket
import ssl


def connect(port, ca, cert, key, version):
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = version
    ctx.maximum_version = version
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    tls = ctx.wrap_socket(raw, server_hostname="localhost")
    # A TLS 1.2 ticket comes in the handshake; TLS 1.3 tickets after it,
    # before the server's HTTP/2 SETTINGS: reading those reads them.
    tls.recv(9)
    report = {"version": tls.version(), "has_ticket": tls.session.has_ticket}
    tls.close()
    return report


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args()
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        print(json.dumps(connect(a.port, a.ca, a.cert, a.key, version)), flush=True)


if __name__ == "__main__":
    main()
