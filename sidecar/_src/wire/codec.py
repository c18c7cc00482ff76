"""The safe codec: pytrees of arrays, scalars, strings and bytes <-> ``pb.Value``.

Only these travel: dict, list, tuple, namedtuple, None, numpy arrays and scalars of
numeric dtypes, int, float, bool, str and bytes. Nothing is pickled, in any mode. A
namedtuple arrives as its own class where the receiver has imported it (with the same
fields), else as a namedtuple of the same name and fields; decoding imports nothing
and runs no code of the class. Arrays
of ``inline_limit`` bytes or more go through the arena when a ``to_arena``
callback is given; then only an :class:`ArenaRef` crosses the wire.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import keyword
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf import message as pb_message

from sidecar._src.core import errors
from sidecar._src.core.dtypes import dtype_of, name_of
from sidecar._src.wire import pbscan
from sidecar._src.wire.protocol import pb

INLINE_LIMIT = 64 * 1024
# Containers nested in one value, at most: the one limit, both ways. Protobuf's parse
# refuses messages nested deeper than 100; a dict level takes 3 of them (Value, DictValue,
# DictEntry) and a request's own wrapping 4, so 30 levels always parse.
MAX_DEPTH = 30
# What one request may decode (Budget): a value costs the decoder ~0.5 us and ~50 bytes
# of Python objects however few bytes it took on the wire (a `none` takes 4), so the
# count of values is bounded as well as their bytes: a request costs what it sent.
MAX_ELEMENTS = 1 << 20
MAX_DECODED_BYTES = 256 << 20  # the control port's default max_message_size
_INT64 = (-(1 << 63), (1 << 63) - 1)

@dataclasses.dataclass(frozen=True, slots=True)
class ArenaRef:
  """Where an array lies in a sidecar's arena. The only thing that crosses for it."""
  offset: int
  nbytes: int
  generation: int
  dtype: str
  shape: tuple[int, ...]


def check_array(a: np.ndarray, where: str) -> np.ndarray:
  """``a`` as a C-contiguous native-order array of an allowed dtype."""
  name = a.dtype.newbyteorder("=").name if a.dtype.byteorder not in "=|" else name_of(a.dtype)
  dtype_of(name, where)
  if a.dtype.byteorder not in "=|":
    a = a.astype(a.dtype.newbyteorder("="))
  # np.ascontiguousarray would turn a 0-d array into shape (1,).
  return a if a.flags.c_contiguous else np.array(a, order="C")


ToArena = Callable[[np.ndarray], ArenaRef | None]
FromArena = Callable[[ArenaRef], np.ndarray]


def encode(tree: Any, *, to_arena: ToArena | None = None,
           inline_limit: int = INLINE_LIMIT, where: str = "value") -> pb.Value:
  """Encodes ``tree``; raises InvalidArgumentError naming the first bad leaf's path."""
  return _encode(tree, to_arena, inline_limit, where, 0)


def _encode(x: Any, to_arena, limit: int, where: str, depth: int) -> pb.Value:
  if depth > MAX_DEPTH:
    raise errors.InvalidArgumentError(
        f"{where}: nesting deeper than {MAX_DEPTH} levels (codec.MAX_DEPTH); flatten the value")
  if x is None:
    return pb.Value(none=True)
  if isinstance(x, np.generic):  # before float: np.float64 subclasses float
    a = check_array(np.asarray(x), where)
    return pb.Value(array=pb.Array(dtype=a.dtype.name, data=a.tobytes(), scalar=True))
  if isinstance(x, bool):
    return pb.Value(bool_value=x)
  if isinstance(x, int):
    if _INT64[0] <= x <= _INT64[1]:
      return pb.Value(int_value=x)
    return pb.Value(big_int=str(int(x)))
  if isinstance(x, float):
    return pb.Value(float_value=x)
  if isinstance(x, str):
    return pb.Value(str_value=x)
  if isinstance(x, (bytes, bytearray, memoryview)):
    return pb.Value(bytes_value=bytes(x))
  if isinstance(x, dict):
    entries = []
    for k, v in x.items():
      if not isinstance(k, (str, int)) or isinstance(k, bool):
        raise errors.InvalidArgumentError(
            f"{where}: dict key {k!r} of type {type(k).__name__} is not supported; "
            "keys must be str or int")
      entries.append(pb.DictEntry(key=_encode(k, None, limit, where, depth + 1),
                                  value=_encode(v, to_arena, limit, f"{where}[{k!r}]", depth + 1)))
    return pb.Value(dict=pb.DictValue(entries=entries))
  if isinstance(x, (list, tuple)):
    items = [_encode(v, to_arena, limit, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
    if isinstance(x, list):
      return pb.Value(list=pb.ListValue(items=items))
    fields = _namedtuple_fields(type(x))
    if fields is None:
      return pb.Value(tuple=pb.ListValue(items=items))
    cls = type(x)
    return pb.Value(named_tuple=pb.NamedTupleValue(
        module=cls.__module__, qualname=cls.__qualname__, fields=fields, items=items))
  if not isinstance(x, np.ndarray) and hasattr(x, "__array__") and hasattr(x, "dtype"):
    x = np.asarray(x)  # e.g. a jax.Array: its host value travels.
  if isinstance(x, np.ndarray):
    a = check_array(x, where)
    if to_arena is not None and a.nbytes >= max(limit, 1):
      ref = to_arena(a)
      if ref is not None:
        return arena_value(ref)
    return pb.Value(array=pb.Array(dtype=a.dtype.name, shape=a.shape, data=a.tobytes()))
  raise errors.InvalidArgumentError(
      f"{where}: values of type {type(x).__module__}.{type(x).__qualname__} cannot be sent; "
      "arguments and results are pytrees (dict, list, tuple, namedtuple, None) of numpy arrays, "
      "numpy scalars, int, float, bool, str and bytes")


def _namedtuple_fields(cls: type) -> tuple[str, ...] | None:
  """The fields of namedtuple class ``cls`` (a tuple subclass with ``_fields``), else None."""
  if cls is tuple:
    return None
  fields = getattr(cls, "_fields", None)
  if isinstance(fields, tuple) and all(isinstance(f, str) for f in fields):
    return fields
  return None


def _namedtuple_class(v: pb.NamedTupleValue, where: str) -> type:
  """The class a namedtuple is decoded as: the one its module (when this process has
  imported it) defines under its qualname with the same fields, else one made here."""
  fields = tuple(v.fields)
  if len(fields) != len(v.items):
    raise errors.InvalidArgumentError(
        f"{where}: a namedtuple of {len(fields)} fields holds {len(v.items)} items")
  found: Any = sys.modules.get(v.module)
  for part in v.qualname.split("."):  # vars(): no module __getattr__ or descriptor runs
    try:
      found = vars(found).get(part)
    except TypeError:
      found = None
      break
  if isinstance(found, type) and issubclass(found, tuple) and _namedtuple_fields(
      found) == fields:
    return found
  name = v.qualname.rpartition(".")[2]
  if not all(n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("_")
             for n in (name, *fields)) or len(set(fields)) != len(fields):
    raise errors.InvalidArgumentError(
        f"{where}: namedtuple {v.qualname[:80]!r} with fields {list(fields)[:20]} cannot be "
        "made: names must be distinct identifiers not starting with '_'")
  return _made_namedtuple(name, fields)


@functools.lru_cache(maxsize=256)
def _made_namedtuple(name: str, fields: tuple[str, ...]) -> type:
  return collections.namedtuple(name, fields)


@dataclasses.dataclass(slots=True)
class Budget:
  """What a request may still decode: values (every leaf and container counts one) and
  bytes (of strings, bytes and inline arrays; arena references cost none). Several
  decodes of one request share one budget.
  """
  elements: int = MAX_ELEMENTS
  nbytes: int = MAX_DECODED_BYTES
  # The large arrays' bytes, left in the request's wire bytes (``strip_arrays``).
  views: list[memoryview] = dataclasses.field(default_factory=list)
  max_elements: int = dataclasses.field(init=False)
  max_nbytes: int = dataclasses.field(init=False)

  def __post_init__(self):
    self.max_elements, self.max_nbytes = self.elements, self.nbytes

  def spend(self, where: str, *, elements: int = 0, nbytes: int = 0) -> None:
    """Takes from the budget before the work is done.

    Raises:
      ResourceExhaustedError: naming ``where`` and the limit it passed.
    """
    self.elements -= elements
    self.nbytes -= nbytes
    if self.elements < 0:
      raise errors.ResourceExhaustedError(
          f"{where}: the request holds more than {self.max_elements} values, the limit of "
          f"one request (codec.MAX_ELEMENTS); send many numbers as one numpy array")
    if self.nbytes < 0:
      raise errors.ResourceExhaustedError(
          f"{where}: the request holds more than {self.max_nbytes} bytes of strings, bytes "
          "and inline arrays, the limit of one request (codec.MAX_DECODED_BYTES); pass large "
          "arrays through a Worker's arena")


def decode(value: pb.Value, *, from_arena: FromArena | None = None, where: str = "value",
           budget: Budget | None = None, views: list[memoryview] | None = None) -> Any:
  """Decodes a ``pb.Value``; malformed input raises InvalidArgumentError.

  With a ``budget``, a value past it raises ResourceExhaustedError before it is decoded.
  ``views``, with no budget: the large arrays' bytes of a response that came in parts
  (``pbscan.strip_arrays``), decoded with no limit (a response is what its caller asked
  for; what it may take is its message size).
  """
  if budget is None and views:
    budget = Budget(elements=sys.maxsize, nbytes=sys.maxsize, views=views)
  if budget is not None:
    budget.spend(where, elements=1)
  return _decode(value, from_arena, where, 0, budget)


def arena_value(ref: ArenaRef) -> pb.Value:
  """The encoded value of the array ``ref`` names."""
  return pb.Value(arena=pb.ArenaRef(offset=ref.offset, nbytes=ref.nbytes,
                                    generation=ref.generation, dtype=ref.dtype, shape=ref.shape))


def arena_blocks(value: pb.Value) -> list[int]:
  """The arena blocks an encoded value refers to, as flattened (offset, generation) pairs."""
  kind = value.WhichOneof("kind")
  if kind == "arena":
    return [value.arena.offset, value.arena.generation]
  if kind in ("list", "tuple", "named_tuple"):
    return [x for item in getattr(value, kind).items for x in arena_blocks(item)]
  if kind == "dict":
    return [x for e in value.dict.entries for x in arena_blocks(e.value)]
  return []


def _decode(v: pb.Value, from_arena, where: str, depth: int, budget: Budget | None) -> Any:
  if depth > MAX_DEPTH:
    raise errors.InvalidArgumentError(
        f"{where}: nesting deeper than {MAX_DEPTH} levels (codec.MAX_DEPTH); flatten the value")
  kind = v.WhichOneof("kind")
  if kind == "none":
    return None
  if kind in ("bool_value", "int_value", "float_value"):
    return getattr(v, kind)
  if kind in ("str_value", "bytes_value"):
    x = getattr(v, kind)
    if budget is not None:
      budget.spend(where, nbytes=len(x))
    return x
  if kind == "big_int":
    if budget is not None:
      budget.spend(where, nbytes=len(v.big_int))
    try:
      return int(v.big_int)
    except ValueError:
      raise errors.InvalidArgumentError(f"{where}: bad big_int {v.big_int[:40]!r}") from None
  if kind == "array":
    data: bytes | memoryview = v.array.data  # once: each read copies it out of protobuf
    if budget is not None and budget.views:
      data = pbscan.stripped(data, budget.views)
    if budget is not None:
      budget.spend(where, nbytes=len(data))
    return _decode_array(v.array, where, data)
  if kind == "arena":
    r = v.arena
    ref = ArenaRef(r.offset, r.nbytes, r.generation, r.dtype, tuple(r.shape))
    dtype = dtype_of(ref.dtype, where)
    _check_size(ref.shape, dtype, ref.nbytes, where)
    if ref.nbytes <= 0:
      raise errors.InvalidArgumentError(
          f"{where}: an arena reference needs nbytes > 0, got {ref.nbytes} for shape "
          f"{ref.shape}; send empty arrays inline")
    if from_arena is None:
      raise errors.InvalidArgumentError(
          f"{where}: an arena reference arrived but this side has no arena attached")
    try:
      return from_arena(ref)
    except (errors.InvalidArgumentError, errors.StaleDescriptorError) as e:
      raise type(e)(f"{where}: {e}") from None
  if kind in ("list", "tuple"):
    children = getattr(v, kind).items
    if budget is not None:  # counted before any is decoded: the refusal costs nothing
      budget.spend(where, elements=len(children))
    items = [_decode(x, from_arena, f"{where}[{i}]", depth + 1, budget)
             for i, x in enumerate(children)]
    return tuple(items) if kind == "tuple" else items
  if kind == "named_tuple":
    nt = v.named_tuple
    if budget is not None:
      budget.spend(where, elements=len(nt.items),
                   nbytes=len(nt.module) + len(nt.qualname) + sum(map(len, nt.fields)))
    cls = _namedtuple_class(nt, where)
    items = [_decode(x, from_arena, f"{where}.{f}", depth + 1, budget)
             for f, x in zip(nt.fields, nt.items)]
    return tuple.__new__(cls, items)  # no __new__ of the class runs
  if kind == "dict":
    entries = v.dict.entries
    if budget is not None:
      budget.spend(where, elements=2 * len(entries))
    out = {}
    for entry in entries:
      key = _decode(entry.key, None, where, depth + 1, budget)
      if not isinstance(key, (str, int)):
        raise errors.InvalidArgumentError(f"{where}: dict key {key!r} is not str or int")
      out[key] = _decode(entry.value, from_arena, f"{where}[{key!r}]", depth + 1, budget)
    return out
  raise errors.InvalidArgumentError(f"{where}: empty or unknown value kind {kind!r}")


def as_array(buffer: np.ndarray, ref: ArenaRef) -> np.ndarray:
  """The array ``ref`` describes, viewed (no copy) on the uint8 ``buffer`` of its block."""
  dtype = dtype_of(ref.dtype)
  need = math.prod(ref.shape) * dtype.itemsize
  return buffer[:need].view(dtype).reshape(ref.shape)


def _check_size(shape, dtype: np.dtype, nbytes: int, where: str):
  if any(d < 0 for d in shape):
    raise errors.InvalidArgumentError(f"{where}: negative dimension in shape {tuple(shape)}")
  need = math.prod(shape) * dtype.itemsize
  if need != nbytes:
    raise errors.InvalidArgumentError(
        f"{where}: shape {tuple(shape)} of {dtype.name} needs {need} bytes, got {nbytes}")


def _decode_array(a: pb.Array, where: str, data: bytes | memoryview | None = None) -> Any:
  dtype = dtype_of(a.dtype, where)
  shape = () if a.scalar else tuple(a.shape)
  data = a.data if data is None else data
  _check_size(shape, dtype, len(data), where)
  arr = np.frombuffer(data, dtype=dtype).reshape(shape)
  if a.scalar:
    return arr[()]
  # A writable view is of the buffer a call that came in parts owns alone: the array
  # views it. Bytes (gRPC's message, protobuf's field) are read-only: copied, so that an
  # argument is writable either way.
  return arr if isinstance(data, memoryview) and not data.readonly else arr.copy()


# A message is at least 2 bytes on the wire, so one under this size cannot hold more than
# MAX_ELEMENTS of them: it is parsed without a count.
SCAN_FROM = 2 * MAX_ELEMENTS


def check_message_count(raw: bytes | bytearray, descriptor: Any, *, limit: int = MAX_ELEMENTS,
                        what: str | None = None) -> None:
  """Counts the values in wire-format ``raw`` (a ``descriptor`` message) before it is
  parsed, as the decoder's Budget would (every sub-message but the parts of a Value);
  past ``limit``, ResourceExhaustedError naming ``what`` (the message's type).

  Protobuf's parse costs ~50 bytes of memory a sub-message, however few bytes it took
  (a ``none`` Value takes 4): counting first, without allocating (~0.5 s for a million),
  keeps a request's cost proportional to its bytes. Malformed bytes are left for the
  parse to refuse.
  """
  if len(raw) < SCAN_FROM:
    return
  count = pbscan.count(raw, descriptor, limit)
  if count > limit:
    raise errors.ResourceExhaustedError(
        f"{what or descriptor.name} holds more than {limit} values, the limit of one request "
        "(codec.MAX_ELEMENTS); send many numbers as one numpy array")


def parse(cls: Any, raw: bytes | bytearray, *, counted: bool = False) -> Any:
  """``cls.FromString(raw)``, or InvalidArgumentError for malformed bytes (and
  ResourceExhaustedError for more values than a request may hold, before parsing, unless
  ``counted`` already)."""
  if not counted:
    check_message_count(raw, cls.DESCRIPTOR, what=f"a {cls.__name__} of {len(raw)} bytes")
  try:
    return cls.FromString(raw)
  except (pb_message.DecodeError, RuntimeError) as e:
    deep = (f"; values nest at most {MAX_DEPTH} levels (codec.MAX_DEPTH)"
            if "MaxDepth" in str(e) else "")
    raise errors.InvalidArgumentError(
        f"malformed {cls.__name__} ({len(raw)} bytes): {e}{deep}") from None
