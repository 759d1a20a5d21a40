#!/usr/bin/env python3
"""Writes the hand-made seed inputs of every fuzz target into
fuzz/corpus/<target>/seed-*: valid and nearly valid inputs that take each
target past its first checks (docs/fuzzing.md). The fuzzer grows the corpus
from them; `cargo fuzz cmin` keeps it small. Needs only Python 3 and, for
the TLS seeds, the openssl command.

    fuzz/seeds.py        # (re)writes the seeds; other corpus files stay
"""

import os
import struct
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(bytes(data))


def keep(target, name, data):
    """A seed that decides a verdict on its own: kept in regressions/, which
    the replay runs whatever its coverage (minimising a corpus keeps one
    input per edge, and drops a seed whose edges another input covers)."""
    d = os.path.join(HERE, "regressions", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


# --- protobuf, by hand (proto/*.proto field numbers) ------------------------


def varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(num, n):
    return varint(num << 3) + varint(n)


def field_bytes(num, b):
    return varint(num << 3 | 2) + varint(len(b)) + b


def packet(kind, payload_field, payload):
    return (field_varint(1, kind) if kind else b"") + field_bytes(payload_field, payload)


def dial_req(random, address=b"10.0.0.1:443"):
    return packet(0, 2, field_bytes(1, b"tcp") + field_bytes(2, address) + field_varint(3, random))


def dial_rsp(random, conn, error=b""):
    return packet(1, 3, (field_bytes(1, error) if error else b"") + field_varint(2, conn) + field_varint(3, random))


def close_req(conn):
    return packet(2, 5, field_varint(1, conn))


def close_rsp(conn, error=b""):
    return packet(3, 6, (field_bytes(1, error) if error else b"") + field_varint(2, conn))


def data(conn, payload):
    return packet(4, 4, field_varint(1, conn) + field_bytes(3, payload))


def close_dial(random):
    return packet(5, 7, field_varint(1, random))


def drain():
    return packet(6, 8, b"")


def credit(conn, amount):
    return packet(100, 4, field_varint(1, conn) + field_bytes(3, struct.pack(">I", amount)))


def grpc_frame(message, flag=0):
    return bytes([flag]) + struct.pack(">I", len(message)) + message


def grpc_packets():
    every = [dial_req(5), dial_rsp(5, 7), close_req(7), close_rsp(7, b"x"), data(7, b"hi"),
             close_dial(5), drain(), credit(7, 4096), close_req(-1)]
    for i, p in enumerate(every):
        write("grpc_packets", f"one-{i}", grpc_frame(p))
    write("grpc_packets", "all", b"".join(grpc_frame(p) for p in every))
    write("grpc_packets", "empty-message", grpc_frame(b""))
    write("grpc_packets", "cut", grpc_frame(data(7, b"hello"))[:-2])
    write("grpc_packets", "compressed-flag", grpc_frame(drain(), flag=1))
    write("grpc_packets", "huge-length", b"\x00\xff\xff\xff\xff")
    write("grpc_packets", "unknown-field", grpc_frame(drain() + field_varint(15, 1)))
    write("grpc_packets", "type-payload-mismatch", grpc_frame(packet(2, 4, field_varint(1, 9))))
    # Sessions through the server (proxy_server::fuzzing::grpc_packets): its
    # agent establishes a dial (random not 2 mod 3) with connection ids 1,
    # 2, ..., refuses the others, echoes DATA, closes after DATA that starts
    # with "!"; DATA after DATA arrives at once, into the uploads' lanes.
    def session(name, packets):
        write("grpc_packets", "session-" + name, b"".join(grpc_frame(p) for p in packets))
    # The second DATA waits for the agent (its queue holds the first): a
    # lane opens, and the empty DATA and the rest queue in it.
    session("echo-through-a-lane", [dial_req(1), data(1, b"a" * 300), data(1, b"b" * 200), data(1, b""),
                                    data(1, b"c"), close_req(1)])
    session("refused-and-established", [dial_req(2), dial_req(3), data(1, b"hi"), close_dial(2)])
    session("agent-closes", [dial_req(4), data(1, b"!bye"), data(1, b"late")])
    session("mismatch", [dial_req(6), data(9, b"not ours"), dial_req(7), data(1, b"x")])
    session("repeated-random", [dial_req(1), dial_req(1), close_req(1), close_req(1), data(1, b"after")])


# --- router: [strategy, timeout, seed] then ops -----------------------------
# Each op: [op, fe index if any frontend, be index if any backend, args...].
# ops: 0 add frontend [kind]; 1 add backend [agent, len, identifiers...];
# 2-5 frontend packet; 6-9 backend packet; 10 dial forwarded [id];
# 11 not forwarded [why, id]; 12 [id, 0 undelivered|1 overflow|2 upload
# stalled|3 stalled];
# 13 frontend ends; 14 backend ends; 15 tick [secs].
# A packet: [id, kind, args]: 0 DIAL_REQ [addr]; 1 DIAL_RSP [conn, err];
# 2 DATA [len, bytes]; 3 CLOSE_REQ; 4 CLOSE_RSP; 5 DIAL_CLS; 6 DRAIN;
# 7 credit [amount]; 8 raw [len, protobuf].


def router():
    head = [0, 0, 0]
    fe = [0, 0]  # the first frontend, gRPC
    be = [1, 0, 0, 0]  # then the first backend ("a", no identifiers)
    establish = [2, 0, 0, 1, 0, 0, 10, 0, 0, 1, 6, 0, 0, 1, 1, 3, 1]
    write("router", "establish", head + fe + be + establish)
    write("router", "data-both-ways", head + fe + be + establish
          + [2, 0, 0, 3, 2, 2, ord("h"), ord("i"), 6, 0, 0, 3, 2, 1, ord("x"), 6, 0, 0, 3, 7, 1])
    write("router", "close-from-frontend", head + fe + be + establish
          + [2, 0, 0, 3, 3, 6, 0, 0, 3, 4])
    write("router", "dial-times-out", head + fe + be + [2, 0, 0, 1, 0, 0, 10, 0, 0, 1, 15, 0, 0, 7, 15, 0, 0, 7])
    write("router", "agent-gone", head + fe + be + establish + [14, 0, 0])
    write("router", "frontend-gone", head + fe + be + establish + [13, 0, 0])
    write("router", "agent-cancels", head + fe + be + [2, 0, 0, 1, 0, 0, 6, 0, 0, 1, 5])
    write("router", "frontend-cancels", head + fe + be + [2, 0, 0, 1, 0, 0, 2, 0, 0, 1, 5])
    second_fe = [0, 0, 0, 0]
    write("router", "mismatch", head + fe + be + establish + second_fe
          + [2, 1, 0, 2, 0, 0, 2, 1, 0, 3, 2, 1, ord("x")])
    write("router", "drain-then-dial", head + fe + be + [6, 0, 0, 0, 6] + [2, 0, 0, 1, 0, 0])
    write("router", "overflow-stall", head + fe + be + establish + [12, 0, 0, 3, 1] + establish[:3] + [2, 0, 0, 2, 0, 0])
    connect_fe = [0, 1]
    write("router", "http-connect-stalled", head + connect_fe + be + establish + [12, 0, 0, 3, 3])
    write("router", "upload-stalled", head + fe + be + establish + [12, 0, 0, 3, 2])
    write("router", "not-forwarded", head + fe + be + [2, 0, 0, 1, 0, 0, 11, 0, 0, 1, 1])
    ids = b"host=node-a&ipv4=10.0.0.1&cidr=10.0.0.0/8&default-route=true"[:40]
    write("router", "dest-host", [1, 0, 0] + fe + [1, 0, 0, len(ids)] + list(ids)
          + [2, 0, 0, 1, 0, 1, 2, 0, 0, 2, 0, 0])
    raw = dial_req(4)
    write("router", "raw-packet", head + fe + be + [2, 0, 0, 0, 8, len(raw)] + list(raw))
    # destHost,default with one retry: agent a (ipv4=10.0.0.1) refuses, agent
    # b (no identifiers) must not get the retry; then a's stream ends.
    ipv4 = list(b"ipv4=10.0.0.1")
    write("router", "dest-host-refused", [1, 0, 1, 0, 0] + [0, 0]
          + [1, 0, 0, len(ipv4)] + ipv4 + [1, 0, 0, 1, 0]
          + [2, 0, 0, 5, 0, 0] + [10, 0, 0, 5] + [6, 0, 0, 5, 1, 0, 0]
          + [2, 0, 0, 6, 0, 0] + [10, 0, 0, 6] + [14, 0, 0])
    # The same with hedging after a second: a silent past the delay.
    write("router", "dest-host-hedge", [1, 0, 1, 1, 0] + [0, 0]
          + [1, 0, 0, len(ipv4)] + ipv4 + [1, 0, 0, 1, 0]
          + [2, 0, 0, 5, 0, 0] + [10, 0, 0, 5] + [15, 0, 0, 2])


    # The transports' sequences (op bytes 240-243 are ops 16-19): op 16 is
    # [240, fe, be, address, latency, answer] (latency: the byte cubed, in
    # µs; answer: 0-1 established, 2 refused, 3 timed out, 4 DIAL_CLS, 5
    # none); 17 [241, fe, be, which, latency, answer]; 18 [242, fe, be,
    # past]; 19 [243, fe, be].
    two = [0, 0] + [1, 0, 0, 0] + [1, 0, 0, 1, 0]
    three = two + [1, 0, 0, 2, 0]

    def dials(n, latency, answer):
        return [240, 0, 0, 0, latency, answer] * n

    # An agent that refuses at once: it weighs at least FAILURE_COST after.
    write("router", "refused-at-once", [0, 0, 0, 0, 0] + two + dials(1, 10, 2) + dials(4, 20, 0))
    # Forty dials of 8 ms: percentile hedges past their bootstrap, then a
    # silent dial hedged at the p50 and timed out.
    write("router", "percentile-hedge", [0, 0, 1, 4, 0] + three + dials(40, 20, 0)
          + dials(1, 0, 5) + [242, 0, 0, 0, 242, 0, 0, 1, 241, 0, 0, 0, 30, 0, 242, 0, 0, 0])
    # A silent agent: its dial times out when the timer runs.
    write("router", "silent-times-out", [0, 0, 0, 1, 0] + two + dials(1, 5, 5) + [242, 0, 0, 0, 242, 0, 0, 0])
    # Fixed 50 ms hedges, one retry: dials refused, answered late, cancelled
    # by the agent; an agent stream ends with dials in flight.
    write("router", "fixed-hedge-retries", [0, 0, 1, 3, 0] + three + dials(3, 60, 0) + dials(2, 40, 2)
          + dials(2, 5, 4) + dials(2, 0, 5) + [242, 0, 0, 0, 241, 0, 0, 0, 80, 0, 14, 0, 1, 243, 0, 0])


# --- connect_head: [cuts, cut..., err len, err..., repeat] then the stream ---


def connect_head():
    def seed(name, stream, cuts=(), error=b"dial tcp: connection refused"):
        write("connect_head", name,
              [len(cuts)] + list(cuts) + [len(error)] + list(error) + [0] + list(stream))
    seed("connect", b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 10.0.0.1:443\r\n\r\n")
    seed("connect-cut", b"CONNECT node-a:10250 HTTP/1.1\r\nHost: node-a:10250\r\nUser-Agent: kube\r\n\r\nearly", cuts=[1, 7, 13, 30])
    seed("connect-v6", b"CONNECT [::1]:8080 HTTP/1.0\r\n\r\n")
    seed("get", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    seed("garbage", b"\x16\x03\x01\x02\x00\x01\x00")
    seed("no-blank-line", b"CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\n")
    seed("bad-version", b"CONNECT a:1 HTTP/2.0\r\n\r\n")
    seed("timeout-error", b"CONNECT a:1 HTTP/1.1\r\n\r\n", error=b"dial tcp a:1: i/o timeout")
    seed("many-headers", b"CONNECT a:1 HTTP/1.1\r\n" + b"X: y\r\n" * 70 + b"\r\n")
    # Lines ending with LF alone; tunnel bytes after the head, cut or not.
    seed("lf-lines", b"CONNECT a:1 HTTP/1.1\nHost: a:1\n\nearly\r\n\r\n")
    seed("lf-then-crlf", b"CONNECT a:1 HTTP/1.1\n\r\n\x16\x03\x01", cuts=[3, 20])
    seed("early-bytes-cut", b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)), cuts=[40, 5, 9, 64])


# --- token_review: [code hi, code lo] then the body --------------------------


def token_review():
    import json
    ok = [0, 100]  # 100 + 100 = 200
    unauthorized = [1, 45]  # 100 + 301 = 401
    def body(status):
        import json
        return json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                           "status": status}).encode()
    user = {"username": "system:serviceaccount:kube-system:konnectivity-agent"}
    aud = ["system:konnectivity-server"]
    keep("token_review", "admitted", ok + list(body({"authenticated": True, "audiences": aud, "user": user})))
    keep("token_review", "other-audience", ok + list(body({"authenticated": True, "audiences": ["api"], "user": user})))
    keep("token_review", "not-authenticated", ok + list(body({"authenticated": False})))
    keep("token_review", "error", ok + list(body({"error": "token expired", "authenticated": True, "audiences": aud, "user": user})))
    keep("token_review", "other-namespace", ok + list(body({"authenticated": True, "audiences": aud,
          "user": {"username": "system:serviceaccount:default:konnectivity-agent"}})))
    keep("token_review", "not-a-service-account", ok + list(body({"authenticated": True, "audiences": aud,
          "user": {"username": "admin"}})))
    write("token_review", "status-401", unauthorized + list(b'{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}'))
    write("token_review", "not-json", ok + list(b"<html>s3cr3t-fuzz-token</html>"))
    # The token (proxy-server/src/fuzzing.rs, TOKEN) echoed wherever an
    # answer can carry text: no error or log line may show it.
    token = ("eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOlsic3lzdGVtOmtvbm5lY3Rpdml0eS1zZXJ2ZXIiXSwiZXhwIjo0MTAy"
             "NDQ0ODAwfQ.czNjcjN0LWZ1enotdG9rZW4")
    forbidden = [1, 46]  # 100 + 303 = 403
    write("token_review", "status-403-quoting-the-token", forbidden + list(json.dumps(
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
         "message": "tokenreviews is forbidden for " + token, "reason": "Forbidden " + token}).encode()))
    write("token_review", "garbled-answer-echoing-the-token", ok + list(
        ('{"kind":"TokenReview","spec":{"token":"' + token + '"},"status":{"authenticated":tru').encode()))
    write("token_review", "error-quoting-the-token", ok + list(body({"error": "invalid bearer token " + token})))
    write("token_review", "user-is-the-token", ok + list(body({"authenticated": True, "audiences": aud,
          "user": {"username": token}})))
    write("token_review", "namespace-is-the-token", ok + list(body({"authenticated": True, "audiences": aud,
          "user": {"username": "system:serviceaccount:" + token + ":konnectivity-agent"}})))
    write("token_review", "audience-is-the-token", ok + list(body({"authenticated": True, "audiences": [token],
          "user": user})))
    write("token_review", "no-answer", [0, 0] + list(body({"authenticated": True})))  # 100: times out
    write("token_review", "connection-error-quoting-the-token", [0, 1] + list(("proxy refused " + token).encode()))


# --- token_claims: [audience?, clock hi, clock lo] then the token -----------
# The clock is 1,700,000,000 s plus the signed 16-bit number; an even first
# byte requires the audience system:konnectivity-server.


def token_claims():
    import base64
    import json

    def b64(data):
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    def jwt(claims, header=None, signature=b"sig"):
        header = header if header is not None else {"alg": "RS256", "kid": "k"}
        return b".".join([b64(json.dumps(header).encode()), b64(json.dumps(claims).encode()), b64(signature)])

    now = 1_700_000_000
    aud = "system:konnectivity-server"
    sa = {"aud": ["https://kubernetes.default.svc", aud], "exp": now + 3600, "iat": now, "nbf": now,
          "iss": "https://kubernetes.default.svc", "sub": "system:serviceaccount:kube-system:konnectivity-agent",
          "kubernetes.io": {"namespace": "kube-system", "serviceaccount": {"name": "konnectivity-agent"}}}
    required, none = [0, 0, 0], [1, 0, 0]
    seed = lambda name, choices, token: write("token_claims", name, choices + list(token))
    seed("service-account", required, jwt(sa))
    seed("aud-string", required, jwt({"aud": aud, "exp": now + 60.5}))
    seed("padded", required, jwt(sa) + b"==")
    seed("no-audience-required", none, jwt({"aud": "api"}))
    seed("legacy-no-aud", required, jwt({"iss": "kubernetes/serviceaccount", "sub": "x"}))
    seed("other-audience", required, jwt({**sa, "aud": ["api"]}))
    seed("expired", required, jwt({**sa, "exp": now - 1000}))
    seed("expired-within-skew", [0, 0xFF, 0x00], jwt({**sa, "exp": now - 200}))
    seed("not-yet-valid", required, jwt({**sa, "nbf": now + 1000}))
    seed("exp-string", required, jwt({**sa, "exp": "soon"}))
    seed("aud-numbers", required, jwt({**sa, "aud": [1, 2]}))
    seed("header-array", required, jwt(sa, header=[1]))
    seed("no-signature", required, jwt(sa, signature=b""))
    seed("two-segments", required, b".".join(jwt(sa).split(b".")[:2]))
    seed("four-segments", required, jwt(sa) + b".c2ln")
    seed("payload-not-json", required, b64(b'{"alg":"RS256"}') + b"." + b64(b"{aud") + b".c2ln")
    seed("random-bearer", required, b"random-bearer-text-0123456789")
    seed("bad-base64", required, b"eyJ!.eyJ.c2ln")


# --- review_peers: [capacity] then ops [peer, op, args] -----------------------
# peers 0-5 (10.0.0.1, 10.0.0.2, ::ffff:10.0.0.1, 2001:db8::1, 2001:db8::2,
# 2001:db8:0:1::1); ops: 0 enter; 1-2 a ticket [index] calls, or its call
# ends [index, outcome: 0 pass, 1 fail, 2 nothing]; 3 a ticket [index]
# leaves (its call abandoned); 4 a failure; 5 the clock [seconds]; 6 a pass.


def review_peers():
    seed = lambda name, capacity, ops: write("review_peers", name, [capacity] + ops)
    fail = lambda peer, n: [peer, 4] * n
    seed("flood", 7, fail(0, 10) + [0, 0] * 6 + [0, 1, 0] * 4 + [0, 1, 0, 1])
    storm = []
    for _ in range(8):
        storm += [0, 0, 0, 1, 0, 0, 1, 0, 0]  # enter, call, pass
    seed("storm-passes", 7, fail(0, 12) + storm)
    seed("eviction", 0, [0, 0, 1, 4, 0, 0, 0, 3, 0])
    seed("decay", 7, fail(3, 40) + [3, 5, 255] * 9 + [3, 0] * 6)
    seed("abandoned", 7, ([1, 0, 1, 1, 0, 1, 3, 0]) * 9 + [1, 0] * 6)
    seed("ipv6-64", 7, fail(3, 9) + [4, 0] * 6 + [5, 0] * 3)


# --- agent_table: [flow control] then ops -----------------------------------
# ops: 0-3 a server packet [id, kind, args] (0-1 DIAL_REQ, 2 DATA [len, bytes],
# 3 CLOSE_REQ, 4 DIAL_CLS, 5 credit [amount], 6 agent-only [which], 8 raw);
# 4-5 a dial ends [0 live|1 stale, index, ok]; 6 remove [id]; 7 [0: stream ends].


def agent_table():
    dial_open = [0, 1, 0, 4, 0, 0, 1]
    write("agent_table", "open-data-close", [0] + dial_open + [0, 1, 2, 2, ord("h"), ord("i"), 0, 1, 5, 1, 0, 1, 3])
    write("agent_table", "no-flow-control", [1] + dial_open + [0, 1, 5, 1])
    write("agent_table", "dial-fails", [0, 0, 2, 0, 4, 0, 0, 0])
    write("agent_table", "cancelled", [0, 0, 2, 0, 0, 2, 4, 4, 0, 0, 1, 4, 1, 0, 1])
    write("agent_table", "duplicate-dial", [0, 0, 3, 0, 0, 3, 1])
    write("agent_table", "stream-ends", [0] + dial_open + [0, 2, 0, 7, 0, 0, 5, 0, 4, 1, 0, 1])
    write("agent_table", "remove", [0] + dial_open + [6, 1, 0, 1, 3])
    raw = data(1, b"x")
    write("agent_table", "raw", [0] + dial_open + [0, 0, 8, len(raw)] + list(raw))
    write("agent_table", "agent-only", [0, 0, 1, 6, 0, 0, 1, 6, 1, 0, 1, 6, 2])


# --- flow_control: three header values, ours, offered, then ops -------------
# A value: [0 absent | 1 expected | 2 [len, u64 le] | 3 [n] | 4 [len, text]].
# An op: [cost kind, cost args, op, op args]: 0 offer, 1 drained, 2 take,
# 3-4 credit [0 built [id] | 1 raw [len, bytes]], 5 time [n], 6 close [0].


def flow_control():
    v2 = [1, 1, 1]
    ops = [1, 64, 2, 1, 64, 0, 1, 64, 1, 1, 64, 3, 0, 1]
    write("flow_control", "credit-v2", v2 + [0, 1] + ops)
    write("flow_control", "v1", [1, 0, 0, 0, 1] + ops)
    write("flow_control", "no-credit", [0, 0, 0, 0, 0] + [3, 200, 0, 3, 200, 0, 0, 5, 60, 3, 200, 0])
    write("flow_control", "half", [1, 1, 0, 0, 1])
    write("flow_control", "not-a-number", [1, 4, 5] + list(b"12abc") + [1, 0, 1])
    write("flow_control", "out-of-range", [1, 3, 0, 1, 0, 1])
    write("flow_control", "overflow", v2 + [1, 1] + [3, 255, 0, 3, 255, 0, 3, 255, 0])
    write("flow_control", "closed", v2 + [0, 1] + [0, 6, 0, 0, 0, 0, 0, 2])
    raw = credit(1, 4096)
    write("flow_control", "raw-credit", v2 + [0, 1] + [1, 1, 2, 1, 1, 3, 1, len(raw)] + list(raw))


# --- proxy_reply: [kind: bit 0 credentials, then http|socks5h|socks5] + reply


def proxy_reply():
    http, socks5h, socks5 = 0, 2, 4
    write("proxy_reply", "http-200", [http] + list(b"HTTP/1.1 200 Connection established\r\n\r\n"))
    write("proxy_reply", "http-200-auth", [http | 1] + list(b"HTTP/1.1 200 OK\r\nProxy-Agent: x\r\n\r\n"))
    write("proxy_reply", "http-407", [http | 1] + list(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n"))
    write("proxy_reply", "http-502", [http] + list(b"HTTP/1.0 502 Bad Gateway\r\nContent-Length: 5\r\n\r\nnope!"))
    write("proxy_reply", "http-100-then-200", [http] + list(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"))
    write("proxy_reply", "http-garbage", [http] + list(b"SSH-2.0-OpenSSH\r\n"))
    ok_v4 = [5, 0, 0, 1, 10, 0, 0, 2, 0x1F, 0x90]
    write("proxy_reply", "socks5h-ok", [socks5h] + [5, 0] + ok_v4)
    write("proxy_reply", "socks5-ok", [socks5] + [5, 0] + ok_v4)
    write("proxy_reply", "socks5-auth-ok", [socks5h | 1] + [5, 2, 1, 0] + ok_v4)
    write("proxy_reply", "socks5-auth-refused", [socks5h | 1] + [5, 2, 1, 1])
    write("proxy_reply", "socks5-no-method", [socks5h] + [5, 0xFF])
    write("proxy_reply", "socks5-refused", [socks5h] + [5, 0, 5, 5, 0, 1, 0, 0, 0, 0, 0, 0])
    write("proxy_reply", "socks5-domain", [socks5h] + [5, 0, 5, 0, 0, 3, 4] + list(b"host") + [0, 80])
    write("proxy_reply", "socks5-v6", [socks5] + [5, 0, 5, 0, 0, 4] + [0] * 15 + [1, 0, 80])
    # Tunnel bytes right after the reply; replies that merely contain a
    # grant; the leniencies of the parsers (LF lines, a blank line first).
    early = list(b"\x16\x03\x01 early tunnel bytes")
    write("proxy_reply", "http-200-early-bytes", [http] + list(b"HTTP/1.1 200 OK\r\n\r\n") + early)
    write("proxy_reply", "http-101-then-200", [http] + list(b"HTTP/1.1 101 Switching Protocols\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"))
    write("proxy_reply", "http-407-then-200", [http | 1] + list(b"HTTP/1.1 407 No\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"))
    write("proxy_reply", "http-lf-lines", [http] + list(b"HTTP/1.0 200 OK\nProxy-Agent: x\n\n") + early)
    write("proxy_reply", "http-blank-line-first", [http] + list(b"\r\nHTTP/1.1 204\r\n\r\n") + early)
    write("proxy_reply", "socks5-early-bytes", [socks5h] + [5, 0] + ok_v4 + early)
    write("proxy_reply", "socks5-auth-domain-early-bytes", [socks5h | 1] + [5, 2, 1, 0, 5, 0, 0, 3, 4] + list(b"host") + [0, 80] + early)
    write("proxy_reply", "socks5-password-not-offered", [socks5h] + [5, 2, 1, 0] + ok_v4)
    write("proxy_reply", "socks5-reserved-byte", [socks5h] + [5, 0, 5, 0, 1, 1, 10, 0, 0, 2, 0x1F, 0x90])
    write("proxy_reply", "socks5-refused-then-ok", [socks5h] + [5, 0, 5, 1, 0, 1, 0, 0, 0, 0, 0, 0] + ok_v4)


# --- hpack: [limits] then [len hi, len lo, block]... --------------------------
# The blocks grpc-go writes are captured by fuzz/capture_hpack.py (it needs
# target/go-frontend): fuzz/regressions/hpack/grpc-go-*.


def hpack_blocks(hexes):
    out = []
    for h in hexes:
        b = bytes.fromhex(h) if isinstance(h, str) else h
        out += list(struct.pack(">H", len(b))) + list(b)
    return out


def hpack_int(value, prefix, flags):
    top = (1 << prefix) - 1
    if value < top:
        return bytes([flags | value])
    out = bytearray([flags | top])
    value -= top
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name, value, flags=0x40, prefix=6):
    return hpack_int(0, prefix, flags) + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


def hpack():
    c3 = ["828684410f7777772e6578616d706c652e636f6d",
          "828684be58086e6f2d6361636865",
          "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565"]
    c4 = ["828684418cf1e3c2e5f23a6ba0ab90f4ff",
          "828684be5886a8eb10649cbf",
          "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"]
    blocks = hpack_blocks
    write("hpack", "rfc7541-c3", [13] + blocks(c3))
    write("hpack", "rfc7541-c4-huffman", [13] + blocks(c4))
    write("hpack", "size-update", [3] + blocks(["3f1182"]))
    write("hpack", "small-table", [1] + blocks(c3))
    write("hpack", "never-indexed", [18] + blocks(["1008706173737764" + "06736563726574"]))
    socket = b"%2Fetc%2Fkubernetes%2Fkonnectivity-server%2Fkonnectivity-server.socket"
    block = bytes.fromhex("8386") + b"\x41" + bytes([len(socket)]) + socket + bytes.fromhex("448a2f50726f78795365727669636550")
    write("hpack", "grpc-authority", [13] + blocks([block]))
    write("hpack", "bad-index", [3] + blocks(["ff7f"]))
    # RUSTSEC-2023-0085's input: a size update whose integer is cut short.
    write("hpack", "truncated-size-update", [3] + blocks(["3f"]))
    write("hpack", "huffman-padding", [13] + blocks(["0081ff0180", "00811f0180"]))
    # Several KiB: an entry of 4000 bytes indexed again and again, a list
    # of many fields, a table of 64 KiB filled and evicted.
    big = hpack_literal(b"x-big", b"v" * 4000)
    write("hpack", "a-4k-entry-indexed", [18] + blocks([big + bytes([0xBE]) * 3, bytes([0xBE]) * 8]))
    many = b"".join(hpack_literal(b"x-%d" % i, b"%d" % i) for i in range(300))
    write("hpack", "300-fields", [19] + blocks([many, bytes([0xBE, 0xBF, 0xC0])]))
    fill = b"".join(hpack_literal(b"k", b"w" * 1000) for _ in range(7))
    write("hpack", "64k-table-evicted", [19] + blocks([fill, hpack_int(0, 5, 0x20) + bytes([0x82]), fill]))


# --- tls_files: [choice, split hi, split lo] then cert file + key file -------


def tls_files():
    with tempfile.TemporaryDirectory() as d:
        def run(*args):
            subprocess.run(args, cwd=d, check=True, capture_output=True)
        run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", "ec.key", "-out", "ec.pem", "-days", "365", "-subj", "/CN=fuzz")
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rsa.key",
            "-out", "rsa.pem", "-days", "365", "-subj", "/CN=fuzz")
        run("openssl", "ec", "-in", "ec.key", "-out", "ec-sec1.key")
        run("openssl", "pkey", "-in", "rsa.key", "-traditional", "-out", "rsa-pkcs1.key")
        read = lambda n: open(os.path.join(d, n), "rb").read()
        ec, ec_key, rsa, rsa_key = read("ec.pem"), read("ec.key"), read("rsa.pem"), read("rsa.key")
        ec_sec1, rsa_pkcs1 = read("ec-sec1.key"), read("rsa-pkcs1.key")

    def seed(name, cert, key, choice=0):
        write("tls_files", name, [choice] + list(struct.pack(">H", len(cert))) + list(cert) + list(key))
    seed("ec-pair", ec, ec_key)
    seed("ec-pair-mtls", ec, ec_key, choice=0x80)
    seed("ec-sec1", ec, ec_sec1, choice=0x81)
    seed("rsa-pkcs1", rsa, rsa_pkcs1)
    seed("mismatch", ec, rsa_key, choice=2)
    seed("chain", ec + rsa, ec_key, choice=0x80)
    seed("cut", ec[: len(ec) // 2], ec_key[:40])
    seed("bad-base64", ec.replace(b"M", b"!", 3), ec_key)
    seed("empty", b"", b"")
    seed("key-as-cert", ec_key, ec, choice=1)


# --- session_ticket: secret, binding, rotation, clock, session, presented ---


def session_ticket():
    secret = list(range(32))
    def seed(name, session, presented=b"", rotation=2, clock=(0, 0, 0x66, 0, 0, 0), binding=b"ca"):
        write("session_ticket", name, [len(secret)] + secret + [len(binding)] + list(binding)
              + [rotation] + list(clock) + [len(session)] + list(session) + list(presented))
    tls13 = bytes([0, 3, 4, 0x13, 1]) + bytes(40)
    named = bytes([1, 4]) + b"host" + bytes([3, 4, 0x13, 2]) + bytes(20)
    seed("tls13", tls13)
    seed("tls13-named", named, presented=b"\x05\x01")
    seed("tls12", bytes([0, 3, 3, 0xC0, 0x2F]) + bytes(40))
    seed("forged", tls13, presented=bytes(8) + bytes(12) + bytes(32))
    seed("short-rotation", tls13, rotation=0, clock=(0xFF,) * 6)
    seed("clock-zero", tls13, clock=(0,) * 6, presented=b"\x00")
    # presented[2..4] picks how far ahead a second ticket is sealed: bit 15
    # clear, within the clock skew (opens); set, beyond it (never opens).
    seed("future-within-skew", tls13, presented=b"\x05\x01\x00\x3c")
    seed("future-past-skew", tls13, presented=b"\x05\x01\x80\x00")
    seed("future-next-period", tls13, rotation=1, presented=b"\x05\x01\x8e\x0f")
    seed("forged-future", tls13, presented=struct.pack(">Q", 0x6600000000 + 3600) + bytes(12) + bytes(32))


# --- lanes: ops [conn 0-2, op, args...] ----------------------------------------
# op 0/1 DATA [len kind: 0 empty, 1 below 8 [n], 2-3 up to 3 KiB [n]] then one
# byte per chunk: even, uploaded at once; odd, it waits (the lane opens);
# 2 CLOSE_REQ; 3/4 the upload in flight ends [byte: 0 mod 8 the connection is
# gone, else done]; 5 the lane is cut [ms to advance].


def lanes():
    # The issue-43 sequence: a waiting chunk, an empty DATA, "abc", close.
    write("lanes", "empty-data-in-a-lane", [0, 0, 1, 5, 1, 0, 0, 0, 0, 0, 1, 3, 0, 2])
    write("lanes", "chunks-then-wait", [0, 0, 2, 255, 0, 1, 0, 0, 2, 100, 0, 3, 1, 0, 2, 0, 3, 1, 0, 3, 1])
    write("lanes", "close-twice", [1, 0, 1, 4, 1, 1, 2, 1, 2, 1, 3, 1])
    write("lanes", "cut-with-close", [2, 0, 1, 6, 1, 2, 0, 1, 2, 2, 2, 5, 9])
    write("lanes", "upload-fails", [0, 0, 1, 6, 1, 0, 2, 0, 3, 8])
    write("lanes", "three-connections", [0, 0, 1, 7, 1, 1, 0, 1, 7, 0, 2, 0, 1, 7, 1, 1, 3, 1,
                                         0, 2, 2, 3, 1, 1, 2, 0, 3, 1])


if __name__ == "__main__":
    grpc_packets()
    router()
    connect_head()
    token_review()
    token_claims()
    review_peers()
    agent_table()
    flow_control()
    proxy_reply()
    hpack()
    tls_files()
    session_ticket()
    lanes()
