#!/usr/bin/env python3
"""Sums a DHAT heap profile's live bytes at its end ("t-end") by owner and
divides by the number of idle agents: where each KiB of an agent's share of
the server's heap goes (scripts/heap-per-agent runs it).

    scripts/heap-per-agent.py dhat.json AGENTS

An allocation's owner is the first frame, walking up from the allocator,
named with its path (an inlined frame is not), that belongs to a crate doing
something of its own (h2's codec, rustls's
deframer, ...), not to a container (Vec, BytesMut, HashMap, slab) or the
allocator. A task's memory (tokio's task cell, which holds its future) is
put down to the code that spawned it.
"""

import json
import re
import sys

# Frames that only hold or move memory for someone else.
GENERIC = re.compile(
    r"^(malloc|calloc|realloc|free|memalign|posix_memalign|aligned_alloc|__rust|__rdl|__rg|"
    r"_?<?alloc::|<?core::|<?std::|<?bytes::|<?hashbrown::|<?slab::|<?indexmap::|"
    r"<?smallvec::|<?arrayvec::|<?tinyvec::|<?either::|<?futures_util::|<?futures_core::|"
    r"<?pin_project|<?tracing::|<?tower::|<?tower_layer::|<?tower_service::|\?\?\?)"
)
# Owners by the crate path a frame starts with, most specific first.
OWNERS = [
    ("h2::codec::framed_write", "h2: write buffer"),
    ("h2::codec::framed_read", "h2: frame reader (read buffer, partial frames)"),
    ("tokio_util::codec", "h2: read buffer (tokio-util codec)"),
    ("h2::hpack", "h2: HPACK"),
    ("h2::proto::streams", "h2: streams (store, buffers, slabs)"),
    ("h2::", "h2: other"),
    ("rustls::msgs::deframer", "rustls: deframer buffer"),
    ("rustls::vecbuf", "rustls: send/receive chunk queues"),
    ("rustls::", "rustls: other (connection, keys' holders, certificates)"),
    ("ring::", "ring: keys"),
    ("tokio_rustls::", "tokio-rustls"),
    ("tonic::codec", "tonic: codec buffers"),
    ("tonic::", "tonic: other"),
    ("hyper_util::", "hyper-util"),
    ("hyper::", "hyper"),
    ("webpki::", "webpki"),
    ("rustls_pki_types::", "rustls-pki-types (certificates)"),
    ("prost::", "prost"),
]
TASK = re.compile(r"^<?tokio::runtime::task|^<?tokio::runtime::.*spawn|^<?tokio::task::spawn")
OURS = re.compile(r"^<?(proxy_server|edge|tunnel|ops|authority|proto)::")


def function(frame: str) -> str:
    """`0x1234: name (file:line)` -> `name`."""
    name = frame.split(": ", 1)[-1]
    return re.sub(r" \((?:in )?[^()]*\)$", "", name).strip()


def without_generics(name: str) -> str:
    """`a::b<c::d<e>>::f` -> `a::b::f`."""
    while True:
        shorter = re.sub(r"<[^<>]*>", "", name)
        if shorter == name:
            return name
        name = shorter


def owner_of(frames: list[str]) -> str:
    """The owner of an allocation whose stack is `frames` (allocator first)."""
    spawned = False
    for frame in frames:
        name = function(frame)
        # An inlined frame is named without its path: its caller tells.
        if "::" not in without_generics(name):
            continue
        if TASK.match(name):
            spawned = True
            continue
        if GENERIC.match(name) or name.startswith("tokio::"):
            continue
        label = next((label for prefix, label in OWNERS if name.lstrip("<").startswith(prefix)), None)
        if label is None and OURS.match(name):
            path = re.sub(r"<.*", "", name.lstrip("<")).split("::")
            label = "ours: " + "::".join(path[:3])
        if label is None:
            label = "other: " + re.sub(r"<.*", "", name.lstrip("<"))[:60]
        return f"task spawned by {label}" if spawned else label
    return "task (spawner unknown)" if spawned else "unknown"


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        profile = json.load(f)
    agents = int(sys.argv[2])
    table = profile["ftbl"]
    owners: dict[str, list[int]] = {}
    total = 0
    for pp in profile["pps"]:
        live, blocks = pp.get("eb", 0), pp.get("ebk", 0)
        if not live:
            continue
        total += live
        owner = owner_of([table[i] for i in pp["fs"]])
        sums = owners.setdefault(owner, [0, 0])
        sums[0] += live
        sums[1] += blocks
    print(f"live at the end: {total} bytes in all, {total / agents:.0f} per agent "
          f"({agents} agents; the fixed base counted in too)")
    print()
    print("| owner | bytes per agent | blocks per agent | live bytes |")
    print("| --- | --- | --- | --- |")
    shown = 0
    for owner, (live, blocks) in sorted(owners.items(), key=lambda kv: -kv[1][0]):
        if live / agents < 16:
            continue
        shown += live
        print(f"| {owner} | {live / agents:.0f} | {blocks / agents:.1f} | {live} |")
    rest = total - shown
    print(f"| everything under 16 bytes per agent | {rest / agents:.0f} | | {rest} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
