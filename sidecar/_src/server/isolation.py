"""Where a client's work runs: in the sidecar's own process, or in its tenant's.

The call runner and the stream runner (``calls/``) ask their :class:`Isolation` for the
work of the tenant a request is for: None, and they run it here, as a sidecar without a
pool file always does; else a :class:`TenantWork` that runs it in the tenant's processes
(``tenant_procs/``, handed in by ``server.py`` with a pool file), the decisions (who may
run what, which blocks, which quotas) staying the runners' and the arenas'. Neither
runner imports ``tenant_procs/``: this seam is all they know of it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

from sidecar._src.ckptfmt.records import ShardRecord
from sidecar._src.user import data_roots, registry as registry_lib
from sidecar._src.wire.protocol import pb

Alive = Callable[[], bool]
TimeLeft = Callable[[], float | None]


class TenantWork(Protocol):
  """A tenant's work in its processes (``tenant_procs/jobs.Work``)."""

  def call(self, entry: registry_lib.Entry, raw: bytes | bytearray, *, session: str,
           alive: Alive, time_left: TimeLeft, splice: bool) -> bytearray:
    """A unary call's serialized CallResponse (its result's blocks checked)."""
    ...

  def stream(self, entry: registry_lib.Entry, request: pb.CallRequest, *, alive: Alive,
             time_left: TimeLeft) -> Generator[pb.Value, None, None]:
    """A stream's items, each made when asked for."""
    ...

  def feed(self, entry: registry_lib.Entry, request: pb.CallRequest, *, blocks: Any,
           check: Callable[[list[int]], None], turns: Any, roots: data_roots.DataRoots,
           alive: Alive) -> Generator[tuple[Any, dict[str, Any], float], None, None]:
    """A feed's batches (``producer.Batch``, its state, its seconds), made into the blocks
    of ``blocks`` (``arena_io.BatchBlocks``), each when asked for."""
    ...

  def read(self, final_dir: str, record: ShardRecord, *, session: str, checked: bool,
           alive: Alive, time_left: TimeLeft) -> Any:
    """A checkpoint shard read from storage (an array: in a block pinned for ``session``,
    else inline)."""
    ...

  def length(self, entry: registry_lib.Entry, request: pb.CallRequest, *,
             roots: data_roots.DataRoots, alive: Alive) -> int | None:
    """A feed's length in global batches."""
    ...


class Isolation:
  """Where each tenant's work runs; here (this default), everything in this process."""

  def work_of(self, tenant: str | None) -> TenantWork | None:
    """``tenant``'s work elsewhere; None: it runs in the sidecar's process."""
    del tenant
    return None


IN_PROCESS = Isolation()
