"""The SDK's types against the API's schemas.

``crates/apiserver/openapi.json`` is generated from the Rust wire types (a Rust test keeps it equal
to what the apiserver serves at ``/openapi.json``). These tests fail when the server sends a field
an SDK dataclass drops, when an SDK dataclass has a field the server does not know, when a
field's Python type does not match the schema's, and when an error code has no SDK exception.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing

import pytest

import dsec.types as T
from dsec.errors import _BY_CODE

DOC_PATH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "crates", "apiserver", "openapi.json"
)


@pytest.fixture(scope="module")
def doc():
    with open(DOC_PATH, encoding="utf-8") as f:
        return json.load(f)


def schema(doc, name):
    return doc["components"]["schemas"][name]


def resolve(doc, s):
    ref = s.get("$ref")
    return schema(doc, ref.rsplit("/", 1)[-1]) if ref else s


def properties(doc, name):
    s = schema(doc, name)
    props = dict(s.get("properties", {}))
    for part in s.get("allOf", []):
        props.update(resolve(doc, part).get("properties", {}))
    return props


# Answers: the SDK dataclass must carry exactly the schema's properties. Fields the SDK adds on
# its own side (never sent by the server) are listed with why.
ANSWERS = {
    T.SandboxInfo: ("SandboxInfo", {"raw": "the whole JSON document as received"}),
    T.ShellResult: ("CommandResult", {"replayed": "from the x-dsec-replayed response header"}),
    T.FileInfo: ("FileInfo", {}),
    T.ImageInfo: ("ImageInfo", {}),
    T.JobOpResult: ("JobOpResult", {}),
}

# Requests: every SDK field must be one the server accepts (the server refuses unknown fields);
# SDK-side names that are renamed on the wire are listed.
REQUESTS = {
    T.DSecContainerRunArgs: ("CreateSandboxRequest", {"container_image": "image"}),
    T.DSecMicroVMRunArgs: ("CreateSandboxRequest", {"container_image": "image"}),
    T.DSecVMRunArgs: ("CreateSandboxRequest", {}),
}


def sdk_fields(cls):
    return {f.name: f for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", list(ANSWERS), ids=lambda c: c.__name__)
def test_answer_dataclass_has_exactly_the_schema_fields(doc, cls):
    name, sdk_only = ANSWERS[cls]
    server = set(properties(doc, name))
    sdk = set(sdk_fields(cls)) - set(sdk_only)
    dropped = server - sdk
    unknown = sdk - server
    assert not dropped, f"{cls.__name__} drops fields the server sends in {name}: {sorted(dropped)}"
    assert not unknown, f"{cls.__name__} has fields {name} does not have: {sorted(unknown)}"
    for f in sdk_only:
        assert f not in server, f"{cls.__name__}.{f} is SDK-only but the server now sends it"


@pytest.mark.parametrize("cls", list(REQUESTS), ids=lambda c: c.__name__)
def test_request_dataclass_fields_are_known_to_the_server(doc, cls):
    name, renamed = REQUESTS[cls]
    server = set(properties(doc, name))
    sdk = {renamed.get(f, f) for f in sdk_fields(cls)}
    unknown = sdk - server
    assert not unknown, f"{cls.__name__} sends fields {name} refuses: {sorted(unknown)}"
    assert schema(doc, name).get("additionalProperties") is False


_PY = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "object": "Dict", "array": "List"}


def expected_python(doc, prop):
    """(python type name, nullable) the schema property maps to."""
    nullable = False
    s = prop
    for alt_key in ("oneOf", "anyOf"):
        if alt_key in s:
            alts = [a for a in s[alt_key] if a.get("type") != "null"]
            nullable = len(alts) != len(s[alt_key])
            s = alts[0]
    s = resolve(doc, s)
    kind = s.get("type")
    if isinstance(kind, list):
        nullable = nullable or "null" in kind
        kind = next(k for k in kind if k != "null")
    if kind is None and ("properties" in s or "oneOf" in s):
        kind = "object"
    return _PY[kind], nullable


def annotation(cls, field_name):
    hints = typing.get_type_hints(cls)
    return hints[field_name]


def python_name(tp):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return python_name(inner)[0], True
    if origin in (dict,):
        return "Dict", False
    if origin in (list,):
        return "List", False
    return tp.__name__, False


@pytest.mark.parametrize("cls", list(ANSWERS) + list(REQUESTS), ids=lambda c: c.__name__)
def test_field_types_match_the_schema(doc, cls):
    name, extra = (ANSWERS.get(cls) or REQUESTS[cls])
    renamed = extra if cls in REQUESTS else {}
    props = properties(doc, name)
    wrong = []
    for f in sdk_fields(cls):
        wire = renamed.get(f, f)
        if wire not in props:
            continue
        want, nullable = expected_python(doc, props[wire])
        have, optional = python_name(annotation(cls, f))
        if have != want:
            wrong.append(f"{f}: SDK {have}, server {want}")
        elif nullable and not optional and cls in ANSWERS:
            wrong.append(f"{f}: the server may send null, the SDK's type is not Optional")
    assert not wrong, f"{cls.__name__} vs {name}: " + "; ".join(wrong)


def test_every_error_code_has_an_sdk_exception(doc):
    codes = set(schema(doc, "ErrorCode")["enum"])
    # `internal` is a 5xx without a class of its own: it maps by status to DSecError.
    missing = codes - set(_BY_CODE) - {"internal"}
    assert not missing, f"error codes without an SDK exception: {sorted(missing)}"
    unknown = set(_BY_CODE) - codes
    assert not unknown, f"SDK maps codes the server never sends: {sorted(unknown)}"

