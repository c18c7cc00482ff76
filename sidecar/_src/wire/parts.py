"""A large message in CallParts: cut into parts as it is sent, put together into one buffer
as it comes.

gRPC's receipt of one message costs three times its size at its peak, and its send of one
twice (the message's bytes, then its own copy of them). A large call's request goes to the
sidecar in parts (CallParts) and its response comes back in parts: each part a copy of at
most ``PART_BYTES`` of the message, made as gRPC asks for it; the receiver copies each into
one buffer, which the message's large arrays are then views of (``pbscan.strip_arrays``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from sidecar._src.core import errors
from sidecar._src.wire import codec, pbscan
from sidecar._src.wire.protocol import pb

PART_BYTES = 1 << 20
_TOTAL_KEY = pbscan.encode_varint(pb.CallPart.DESCRIPTOR.fields_by_name["total"].number << 3)
_DATA_KEY = pbscan.encode_varint(
    pb.CallPart.DESCRIPTOR.fields_by_name["data"].number << 3 | 2)

Bytes = bytes | bytearray | memoryview


def cut(pieces: Sequence[Bytes], total: int, *, part_bytes: int = PART_BYTES
        ) -> Iterator[bytes]:
  """The serialized CallParts that carry the ``total`` bytes of ``pieces`` (byte buffers
  whose concatenation is the message), in order, the first announcing ``total``.

  Each part's bytes are copied once, into its message, when it is asked for: the message
  is never whole anywhere but in ``pieces`` (a response's are views of its arrays).
  """
  pending: list[memoryview] = []
  size, first = 0, True
  for piece in pieces:
    view = memoryview(piece).cast("B")
    while view:
      take = view[:part_bytes - size]
      pending.append(take)
      size += len(take)
      view = view[len(take):]
      if size == part_bytes:
        yield _part(pending, size, total if first else 0)
        pending, size, first = [], 0, False
  if pending or first:
    yield _part(pending, size, total if first else 0)


def _part(pieces: list[memoryview], size: int, total: int) -> bytes:
  """A serialized CallPart: ``total``, then ``pieces`` as its data (either, 0 or empty,
  not written, as protobuf omits it)."""
  total_field = _TOTAL_KEY + pbscan.encode_varint(total) if total else b""
  data_key = _DATA_KEY + pbscan.encode_varint(size) if size else b""
  return b"".join([total_field, data_key, *pieces])


def assemble(total: int, parts: Iterable[bytes], *, what: str = "the call") -> bytearray:
  """The ``total`` bytes ``parts`` (serialized CallParts, the first included) carry, in
  one buffer (its pages are faulted in as the parts are written).

  Raises:
    InvalidArgumentError: they carry more or fewer bytes than ``total`` (naming ``what``).
  """
  buffer = bytearray(total)
  view, n = memoryview(buffer), 0
  for i, raw in enumerate(parts):
    data = codec.parse(pb.CallPart, raw).data
    if n + len(data) > total:
      raise errors.InvalidArgumentError(
          f"CallPart {i} brings {what} past the {total} bytes its first part announced")
    view[n:n + len(data)] = data
    n += len(data)
  if n != total:
    raise errors.InvalidArgumentError(
        f"{what}'s parts ended after {n} of the {total} bytes its first part announced")
  return buffer
