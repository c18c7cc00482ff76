"""The Checkpoint service's restore rpcs (``Held``, ``Info``, ``Read``), as
``service.CheckpointService`` hands them on, its checks of the session and the paths done.

A ``Read``'s shard comes from the RAM tier (a block of this sidecar's arenas) or from
storage; in a pool the read from storage runs in its tenant's process, as its user, its
memory bounded there (``isolation``, ``tenant_procs/``). An inline answer (no worker
session) is made once, its bytes copied into it from the shard (``checkpoint_wire.
read_response_bytes``), and held as its tenant's inline bytes (``inline_bytes``, the
sidecar's budget of them) until its RPC ends: so concurrent Reads cost the sidecar what
its tenants' quotas allow (issue 76, attack 6: eight of a 64 MiB shard grew it by about
18x its tenant's ``inline_bytes``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import grpc

from sidecar._src.ckptfmt.records import ShardRecord
from sidecar._src.core import errors
from sidecar._src.server import isolation as isolation_lib, limits, metrics as metrics_lib
from sidecar._src.server.arenas.arena_io import ArenaIO
from sidecar._src.server.checkpoint import read as checkpoint_read
from sidecar._src.server.checkpoint.checkpoints import Checkpoints
from sidecar._src.server.limits import InlineBytes
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.wire import checkpoint_wire as wire, codec
from sidecar._src.wire.protocol import ckpt_pb

_TIERS = {number: name for name, number in wire.TIERS.items()}
Allocating = Callable[[grpc.ServicerContext], contextlib.AbstractContextManager]


class ReadResponse:
  """Read's answer as gRPC sends it: inline, the bytes ``read_response_bytes`` made;
  leased to a worker, the message."""

  @staticmethod
  def SerializeToString(response: ckpt_pb.CheckpointReadResponse | bytes) -> bytes:  # noqa: N802
    return response if isinstance(response, bytes) else response.SerializeToString()


class Restores:
  """The restore rpcs of one sidecar's Checkpoint service.

  Args:
    checkpoints: what holds the steps, the RAM tier and the reader.
    arena_io: where a worker's reads are leased to it.
    inline: the bytes of large inline answers held at once (a tenant's ``inline_bytes``).
    isolation: where a tenant's reads from storage are made (its process, in a pool).
    allocating: the context a read's ``sidecar.empty`` allocates in (the request's).
  """

  def __init__(self, checkpoints: Checkpoints, arena_io: ArenaIO, *, inline: InlineBytes,
               metrics: metrics_lib.Recorder, isolation: isolation_lib.Isolation,
               allocating: Allocating):
    self._checkpoints = checkpoints
    self._arena_io = arena_io
    self._inline = inline
    self._metrics = metrics
    self._isolation = isolation
    self._allocating = allocating

  def held(self, r: ckpt_pb.CheckpointHeldRequest, _: grpc.ServicerContext
           ) -> ckpt_pb.CheckpointHeldResponse:
    return wire.held_to_pb(self._checkpoints.held(r.directory))

  def info(self, r: ckpt_pb.CheckpointInfoRequest, _: grpc.ServicerContext
           ) -> ckpt_pb.CheckpointInfoResponse:
    try:
      return wire.manifest_to_pb(self._checkpoints.info(r.final_dir, taken_over=r.taken_over))
    except errors.SidecarError:
      raise  # says what it found (a step of another format), with its own fix
    except (TypeError, ValueError) as e:  # a manifest file that reads, with odd values
      raise errors.InvalidArgumentError(
          f"{r.final_dir}: its manifest is not one this sidecar wrote ({type(e).__name__}: "
          f"{e}); restore it with Orbax, or an older step") from None

  def read(self, r: ckpt_pb.CheckpointReadRequest, context: grpc.ServicerContext
           ) -> ckpt_pb.CheckpointReadResponse | bytes:
    record = wire.record_from_pb(r.record, "record")
    byte_range = (r.part.offset, r.part.nbytes) if r.HasField("part") else None
    tier = _TIERS.get(r.tier)
    if tier is None:
      raise errors.InvalidArgumentError(f"tier must be one of {sorted(_TIERS)}, got {r.tier}")
    stored = self._stored(r.worker_session, context)
    if not r.worker_session:  # inline: its bytes held as inline bytes until it is sent
      self._hold_inline(byte_range[1] if byte_range else _nbytes(record), context)
    with self._allocating(context):
      data = self._checkpoints.read(r.final_dir, record, tier, byte_range,
                                    checked=not r.unchecked, stored=stored)
    if not r.worker_session:
      return wire.read_response_bytes(data)  # the bytes copied once, into the answer
    out = ckpt_pb.CheckpointReadResponse()
    # Leased to the caller's worker: a RAM-tier block as it is (its tenant process's read
    # into one of its blocks too), else copied into one.
    value = self._arena_io.encode(data, r.worker_session, alive=context.is_active,
                                  time_left=context.time_remaining, where="the shard read")
    if value.HasField("arena"):
      out.data.arena.CopyFrom(value.arena)
    else:  # smaller than the inline limit
      out.data.array.CopyFrom(value.array)
    return out

  def _stored(self, session: str, context: grpc.ServicerContext
              ) -> checkpoint_read.Stored | None:
    """How the caller's reads from storage are made: in its tenant's process (a pool's:
    the format's read and its memory there, as its user), into a block leased to worker
    ``session`` or back inline; None: here."""
    work = self._isolation.work_of(tenants_lib.CURRENT.get())
    if work is None:
      return None
    return lambda final_dir, record, checked: work.read(
        final_dir, record, session=session, checked=checked, alive=context.is_active,
        time_left=context.time_remaining)

  def _hold_inline(self, nbytes: int, context: grpc.ServicerContext) -> None:
    """Holds ``nbytes`` of an inline Read's answer as its tenant's inline bytes until its
    RPC ends: the answer's bytes, and gRPC's copy of them as it sends them (twice its
    bytes at most, one answer of its tenant's at a time within its ``inline_bytes``).

    Raises:
      ResourceExhaustedError: past its tenant's inline_bytes; BusyError: no room in time.
    """
    tenant = tenants_lib.CURRENT.get()
    self._metrics.tenant_requested(tenant, "inline", nbytes)
    held = contextlib.ExitStack()
    with self._metrics.waiting(tenant, "inline"):
      held.enter_context(self._inline.hold(nbytes, context.time_remaining()))
    # What the answers before it left in the heaps of the threads that made them (each
    # thread's own: freed once gRPC sent it, after its RPC's end) goes back first.
    limits.trim_heap()
    if not context.add_callback(held.close):
      held.close()  # the RPC is over already: nobody to answer
      raise errors.DeadlineExceededError("Read: its caller left before it was read")


def _nbytes(record: ShardRecord) -> int:
  """A shard's bytes: its record's, else (a stock item's, not known) its dtype and shape's."""
  if record.nbytes or not record.dtype:
    return record.nbytes
  return math.prod(record.shape) * codec.dtype_of(record.dtype, "the shard").itemsize

