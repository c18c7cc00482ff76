"""A large message in CallParts: cut into pieces as it is sent, put together into one buffer
as it comes.

gRPC's receipt of one message costs three times its size at its peak, and its send of one
twice (the message's bytes, then its own copy of them). A large call's request goes to the
sidecar in pieces (CallParts, each piece a CallPart message) and its response comes back in
pieces, each a copy of at most ``PIECE_BYTES`` of the message, made as gRPC asks for it; the
receiver copies each into one buffer, which the message's large arrays are then views of
(``pbscan.strip_arrays``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from sidecar._src.core import errors
from sidecar._src.wire import codec, pbscan
from sidecar._src.wire.protocol import pb

PIECE_BYTES = 1 << 20
_TOTAL_KEY = pbscan.encode_varint(pb.CallPart.DESCRIPTOR.fields_by_name["total"].number << 3)
_DATA_KEY = pbscan.encode_varint(
    pb.CallPart.DESCRIPTOR.fields_by_name["data"].number << 3 | 2)

Bytes = bytes | bytearray | memoryview


def cut(buffers: Sequence[Bytes], total: int, *, piece_bytes: int = PIECE_BYTES
        ) -> Iterator[bytes]:
  """The serialized CallParts that carry the ``total`` bytes of ``buffers`` (byte buffers
  whose concatenation is the message), in order, the first announcing ``total``.

  Each piece's bytes are copied once, into its message, when it is asked for: the message
  is never whole anywhere but in ``buffers`` (a response's are views of its arrays).
  """
  pending: list[memoryview] = []
  size, first = 0, True
  for buffer in buffers:
    view = memoryview(buffer).cast("B")
    while view:
      take = view[:piece_bytes - size]
      pending.append(take)
      size += len(take)
      view = view[len(take):]
      if size == piece_bytes:
        yield _piece(pending, size, total if first else 0)
        pending, size, first = [], 0, False
  if pending or first:
    yield _piece(pending, size, total if first else 0)


def _piece(buffers: list[memoryview], size: int, total: int) -> bytes:
  """A serialized CallPart: ``total``, then ``buffers`` as its data (either, 0 or empty,
  not written, as protobuf omits it)."""
  total_field = _TOTAL_KEY + pbscan.encode_varint(total) if total else b""
  data_key = _DATA_KEY + pbscan.encode_varint(size) if size else b""
  return b"".join([total_field, data_key, *buffers])


def assemble(total: int, pieces: Iterable[bytes], *, what: str = "the call") -> bytearray:
  """The ``total`` bytes ``pieces`` (serialized CallParts, the first included) carry, in
  one buffer (its pages are faulted in as the pieces are written).

  Raises:
    InvalidArgumentError: they carry more or fewer bytes than ``total`` (naming ``what``).
  """
  buffer = bytearray(total)
  view, n = memoryview(buffer), 0
  for i, raw in enumerate(pieces):
    data = codec.parse(pb.CallPart, raw).data
    if n + len(data) > total:
      raise errors.InvalidArgumentError(
          f"CallPart {i} brings {what} past the {total} bytes its first part announced")
    view[n:n + len(data)] = data
    n += len(data)
  if n != total:
    raise errors.InvalidArgumentError(
        f"{what}'s pieces ended after {n} of the {total} bytes its first part announced")
  return buffer
