import collections
from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest

from sidecar._src.core import errors
from sidecar._src.wire import codec, pbscan
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def roundtrip(x, **kw):
  return codec.decode(pb.Value.FromString(codec.encode(x, **kw).SerializeToString()))


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 1 << 63, -(1 << 80), 2.5, float("inf"), "", "héllo", b"",
    b"\x00\xff" * 10, (), [], {}, (1, [2, {"a": None}]), {"x": 1, 3: "y"},
], ids=repr)
def test_plain_values_roundtrip(value):
  out = roundtrip(value)
  assert out == value and type(out) is type(value)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "int64", "float16",
                                   "float32", "float64", "complex64", ml_dtypes.bfloat16],
                         ids=str)
def test_arrays_and_scalars_roundtrip(dtype):
  a = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
  out = roundtrip({"a": a, "s": a.reshape(-1)[1]})
  np.testing.assert_array_equal(out["a"], a)
  assert out["a"].dtype == a.dtype and out["a"].flags.writeable
  assert isinstance(out["s"], np.generic) and out["s"].dtype == a.dtype


def test_big_endian_and_non_contiguous_are_normalized():
  a = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
  out = roundtrip(a)
  np.testing.assert_array_equal(out, a)
  assert out.dtype == np.dtype("int32")


@pytest.mark.parametrize("bad,match", [
    (object(), r"value: values of type builtins.object cannot be sent"),
    ({"k": [1, lambda: 0]}, r"value\['k'\]\[1\]: values of type .*function"),
    (np.array(["a"], dtype=object), "dtype 'object' is not allowed"),
    ({(1, 2): 3}, "dict key"),
    ({1.5: 3}, "dict key"),
], ids=["object", "nested-lambda", "object-array", "tuple-key", "float-key"])
def test_unsupported_values_name_the_path(bad, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    codec.encode(bad)


def test_too_deep_is_rejected():
  x = []
  for _ in range(100):
    x = [x]
  with pytest.raises(errors.InvalidArgumentError, match="nesting deeper than"):
    codec.encode(x)


@pytest.mark.parametrize("value,match", [
    (pb.Value(array=pb.Array(dtype="float32", shape=[4], data=b"\0" * 15)),
     "needs 16 bytes, got 15"),
    (pb.Value(array=pb.Array(dtype="object", shape=[1], data=b"\0" * 8)), "not allowed"),
    (pb.Value(array=pb.Array(dtype="int8", shape=[-1], data=b"")), "negative dimension"),
    (pb.Value(big_int="12x"), "bad big_int"),
    (pb.Value(), "empty or unknown value kind"),
    (pb.Value(arena=pb.ArenaRef(offset=0, nbytes=8, generation=1, dtype="int8", shape=[8])),
     "no arena attached"),
    (pb.Value(arena=pb.ArenaRef(offset=0, nbytes=1 << 26, generation=1, dtype="int8", shape=[8])),
     r"shape \(8,\) of int8 needs 8 bytes, got 67108864"),
    (pb.Value(arena=pb.ArenaRef(offset=0, nbytes=0, generation=1, dtype="int8", shape=[0])),
     "an arena reference needs nbytes > 0, got 0"),
], ids=["short-data", "object-dtype", "negative-shape", "big-int", "empty", "arena-without-arena",
        "arena-nbytes-past-shape", "arena-empty"])
def test_malformed_values_are_invalid_argument(value, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    codec.decode(value)


def test_large_arrays_go_to_the_arena_small_ones_inline():
  sent = []

  def to_arena(a):
    sent.append(a)
    return codec.ArenaRef(4096, a.nbytes, 7, a.dtype.name, a.shape)

  big, small = np.ones((256, 256), np.float32), np.ones(4, np.float32)
  v = codec.encode({"big": big, "small": small}, to_arena=to_arena, inline_limit=1024)
  assert len(sent) == 1 and sent[0] is big or np.shares_memory(sent[0], big)
  kinds = {e.key.str_value: e.value.WhichOneof("kind") for e in v.dict.entries}
  assert kinds == {"big": "arena", "small": "array"}
  assert len(v.SerializeToString()) < 1024  # the big array's bytes are not in the message
  seen = []
  out = codec.decode(v, from_arena=lambda ref: seen.append(ref) or np.zeros(ref.shape, ref.dtype))
  assert seen == [codec.ArenaRef(4096, big.nbytes, 7, "float32", (256, 256))]
  assert out["big"].shape == (256, 256)


def test_arena_blocks_lists_every_reference_in_order():
  offsets = iter(range(0, 1 << 30, 4096))
  to_arena = lambda a: codec.ArenaRef(next(offsets), a.nbytes, 3, a.dtype.name, a.shape)
  big = np.ones(2048, np.uint8)
  v = codec.encode({"a": big, "b": [1, (big, "x")], "c": {"d": big}, "e": np.ones(2)},
                   to_arena=to_arena, inline_limit=1024)
  assert codec.arena_blocks(v) == [0, 3, 4096, 3, 8192, 3]
  assert codec.arena_blocks(codec.encode([1, "two", None])) == []


def test_zero_d_arrays_keep_their_shape():
  out = roundtrip({"a": np.array(3, np.int32)})
  assert out["a"].shape == () and out["a"].dtype == np.int32 and int(out["a"]) == 3


def test_arena_errors_name_the_field():
  def from_arena(ref):
    raise errors.StaleDescriptorError(f"no block at offset {ref.offset}")

  ref = pb.Value(arena=pb.ArenaRef(offset=4096, nbytes=8, generation=1, dtype="int8", shape=[8]))
  entry = pb.DictEntry(key=pb.Value(str_value="w"), value=ref)
  value = pb.Value(dict=pb.DictValue(entries=[entry]))
  with pytest.raises(errors.StaleDescriptorError,
                     match=r"^kwargs\['w'\]: no block at offset 4096$"):
    codec.decode(value, from_arena=from_arena, where="kwargs")


def _nones(n: int) -> pb.Value:
  return pb.Value(tuple=pb.ListValue(items=[pb.Value(none=True)] * n))


@pytest.mark.parametrize("value,match", [
    (_nones(101), r"args: the request holds more than 100 values"),
    (pb.Value(list=pb.ListValue(items=[_nones(60), _nones(60)])),
     r"args\[1\]: the request holds more than 100 values"),
    (pb.Value(dict=pb.DictValue(entries=[pb.DictEntry(
        key=pb.Value(int_value=i), value=pb.Value(none=True)) for i in range(51)])),
     r"args: the request holds more than 100 values"),
    (pb.Value(str_value="x" * 1001), r"args: the request holds more than 1000 bytes"),
    (pb.Value(list=pb.ListValue(items=[codec.encode(np.zeros(600, np.uint8))] * 2)),
     r"args\[1\]: the request holds more than 1000 bytes"),
], ids=["nones", "nested", "dict", "str", "arrays"])
def test_a_request_past_its_budget_is_resource_exhausted_before_it_is_decoded(value, match):
  with pytest.raises(errors.ResourceExhaustedError, match=match + r".*limit of one request"):
    codec.decode(value, where="args", budget=codec.Budget(elements=100, nbytes=1000))


def test_a_budget_is_shared_by_the_decodes_of_one_request_and_the_default_is_the_limit():
  budget = codec.Budget(elements=100)
  assert codec.decode(_nones(60), budget=budget) == (None,) * 60
  with pytest.raises(errors.ResourceExhaustedError, match="kwargs: .* more than 100 values"):
    codec.decode(_nones(60), where="kwargs", budget=budget)
  assert (codec.Budget().max_elements, codec.Budget().max_nbytes) == (
      codec.MAX_ELEMENTS, codec.MAX_DECODED_BYTES)
  assert len(codec.decode(_nones(1000))) == 1000  # no budget: no limit


def test_a_big_message_of_too_many_values_is_counted_on_the_wire_before_it_is_parsed():
  nones = pb.CallRequest(name="echo", args=_nones(codec.MAX_ELEMENTS + 1)).SerializeToString()
  assert len(nones) >= codec.SCAN_FROM
  with pytest.raises(errors.ResourceExhaustedError,
                     match=rf"CallRequest holds more than {codec.MAX_ELEMENTS} values"):
    codec.check_message_count(nones, pb.CallRequest.DESCRIPTOR)
  big = pb.CallRequest(name="echo", args=codec.encode((b"x" * codec.SCAN_FROM, [1] * 100)))
  codec.check_message_count(big.SerializeToString(), pb.CallRequest.DESCRIPTOR)  # few values
  codec.check_message_count(b"\x12\xff\xff\xff\x0f" + b"\x0a" * codec.SCAN_FROM,
                            pb.CallRequest.DESCRIPTOR)  # malformed: left to the parse
  # Fields that are no value cost the scan too: millions of them are refused, the scan
  # stopping there (not going on for a minute through 256 MiB of them).
  unknown = b"\x78\x01" * (2 * codec.MAX_ELEMENTS + 1)  # field 15, a varint
  with pytest.raises(errors.ResourceExhaustedError, match="holds more than"):
    codec.check_message_count(unknown, pb.CallRequest.DESCRIPTOR)
  # What codec.encode makes of a list of ints, built directly (encoding a million Python
  # ints took 16 s of this test at a load of 8).
  ints = pb.CallRequest(name="echo", args=pb.Value(list=pb.ListValue(
      items=[pb.Value(int_value=7)] * (codec.MAX_ELEMENTS - 2))))
  assert pb.Value(list=pb.ListValue(items=[pb.Value(int_value=7)])) == codec.encode([7])
  codec.check_message_count(ints.SerializeToString(), pb.CallRequest.DESCRIPTOR)  # a scalar each


def test_the_scan_budget_for_fields_that_are_no_value_is_one_for_the_whole_message():
  # 10 values, each holding 50 unknown fields: 500 such fields for a limit of 100 values
  # (200 of them) though no one level holds more than 50.
  stuffed = pb.Value.FromString(b"\x78\x01" * 50)
  big = pb.Value(bytes_value=b"x" * codec.SCAN_FROM)
  nested = pb.CallRequest(name="echo", args=pb.Value(list=pb.ListValue(
      items=[stuffed] * 10 + [big]))).SerializeToString()
  with pytest.raises(errors.ResourceExhaustedError, match="holds more than 100 values"):
    codec.check_message_count(nested, pb.CallRequest.DESCRIPTOR, limit=100)
  empty = b"\x7a\x00" * (codec.SCAN_FROM // 2)  # empty length-delimited unknown fields
  with pytest.raises(errors.ResourceExhaustedError, match="holds more than 100 values"):
    codec.check_message_count(empty, pb.CallRequest.DESCRIPTOR, limit=100)
  few = pb.CallRequest(name="echo", args=pb.Value(list=pb.ListValue(
      items=[stuffed] + [big]))).SerializeToString()
  codec.check_message_count(few, pb.CallRequest.DESCRIPTOR, limit=100)  # 50 + 3 fields


class Point(NamedTuple):
  x: int
  y: np.ndarray


Pair = collections.namedtuple("Pair", "a b")


def test_namedtuples_come_back_as_their_class_where_it_is_imported():
  value = {"p": Point(1, np.arange(3)), "q": [Pair(None, (2, Point(3, np.zeros(1))))]}
  out = codec.decode(codec.encode(value), budget=codec.Budget())
  assert type(out["p"]) is Point and type(out["q"][0]) is Pair
  assert type(out["q"][0].b) is tuple and type(out["q"][0].b[1]) is Point
  np.testing.assert_array_equal(out["p"].y, np.arange(3))


def test_a_namedtuple_whose_class_is_not_here_is_a_namedtuple_of_its_name_and_fields():
  encoded = codec.encode(Point(1, 2))
  encoded.named_tuple.module = "not.imported"
  out = codec.decode(encoded)
  assert type(out) is not Point and type(out).__name__ == "Point"
  assert out._fields == ("x", "y") and (out.x, out.y) == (1, 2) and out == (1, 2)
  encoded.named_tuple.module = __name__
  encoded.named_tuple.fields[:] = ["x", "z"]  # this module's Point has other fields
  assert codec.decode(encoded)._fields == ("x", "z")


@pytest.mark.parametrize("fields,match", [
    (["x"], "a namedtuple of 1 fields holds 2 items"),
    (["x", "x"], "names must be distinct identifiers"),
    (["x", "_y"], "names must be distinct identifiers"),
    (["x", "class"], "names must be distinct identifiers"),
], ids=["count", "twice", "underscore", "keyword"])
def test_a_malformed_namedtuple_is_invalid_argument(fields, match):
  encoded = codec.encode(Point(1, 2))
  encoded.named_tuple.module = "not.imported"
  encoded.named_tuple.fields[:] = fields
  with pytest.raises(errors.InvalidArgumentError, match=match):
    codec.decode(encoded)


def test_a_namedtuples_arena_blocks_are_listed():
  ref = codec.ArenaRef(4096, 8, 7, "float32", (2,))
  value = codec.encode(Pair(np.zeros(2, np.float32), 1), to_arena=lambda a: ref, inline_limit=1)
  assert codec.arena_blocks(value) == [4096, 7]


def test_a_big_inline_array_stays_in_the_request_bytes_until_it_is_decoded():
  """Protobuf's parse copied a large inline array twice more (its own copy, the bytes
  field read out of it): strip_arrays leaves it in the request's bytes, a view decodes it."""
  big = np.arange(pbscan.BIG_ARRAY // 4 + 3, dtype=np.int32)
  small = np.arange(10, dtype=np.int16)
  request = pb.CallRequest(name="f", args=codec.encode((big, {"s": small, "b": big[::-1]}),
                                                       inline_limit=1 << 40),
                           kwargs=codec.encode({"k": big[:5]}))
  raw = request.SerializeToString()
  stripped, views = pbscan.strip_arrays(raw, pb.CallRequest.DESCRIPTOR)
  assert len(stripped) < 1024 and len(views) == 2
  assert all(v.obj is raw for v in views)  # views of the bytes gRPC gave, not copies
  parsed = pb.CallRequest.FromString(stripped)
  budget = codec.Budget(views=views)
  args = codec.decode(parsed.args, budget=budget)
  np.testing.assert_array_equal(args[0], big)
  np.testing.assert_array_equal(args[1]["b"], big[::-1])
  np.testing.assert_array_equal(args[1]["s"], small)
  np.testing.assert_array_equal(codec.decode(parsed.kwargs, budget=budget)["k"], big[:5])
  assert args[0].flags.writeable and not np.shares_memory(args[0], np.frombuffer(raw, np.uint8))
  assert budget.nbytes == codec.MAX_DECODED_BYTES - 2 * big.nbytes - small.nbytes - 20 - 3  # keys
  # Bytes it cannot read come back as they are, for protobuf's parse to refuse.
  broken = raw[:-3]  # its last field runs past the end
  assert pbscan.strip_arrays(broken, pb.CallRequest.DESCRIPTOR) == (broken, [])
  assert pbscan.strip_arrays(raw[:100], pb.CallRequest.DESCRIPTOR) == (raw[:100], [])
