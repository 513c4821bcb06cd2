"""Hypothesis against the gRPC API of a real Serve app: request messages built from the proto's own descriptors
with every field at any value its wire type holds (uint32/uint64 extremes, NaN and infinite floats, unknown enum
numbers, long and empty strings, huge max_tokens, prompts past the context), and raw bytes (random, cut short,
bytes flipped, invalid UTF-8 in string fields) to every rpc. Every answer is OK or a client-error status with a
message (INVALID_ARGUMENT naming a field of the request), never INTERNAL/UNKNOWN/UNAVAILABLE, and a valid request
succeeds after each batch."""

from __future__ import annotations

import re

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message
from hypothesis import event, given
from hypothesis import strategies as st

from cpuserve.v1 import inference_pb2 as pb
from fuzz_values import LONG_TEXT, fuzz_settings

pytestmark = pytest.mark.slow

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
RPCS = {"Generate": (pb.GenerateRequest, True), "Complete": (pb.GenerateRequest, False),
        "Tokenize": (pb.TokenizeRequest, False), "ListModels": (pb.ListModelsRequest, False),
        "Health": (pb.HealthRequest, False)}
_INTS = {F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_UINT64: (0, 2**64 - 1),
         F.TYPE_INT64: (-(2**63), 2**63 - 1)}
TEXT = st.text(max_size=30) | st.sampled_from(["", " ", "user", "assistant", "auto", "required", "none", "{}",
                                               '{"type": "object"}', "[0-9]+", "start: \"a\""])
# fields whose useful values are narrower than their wire type: most requests should get past the model check
FIELD_VALUES = {"model": st.just("") | TEXT, "text": TEXT | LONG_TEXT, "request_id": st.just("") | TEXT,
                "ids": st.lists(st.integers(0, 49_151) | st.integers(0, 2**32 - 1), max_size=80)}


def scalars(field) -> st.SearchStrategy:
    if field.name in FIELD_VALUES:
        return FIELD_VALUES[field.name]
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        edges = [v for v in (lo, hi, hi - 1, 1 << 31, 1 << 20, -1) if lo <= v <= hi]
        return st.integers(0, 20) | st.sampled_from(edges) | st.integers(lo, hi)
    if field.type == F.TYPE_FLOAT:
        return st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.0])
    if field.type == F.TYPE_DOUBLE:
        return st.floats()
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers arrive too
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-3, 50)
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=40)
    return TEXT


@st.composite
def messages(draw, cls: type[Message], depth: int = 0, rate: int = 4) -> Message:
    """A message of cls with a random subset of its fields set, each with chance 1/rate (one member per oneof)."""
    msg, d = cls(), cls.DESCRIPTOR
    chosen_oneofs = {o.name: draw(st.sampled_from([None] + [f.name for f in o.fields])) for o in d.oneofs}
    for field in d.fields:
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_") and chosen_oneofs[oneof.name] != field.name:
            continue
        if draw(st.integers(0, rate - 1)) or depth > 3:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            getattr(msg, field.name).update(draw(st.dictionaries(scalars(key), scalars(value), max_size=3)))
        elif field.message_type is not None:
            sub = messages(message_factory.GetMessageClass(field.message_type), depth + 1, rate)
            if field.is_repeated:
                getattr(msg, field.name).extend(draw(st.lists(sub, max_size=3)))
            else:
                getattr(msg, field.name).CopyFrom(draw(sub))
        elif field.is_repeated:
            values = draw(FIELD_VALUES[field.name] if field.name in FIELD_VALUES
                          else st.lists(scalars(field), max_size=4))
            getattr(msg, field.name).extend(values)
        else:
            setattr(msg, field.name, draw(scalars(field)))
    return msg


def field_names(msg: Message) -> set[str]:
    """Every field set in msg and in its submessages, and its oneofs' names, set or not (errors say "prompt")."""
    names = {o.name for o in msg.DESCRIPTOR.oneofs if not o.name.startswith("_")}
    for field, value in msg.ListFields():
        names.add(field.name)
        subs = value if field.is_repeated else [value]
        for sub in subs:
            if isinstance(sub, Message):
                names |= field_names(sub)
    return names


@pytest.fixture(scope="module")
def rpcs(serving):
    """Every rpc taking raw request bytes: the fuzz sends what a protobuf library would refuse to build."""
    channel = grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}")
    yield {name: (channel.unary_stream if stream else channel.unary_unary)(
        f"/cpuserve.v1.Inference/{name}", request_serializer=None, response_deserializer=None)
        for name, (_, stream) in RPCS.items()}
    channel.close()


def call(rpcs, name: str, raw: bytes) -> grpc.RpcError | None:
    """The rpc's error, or None when it answered OK (a stream read to its end)."""
    try:
        result = rpcs[name](raw, timeout=120)
        if RPCS[name][1]:
            list(result)
    except grpc.RpcError as e:
        assert e.code() in CLIENT_ERRORS, (e.code(), e.details())
        assert e.details(), e.code()
        event(f"{name} {e.code().name}")
        return e
    event(f"{name} OK")
    return None


def assert_still_serves(rpcs) -> None:
    ok = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParameters(max_tokens=2, temperature=0))
    response = pb.CompleteResponse.FromString(rpcs["Complete"](ok.SerializeToString(), timeout=120))
    assert response.usage.completion_tokens == 2


def over_valid(changes: pb.GenerateRequest) -> pb.GenerateRequest:
    """A valid request with a few fields changed: gets further into the server than a random one."""
    request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParameters(max_tokens=2))
    request.MergeFrom(changes)
    return request


GENERATE_REQUESTS = messages(pb.GenerateRequest) | messages(pb.GenerateRequest, rate=10).map(over_valid)


def test_generate_messages(rpcs):
    @fuzz_settings(60)
    @given(request=GENERATE_REQUESTS, name=st.sampled_from(["Generate", "Complete"]))
    def run(request: pb.GenerateRequest, name: str) -> None:
        error = call(rpcs, name, request.SerializeToString())
        if error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            named = field_names(request)
            assert any(re.search(rf"\b{n}\b", error.details()) for n in named), (error.details(), named)

    run()
    assert_still_serves(rpcs)


def test_other_rpc_messages(rpcs):
    @fuzz_settings(20)
    @given(data=st.data(), name=st.sampled_from(["Tokenize", "ListModels", "Health"]))
    def run(data, name: str) -> None:
        call(rpcs, name, data.draw(messages(RPCS[name][0])).SerializeToString())

    run()
    assert_still_serves(rpcs)


VALID = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParameters(max_tokens=2, stop=["abc"])).SerializeToString()


@st.composite
def raw_bytes(draw) -> bytes:
    """Random bytes, or a valid request cut short, with a byte changed, or with invalid UTF-8 in a string."""
    kind = draw(st.sampled_from(["random", "cut", "flip", "utf8"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    i = draw(st.integers(0, len(VALID) - 1))
    if kind == "cut":
        return VALID[:i]
    if kind == "flip":
        return VALID[:i] + bytes([draw(st.integers(0, 255))]) + VALID[i + 1:]
    bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"]))
    return VALID.replace(b"abc", b"a" + bad + b"c") if draw(st.booleans()) else VALID.replace(b"Hello", bad * 5)


def test_raw_bytes(rpcs):
    @fuzz_settings(60)
    @given(raw=raw_bytes(), name=st.sampled_from(list(RPCS)))
    def run(raw: bytes, name: str) -> None:
        call(rpcs, name, raw)

    run()
    assert_still_serves(rpcs)
