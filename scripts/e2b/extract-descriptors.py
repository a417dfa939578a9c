#!/usr/bin/env python3
"""Regenerates crates/e2b-envd/proto/envd.fds.bin from the installed e2b Python SDK.

The SDK's generated modules (e2b/envd/process/process_pb.py, filesystem_pb.py) carry the
serialized FileDescriptorProto of process.proto and filesystem.proto as the first argument of
their `file_desc(...)` call; filesystem.proto imports google/protobuf/timestamp.proto, whose
descriptor ships with the SDK's protobuf runtime. The modules are parsed, not imported, and
the three descriptors are written as one FileDescriptorSet (imports first), which
crates/e2b-envd/build.rs compiles with prost-build (no protoc needed).

Usage: python3 scripts/e2b/extract-descriptors.py [OUT]
"""

import ast
import importlib.util
import os
import sys


def module_path(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        sys.exit(f"extract-descriptors: python module {name} not found (pip install e2b)")
    return spec.origin


def serialized_descriptor(path: str) -> bytes:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "file_desc"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, bytes)
        ):
            return node.args[0].value
    sys.exit(f"extract-descriptors: no file_desc(b'...') call in {path}")


def length_delimited(field: int, payload: bytes) -> bytes:
    out = bytearray()
    tag = (field << 3) | 2
    n = len(payload)
    out.append(tag)
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            break
    return bytes(out) + payload


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "..", "crates", "e2b-envd", "proto", "envd.fds.bin")
    out = sys.argv[1] if len(sys.argv) > 1 else default
    files = [
        module_path("protobuf.wkt.google.protobuf.timestamp_pb"),
        module_path("e2b.envd.process.process_pb"),
        module_path("e2b.envd.filesystem.filesystem_pb"),
    ]
    # FileDescriptorSet { repeated FileDescriptorProto file = 1; }
    fds = b"".join(length_delimited(1, serialized_descriptor(p)) for p in files)
    with open(out, "wb") as f:
        f.write(fds)
    print(f"wrote {len(fds)} bytes ({len(files)} files) to {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
