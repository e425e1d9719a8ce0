"""The protobuf wire format, as far as rnnfuse reads and writes it itself.

A weight-heavy model is mostly the ``raw_data`` bytes of a few initializers. Two jobs need those bytes found
or placed without protobuf holding them in memory:

- :func:`borrow_plan` (loading): the model's serialization with the big ``raw_data`` fields of the main
  graph's initializers replaced by external-data entries that point back into the file itself;
- :func:`splice_plan` (saving): where, in a serialization whose big tensors hold a short marker instead of
  their bytes, those bytes go, and what every enclosing length prefix becomes.

Both only read a message's top-level fields and step over every field they do not need by its length, so a
100k-node graph costs one short Python step per node. Anything unexpected raises :class:`WireError`; callers
then fall back to protobuf's own parser or serializer, which give their usual errors.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

VARINT, I64, LEN, I32 = 0, 1, 2, 5

# field numbers (onnx.proto)
MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_SEGMENT = 3
TENSOR_NAME = 8
TENSOR_RAW_DATA = 9
TENSOR_EXTERNAL_DATA = 13
TENSOR_DATA_LOCATION = 14
# the typed value fields (float_data, int32_data, string_data, int64_data, double_data, uint64_data): a tensor
# holding one of them beside raw_data is left to protobuf
TENSOR_TYPED_DATA = frozenset({4, 5, 6, 7, 10, 11})
ENTRY_KEY, ENTRY_VALUE = 1, 2
MODEL_IR_VERSION = 1
MODEL_OPSET_IMPORT = 8
OPSET_DOMAIN, OPSET_VERSION = 1, 2
GRAPH_NODE = 1
NODE_OP_TYPE = 4
NODE_ATTRIBUTE = 5
NODE_DOMAIN = 7
ATTRIBUTE_GRAPH = 6
ATTRIBUTE_GRAPHS = 11
EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


class WireError(ValueError):
    """The bytes are not the protobuf rnnfuse expects (truncated, an unknown wire type, a field twice)."""


def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def length_field(number: int, payload: bytes) -> bytes:
    return tag(number, LEN) + varint(len(payload)) + payload


def fast_fields(buf, start: int, end: int):
    """``(key, field_start, value_start, value_end)`` of each top-level field of the message in
    ``buf[start:end]``; ``key`` is the field number shifted left by 3 with the wire type in the low bits.

    The one walk over a message's fields (:func:`fields` names its parts). It meets every node of a graph,
    so one- and two-byte varints (the tags and lengths of nodes and their names) are read inline: a field
    costs a few bytecodes (0.09 s for the 216k nodes of a graph, a third of a walk by read_varint alone)."""
    pos = start
    try:
        while pos < end:
            fs = pos
            key = buf[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = read_varint(buf, pos, end)
            wt = key & 7
            if key < 8:
                raise WireError("field number 0")
            if wt == LEN:
                n = buf[pos]
                if n < 0x80:
                    pos += 1
                else:
                    b2 = buf[pos + 1]
                    if b2 < 0x80:
                        n = (n & 0x7F) | (b2 << 7)
                        pos += 2
                    else:
                        n, pos = read_varint(buf, pos, end)
                vs = pos
                pos += n
            elif wt == VARINT:
                vs = pos
                _, pos = read_varint(buf, pos, end)
            elif wt == I64:
                vs = pos
                pos += 8
            elif wt == I32:
                vs = pos
                pos += 4
            else:
                raise WireError(f"wire type {wt}")
            if pos > end:
                raise WireError("a field runs past its message")
            yield key, fs, vs, pos
    except IndexError:
        raise WireError("truncated") from None


def fields(buf, start: int, end: int):
    """``(number, wire_type, field_start, value_start, value_end)`` for each top-level field of the message
    in ``buf[start:end]``; a varint's value is read with :func:`read_varint` at ``value_start``."""
    for key, fs, vs, ve in fast_fields(buf, start, end):
        yield key >> 3, key & 7, fs, vs, ve


# -- reading: what a model holds, without parsing it ----------------------------------------------------------


class OpsetId(NamedTuple):
    domain: str
    version: int


@dataclass
class Outline:
    """What a model file says about itself: enough to decide that no pass has anything to do in it."""

    ir_version: int
    opset_import: list[OpsetId]
    ops: Counter  # op type -> nodes of that type, subgraphs' included, in order of first appearance


# the ops whose attributes may hold subgraphs (as rnnfuse.protos.subgraphs reads them), and any op of
# another domain
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})
_NODE_KEY = (GRAPH_NODE << 3) | LEN
_OP_TYPE_KEY = (NODE_OP_TYPE << 3) | LEN
_DOMAIN_KEY = (NODE_DOMAIN << 3) | LEN
_ATTRIBUTE_KEY = (NODE_ATTRIBUTE << 3) | LEN
_SUBGRAPH_KEYS = frozenset({(ATTRIBUTE_GRAPH << 3) | LEN, (ATTRIBUTE_GRAPHS << 3) | LEN})


def outline(buf, stop_at: frozenset = frozenset()) -> Outline | None:
    """The IR version, opset imports and op-type counts (every depth) of the model serialized in ``buf``,
    read field by field without parsing: a node costs one short step per field, and tensor bytes are stepped
    over unread (a memory-mapped file is not paged in). None as soon as a node's op type is in ``stop_at``
    (the caller needs the model itself then). Raises :class:`WireError` on anything unexpected, and when the
    bytes hold no graph or no IR version (what protobuf and onnx would refuse is left to them)."""
    end = len(buf)
    ir_version = 0
    opsets: list[OpsetId] = []
    graph = None
    for number, wt, fs, vs, ve in fields(buf, 0, end):
        if number == MODEL_IR_VERSION and wt == VARINT:
            ir_version = read_varint(buf, vs, ve)[0]
        elif number == MODEL_OPSET_IMPORT and wt == LEN:
            opsets.append(_opset_id(buf, vs, ve))
        elif number == MODEL_GRAPH:
            if wt != LEN or graph is not None:
                raise WireError("the model's graph field is not one message")
            graph = (vs, ve)
        elif number in (MODEL_IR_VERSION, MODEL_OPSET_IMPORT):
            raise WireError("an IR version or opset import of another wire type")
    if graph is None or ir_version <= 0:
        raise WireError("no graph or no IR version")
    ops: Counter = Counter()
    stack = [graph]
    while stack:
        nested: list = []
        for key, _, vs, ve in fast_fields(buf, *stack.pop()):
            if key != _NODE_KEY:
                continue
            op, domain, attributes = _node(buf, vs, ve)
            if op in stop_at:
                return None
            ops[op] += 1
            if attributes and (op in _CONTROL_FLOW or domain not in ("", "ai.onnx")):
                for a_vs, a_ve in attributes:
                    nested += [(s, e) for k, _, s, e in fast_fields(buf, a_vs, a_ve) if k in _SUBGRAPH_KEYS]
        stack += nested  # (a graph's subgraphs after the graph, as rnnfuse.findings.op_counts counts them)
    return Outline(ir_version, opsets, ops)


def may_name_an_op(buf, ops) -> bool:
    """Whether the bytes hold a node's op-type field naming one of ``ops`` as an encoder writes it (the tag,
    a one-byte length, the name), anywhere: one regular-expression scan that stops at the first (a 7 MB
    file with none: ~6 ms). True may be a false alarm (the same bytes inside a name or a weight); False says
    only that no such field is written the usual way (a longer length encoding is legal): :func:`outline`
    alone reads every node. A model whose recurrence comes after a 100,000-node prologue was walked node by
    node to its end to learn that it has one."""
    names = sorted((op.encode() for op in ops if 0 < len(op.encode()) < 0x80), key=len, reverse=True)
    if not names:
        return False
    fields = re.compile(re.escape(bytes([_OP_TYPE_KEY])) + b"(?:" + b"|".join(re.escape(bytes([len(n)]) + n) for n in names) + b")")
    return fields.search(buf) is not None


def _node(buf, start: int, end: int) -> tuple[str, str, list]:
    """A NodeProto's op type, domain and the spans of its attributes.

    Every field of a NodeProto is length-delimited, and names are short: the common case, a one-byte tag
    and a length under 16384, is read inline (this loop meets every field of every node of a graph)."""
    op = domain = b""
    attributes = []
    pos = start
    try:
        while pos < end:
            key = buf[pos]
            n = buf[pos + 1]
            if 8 <= key < 0x80 and key & 7 == LEN and n < 0x80:
                vs = pos + 2
            elif 8 <= key < 0x80 and key & 7 == LEN and buf[pos + 2] < 0x80:
                n = (n & 0x7F) | (buf[pos + 2] << 7)
                vs = pos + 3
            else:  # (a long tag, a long value, another wire type: the general reader)
                key, _, vs, pos = next(fast_fields(buf, pos, end))
                n = pos - vs
            pos = vs + n
            if key == _OP_TYPE_KEY:
                op = buf[vs:pos]
            elif key == _DOMAIN_KEY:
                domain = buf[vs:pos]
            elif key == _ATTRIBUTE_KEY:
                attributes.append((vs, pos))
    except IndexError:
        raise WireError("truncated") from None
    if pos != end:
        raise WireError("a field runs past its node")
    return bytes(op).decode("utf-8"), bytes(domain).decode("utf-8"), attributes


def _opset_id(buf, start: int, end: int) -> OpsetId:
    domain, version = "", 0
    for number, wt, _, vs, ve in fields(buf, start, end):
        if number == OPSET_DOMAIN and wt == LEN:
            domain = bytes(buf[vs:ve]).decode("utf-8")
        elif number == OPSET_VERSION and wt == VARINT:
            version = read_varint(buf, vs, ve)[0]
    return OpsetId(domain, version)


# -- loading: borrow the big raw_data of the main graph's initializers -----------------------------------------


@dataclass
class Borrowed:
    """One initializer whose bytes stay in the file: its position among the main graph's initializers and
    where its ``raw_data`` lies in the file."""

    index: int
    offset: int
    length: int


def borrow_plan(buf, location: str, min_bytes: int) -> tuple[list, list[Borrowed]]:
    """``(pieces, borrowed)``: the model serialized in ``buf`` (a whole ``.onnx`` file) as a list of byte
    pieces whose concatenation is the same model with the ``raw_data`` of every main-graph initializer of at
    least ``min_bytes`` bytes replaced by external data pointing at ``location`` (the file itself), at the
    absolute offset of those bytes. Pieces are slices of ``buf`` (memoryviews) or short new bytes.

    Raises :class:`WireError` on anything unexpected, including a tensor that already names external data
    (such a model takes rnnfuse's external-data path as it is)."""
    end = len(buf)
    loc = location.encode("utf-8")  # (a name that is no UTF-8 raises UnicodeEncodeError: not borrowed)
    graph = None
    for number, wt, fs, vs, ve in fields(buf, 0, end):
        if number == MODEL_GRAPH:
            if wt != LEN or graph is not None:
                raise WireError("the model's graph field is not one message")  # (protobuf would merge two)
            graph = (fs, vs, ve)
    if graph is None:
        raise WireError("no graph")
    g_fs, g_vs, g_ve = graph
    view = memoryview(buf)
    graph_pieces: list = []
    borrowed: list[Borrowed] = []
    copied_to = g_vs  # graph bytes up to here are in graph_pieces
    k = -1
    for fs, vs, ve in _initializers(buf, g_vs, g_ve):
        k += 1
        if ve > g_ve:
            raise WireError("an initializer runs past the graph")
        raw = _big_raw_data(buf, vs, ve, min_bytes)
        if raw is None:
            continue
        r_fs, r_vs, r_ve = raw
        entries = b"".join(
            length_field(TENSOR_EXTERNAL_DATA, length_field(ENTRY_KEY, key) + length_field(ENTRY_VALUE, value))
            for key, value in ((b"location", loc), (b"offset", str(r_vs).encode()), (b"length", str(r_ve - r_vs).encode()))
        ) + tag(TENSOR_DATA_LOCATION, VARINT) + varint(EXTERNAL)
        size = (ve - vs) - (r_ve - r_fs) + len(entries)
        graph_pieces += [view[copied_to:fs], tag(GRAPH_INITIALIZER, LEN) + varint(size), view[vs:r_fs], view[r_ve:ve], entries]
        copied_to = ve
        borrowed.append(Borrowed(k, r_vs, r_ve - r_vs))
    graph_pieces.append(view[copied_to:g_ve])
    graph_size = sum(len(p) for p in graph_pieces)
    pieces = [view[0:g_fs], tag(MODEL_GRAPH, LEN) + varint(graph_size), *graph_pieces, view[g_ve:end]]
    return pieces, borrowed


_INITIALIZER_KEY = (GRAPH_INITIALIZER << 3) | LEN


def _initializers(buf, start: int, end: int):
    """``(field_start, value_start, value_end)`` of each initializer of the GraphProto in ``buf[start:end]``."""
    for key, fs, vs, ve in fast_fields(buf, start, end):
        if key == _INITIALIZER_KEY:
            yield fs, vs, ve
        elif key >> 3 == GRAPH_INITIALIZER:
            raise WireError("an initializer that is not a message")


def _big_raw_data(buf, start: int, end: int, min_bytes: int) -> tuple[int, int, int] | None:
    """``(field_start, value_start, value_end)`` of the TensorProto's ``raw_data`` when it has at least
    ``min_bytes`` and nothing else that would make it ambiguous (a second raw_data, a segment, typed values
    beside it); else None (the tensor stays as it is). External data raises WireError."""
    raw = None
    for number, wt, fs, vs, ve in fields(buf, start, end):
        if number in (TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION):
            raise WireError("a tensor already stored as external data")
        if number == TENSOR_RAW_DATA:
            if wt != LEN:
                raise WireError("raw_data that is not bytes")
            if raw is not None:
                return None
            raw = (fs, vs, ve)
        elif number == TENSOR_SEGMENT or number in TENSOR_TYPED_DATA:
            return None
    if raw is None or raw[2] - raw[1] < min_bytes:
        return None
    return raw


# -- saving: splice tensor bytes into a serialization ----------------------------------------------------------


def splice_plan(buf, markers: dict[bytes, int], sizes: list[int]) -> list:
    """The pieces of the message serialized in ``buf`` once each ``raw_data`` field whose value is a marker
    (``markers``: marker bytes -> hole number) holds ``sizes[hole]`` bytes instead: slices of ``buf``, new
    tag and length bytes, and ints (the hole numbers, where the caller writes each tensor's bytes). Only
    messages that contain a marker are walked, and every length prefix on the way to one is rewritten."""
    positions = _marker_positions(buf, markers)
    pieces: list = []
    _splice(memoryview(buf), buf, 0, len(buf), positions, markers, sizes, pieces)
    return pieces


def _marker_positions(buf, markers: dict[bytes, int]) -> list[int]:
    """Where each marker is in ``buf``, sorted; one scan for the prefix they share (a search per marker
    would be quadratic in the number of tensors). Raises WireError when a marker is missing or repeated."""
    import os

    size = len(next(iter(markers)))
    if any(len(m) != size for m in markers):
        raise WireError("markers of different lengths")
    prefix = os.path.commonprefix(list(markers))
    found: dict[bytes, int] = {}
    p = buf.find(prefix)
    while p >= 0:
        m = bytes(buf[p : p + size])
        if m in markers:
            if m in found:
                raise WireError("a marker appears twice")
            found[m] = p
        p = buf.find(prefix, p + 1)
    if len(found) != len(markers):
        raise WireError("a marker is missing")
    return sorted(found.values())


def _splice(view, buf, start: int, end: int, positions: list[int], markers, sizes, pieces: list) -> int:
    """Append the pieces of ``buf[start:end]`` (a message's fields) to ``pieces``; returns their new size."""
    import bisect

    size = 0
    copied_to = start
    for number, wt, fs, vs, ve in fields(buf, start, end):
        if wt != LEN:
            continue
        lo = bisect.bisect_left(positions, vs)
        if lo == len(positions) or positions[lo] >= ve:
            continue  # no marker inside
        pieces.append(view[copied_to:fs])
        size += fs - copied_to
        copied_to = ve
        value = bytes(view[vs:ve]) if ve - vs <= 64 else None
        if number == TENSOR_RAW_DATA and value is not None and value in markers and positions[lo] == vs:
            hole = markers[value]
            head = tag(number, LEN) + varint(sizes[hole])
            pieces += [head, hole]
            size += len(head) + sizes[hole]
            continue
        # a message on the way to a marker: its content first (its size is known only then)
        inner: list = []
        inner_size = _splice(view, buf, vs, ve, positions, markers, sizes, inner)
        head = tag(number, LEN) + varint(inner_size)
        pieces.append(head)
        pieces += inner
        size += len(head) + inner_size
    pieces.append(view[copied_to:end])
    return size + end - copied_to
