"""The protobuf wire format read without parsing: what the sidecar checks of a request's
bytes before protobuf allocates anything for them.

``count`` counts the values a message holds (``codec.check_message_count`` refuses a request
past ``codec.MAX_ELEMENTS`` before its parse); ``strip_arrays`` takes the bytes of large
inline arrays out of a request so that protobuf does not copy them (the decoder views them
where they arrived: ``stripped``), and ``splice_arrays`` puts a response's large arrays into
its bytes, copied once (``splice_pieces``: not even once, for a response in parts);
``length_delimited`` finds a field's occurrences (the Checkpoint
service's ``Receive`` reads its parts' data in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sidecar._src.wire.protocol import pb

_MAX_SCAN_DEPTH = 100  # protobuf's own nesting limit: deeper, its parse refuses


def count(raw: bytes | bytearray, descriptor: Any, limit: int) -> int:
  """The values in wire-format ``raw`` (a ``descriptor`` message), as the decoder's Budget
  counts them (every sub-message but the parts of a Value); stops once past ``limit``."""
  return _count(raw, descriptor, limit, 0)


def stripped(data: bytes | memoryview, views: list[memoryview]) -> bytes | memoryview:
  """An Array's ``data`` as it arrived: the view ``strip_arrays`` marked in its place, else
  ``data`` itself."""
  if len(data) == _MARK_LEN and bytes(data[:len(_MARK)]) == _MARK:
    return views[int.from_bytes(data[len(_MARK):], "little")]
  return data


# An inline array of at least this many bytes is not parsed by protobuf (which would
# copy it, and its decoding again): its bytes stay where they arrived, in the request,
# and the array is copied once from there (``strip_arrays``).
BIG_ARRAY = 1 << 20
_MARK = b"\x00sidecar-wire-view\x00"  # in place of such bytes: the mark, then the view's index
_MARK_LEN = len(_MARK) + 4
_ARRAY = pb.Array.DESCRIPTOR.full_name
_ARRAY_DATA = pb.Array.DESCRIPTOR.fields_by_name["data"].number


def strip_arrays(raw: bytes | bytearray, descriptor: Any
                 ) -> tuple[bytes | bytearray, list[memoryview]]:
  """``raw`` (a ``descriptor`` message) with each inline array's bytes of ``BIG_ARRAY``
  or more taken out, and views of those bytes in ``raw``, for a ``Budget(views=...)``.

  A 128 MiB inline call cost the sidecar 5-7 times its size: gRPC's bytes, protobuf's
  copy, the bytes field read out of it, the array. Now: gRPC's bytes and the array.
  Bytes this cannot read are returned as they are, for the parse to refuse.
  """
  if len(raw) < BIG_ARRAY:
    return raw, []
  views: list[memoryview] = []
  try:
    out = _strip(raw, descriptor, 0, len(raw), views, 0)
  except (IndexError, ValueError):
    return raw, []
  return (raw, []) if out is None else (out, views)


_VALUE = pb.Value.DESCRIPTOR.full_name
_VALUE_ARENA = pb.Value.DESCRIPTOR.fields_by_name["arena"].number
_VALUE_ARRAY = pb.Value.DESCRIPTOR.fields_by_name["array"].number


def splice_arrays(raw: bytes, descriptor: Any, arrays: Sequence[np.ndarray]) -> bytes:
  """``raw`` (a serialized ``descriptor`` message) with each ``Value.arena`` in it made an
  inline ``Value.array`` of ``arrays[ref.offset]``: the bytes that message would serialize
  to had the arrays been inline, with each array's bytes copied once, here.

  A 128 MiB array in a response took four copies on its way to gRPC: ``tobytes``, the
  ``Array`` message, the ``Value`` and ``CallResponse`` holding it, the serialization. The
  placeholders' message is small; this writes the arrays into its bytes.

  Raises:
    ValueError, IndexError: ``raw`` is not such a message, or a placeholder's offset is
      not an index of ``arrays``.
  """
  if not arrays:
    return raw
  return b"".join(splice_pieces(raw, descriptor, arrays)[0])


def splice_pieces(raw: bytes, descriptor: Any, arrays: Sequence[np.ndarray]
                  ) -> tuple[list[bytes | memoryview], int]:
  """:func:`splice_arrays`'s bytes, not joined: the pieces whose concatenation they are
  (each array's bytes a view of the array, no copy), and their length. What a response
  in parts is cut from (``parts.cut``), so that no whole copy of it is ever made.

  Raises:
    ValueError, IndexError: as :func:`splice_arrays`.
  """
  if not arrays:
    return [raw], len(raw)
  left = [len(arrays)]
  out = _splice(raw, descriptor, 0, len(raw), arrays, left, 0)
  if left[0]:
    raise ValueError(f"{left[0]} of {len(arrays)} arrays had no placeholder in the message")
  return ([raw], len(raw)) if out is None else out


def _splice(buf: bytes, descriptor: Any, start: int, end: int, arrays: Sequence[np.ndarray],
            left: list[int], depth: int) -> tuple[list[Any], int] | None:
  """The pieces and length of ``buf[start:end]`` with placeholders spliced; None if it
  held none. ``left``: the placeholders not yet found (once none is, the rest is kept)."""
  fields = _message_fields(descriptor)
  value = descriptor.full_name == _VALUE
  pieces: list[Any] = []
  size = 0
  last = pos = start
  while pos < end and left[0]:
    key, after_key = _varint(buf, pos)
    wire = key & 7
    if wire == 0:
      _, pos = _varint(buf, after_key)
      continue
    if wire in (1, 5):
      pos = after_key + (8 if wire == 1 else 4)
      continue
    if wire != 2:
      raise ValueError(f"wire type {wire}")
    n, at = _varint(buf, after_key)
    if at + n > end:
      raise ValueError("a field runs past its message")
    new: tuple[bytes, list[Any], int] | None = None
    if value and key >> 3 == _VALUE_ARENA:
      new = (encode_varint(_VALUE_ARRAY << 3 | 2), *_inline(buf[at:at + n], arrays))
      left[0] -= 1
    elif key >> 3 in fields and depth < _MAX_SCAN_DEPTH:
      inner = _splice(buf, fields[key >> 3][0], at, at + n, arrays, left, depth + 1)
      if inner is not None:
        new = (buf[pos:after_key], *inner)
    if new is not None:
      head, body, length = new
      kept, length_bytes = buf[last:pos], encode_varint(length)
      pieces += [kept, head, length_bytes, *body]
      size += len(kept) + len(head) + len(length_bytes) + length
      last = at + n
    pos = at + n
  if not pieces:
    return None
  rest = buf[last:end]
  pieces.append(rest)
  return pieces, size + len(rest)


def _inline(ref_bytes: bytes, arrays: Sequence[np.ndarray]) -> tuple[list[Any], int]:
  """The pieces and length of the ``Array`` that placeholder ``ref_bytes`` stands for."""
  ref = pb.ArenaRef.FromString(ref_bytes)
  a = arrays[ref.offset]
  data = a.reshape(-1).view(np.uint8).data  # C-contiguous: codec.check_array
  head = pb.Array(dtype=ref.dtype, shape=ref.shape).SerializeToString()
  data_key = encode_varint(_ARRAY_DATA << 3 | 2) + encode_varint(len(data))
  return [head, data_key, data], len(head) + len(data_key) + len(data)


def encode_varint(n: int) -> bytes:
  """``n`` as a protobuf varint (a field's key or a length)."""
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _strip(buf: bytes | bytearray, descriptor: Any, start: int, end: int, views: list[memoryview],
           depth: int) -> bytes | None:
  """``buf[start:end]`` with big arrays' bytes replaced by marks; None if none was."""
  fields = _message_fields(descriptor)
  array = descriptor.full_name == _ARRAY
  pieces: list[bytes | bytearray] = []
  last = pos = start
  while pos < end:
    key, after_key = _varint(buf, pos)
    wire = key & 7
    if wire == 0:
      _, pos = _varint(buf, after_key)
    elif wire == 1:
      pos = after_key + 8
    elif wire == 5:
      pos = after_key + 4
    elif wire == 2:
      n, value = _varint(buf, after_key)
      if value + n > end:
        raise ValueError("a field runs past its message")
      new = None
      if array and key >> 3 == _ARRAY_DATA and n >= BIG_ARRAY:
        new = _MARK + len(views).to_bytes(4, "little")
        views.append(memoryview(buf)[value:value + n])
      elif n >= BIG_ARRAY and key >> 3 in fields and depth < _MAX_SCAN_DEPTH:  # room for one
        new = _strip(buf, fields[key >> 3][0], value, value + n, views, depth + 1)
      if new is not None:
        pieces += [buf[last:after_key], encode_varint(len(new)), new]
        last = value + n
      pos = value + n
    else:
      raise ValueError(f"wire type {wire}")
  if pos != end:
    raise ValueError("a field runs past its message")
  if not pieces:
    return None
  pieces.append(buf[last:end])
  return b"".join(pieces)


def _varint(buf: bytes | bytearray, pos: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    b = buf[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    if b < 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise ValueError("varint too long")


def length_delimited(buf: bytes, start: int, end: int, field: int
                     ) -> list[tuple[int, int, int]]:
  """``(field start, value start, value end)`` of each length-delimited field ``field`` of
  the message in ``buf[start:end]``, read off the wire without parsing it.

  Raises:
    ValueError, IndexError: not a plain message (a group, a field past the end).
  """
  found, pos = [], start
  while pos < end:
    field_start = pos
    key, pos = _varint(buf, pos)
    wire = key & 7
    if wire == 0:
      _, pos = _varint(buf, pos)
    elif wire == 1:
      pos += 8
    elif wire == 5:
      pos += 4
    elif wire == 2:
      n, pos = _varint(buf, pos)
      if key >> 3 == field:
        found.append((field_start, pos, pos + n))
      pos += n
    else:
      raise ValueError(f"wire type {wire}")
  if pos != end:
    raise ValueError("a field runs past its message")
  return found


_FIELDS: dict[str, dict[int, tuple[Any, int]]] = {}
# The scan's own cost: a field that is no value (a scalar, a string, a DictEntry, an
# unknown field, empty or not) takes it as long as a value does. A value comes with at
# most two (its scalar; a dict entry and its key for two values); millions more than
# the values are no request of ours (2-byte fields: 70 s for 256 MiB).
_OTHER_FIELDS_PER_VALUE = 2
# Parts of a Value that the decoder does not count apart from it (the items and entries
# of lists and dicts it does).
_UNCOUNTED = frozenset(m.DESCRIPTOR.full_name for m in (
    pb.ListValue, pb.DictValue, pb.DictEntry, pb.Array, pb.ArenaRef, pb.NamedTupleValue))


def _message_fields(descriptor: Any) -> dict[int, tuple[Any, int]]:
  """Field number -> (message descriptor, what one counts) of ``descriptor``'s message fields."""
  fields = _FIELDS.get(descriptor.full_name)
  if fields is None:
    fields = _FIELDS[descriptor.full_name] = {
        f.number: (f.message_type, int(f.message_type.full_name not in _UNCOUNTED))
        for f in descriptor.fields if f.message_type is not None}
  return fields


def _count(buf: bytes | bytearray, descriptor: Any, limit: int, depth: int, pos: int = 0,
           end: int | None = None, others: list[int] | None = None) -> int:
  """Sub-messages in ``buf[pos:end]``, stopping once past ``limit``; what it cannot read
  it leaves to the parse. ``others``: how many more fields that are no value the whole
  scan may visit (shared by every level)."""
  fields = _message_fields(descriptor)
  end = len(buf) if end is None else end
  others = [_OTHER_FIELDS_PER_VALUE * limit] if others is None else others
  count = 0
  try:
    while pos < end:
      key = buf[pos]
      pos += 1
      if key >= 0x80:
        key, pos = _varint(buf, pos - 1)
      wire = key & 7
      child, weight = fields.get(key >> 3, (None, 0)) if wire == 2 else (None, 0)
      if not weight:
        others[0] -= 1
        if others[0] < 0:
          return limit + 1
      if wire == 0:
        while buf[pos] >= 0x80:
          pos += 1
        pos += 1
      elif wire == 2:
        n = buf[pos]
        pos += 1
        if n >= 0x80:
          n, pos = _varint(buf, pos - 1)
        if child is not None:
          count += weight
          if n and depth < _MAX_SCAN_DEPTH:
            count += _count(buf, child, limit - count, depth + 1, pos, pos + n, others)
          if count > limit:
            return count
        pos += n
      elif wire == 1:
        pos += 8
      elif wire == 5:
        pos += 4
      else:
        return count  # groups or garbage: the parse decides
  except (IndexError, ValueError):
    pass  # truncated or malformed: the parse decides
  return count
