"""A controller's sidecars as a checkpointer sees them: :class:`SidecarsSnapshot`.

What JAX's and PyTorch's checkpointers (``controller/checkpoint/checkpointer.py``,
``torch/storage.py``, ``torch/checkpointer.py``) need of a controller, handed out by
``Controller.checkpoint_sidecars()``: the checkpoint client, which hosts there are and
which this process drives, and where each host's replicas go (:func:`replica_hosts`).
A single controller's snapshot also says how to see its hosts again (``live``, ``now``):
a checkpointer made before a host was lost saves on the hosts left (elastic retry).
:class:`Snapshots` makes them, and the checkpoint clients, from a controller's sidecars.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar._src.controller.checkpoint.client import CheckpointClient, CheckpointTransport
from sidecar._src.controller.goodput import LedgerClient
from sidecar._src.controller.sidecars import Sidecars
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SidecarsSnapshot:
  """The sidecars of a controller, as they are when a checkpointer is made.

  Attributes:
    client: the checkpoint calls on them.
    hosts: every live host; ``local``: those this process drives (stages into).
    device_hosts: the host of each device id (under PyTorch a rank's device is its rank).
    handshakes: what each live sidecar told at its handshake: its address, worker socket,
      boot id and slice.
    mapped: the hosts whose arenas this process maps.
    writers: the processes that stage into each host, where several share one.
    warned: the controller's ``(replicas asked, hosts)`` already warned of (a PyTorch
      writer is made for each save: its warning once, not at every save).
    goodput: the controller's goodput ledger client (process 0's), told of each save and
      restore; the first checkpointer binds it to its directory. None: none records.
    saved: called with its ``data_state`` after each ``save()`` that saved (not skipped):
      the controller's stall rule (``controller/startup.py``: a save is a step of a trainer
      with no feed of ours) and its feeds (their sidecars let go of the batches kept from
      before it: ``Feed.saved``).
    live: the controller's live hosts now (cheap: no rpc); ``now``: its sidecars now, a
      snapshot with this one's client. A checkpointer compares ``live()`` with ``hosts``
      at each save and restore, and takes ``now()`` where they differ (a host lost, or
      back). None: these hosts stay (N processes, whose views of a loss may differ; a
      snapshot made by hand).
  """
  client: CheckpointTransport
  hosts: tuple[int, ...]
  local: tuple[int, ...]
  device_hosts: Mapping[int, int]
  handshakes: Mapping[int, Mapping[str, Any]]
  mapped: frozenset[int]
  writers: Mapping[int, Sequence[int]]
  warned: set[tuple[int, int]] = dataclasses.field(default_factory=set)
  goodput: LedgerClient | None = None
  saved: Callable[[Any], None] | None = None
  live: Callable[[], tuple[int, ...]] | None = None
  now: Callable[[], SidecarsSnapshot] | None = None

  def replicas(self, wanted: int) -> int:
    """``wanted`` replicas, or as many as there are other hosts (with a warning): an
    elastic job down to fewer hosts than it planned keeps saving."""
    most = max(len(self.hosts) - 1, 0)
    if wanted > most and (wanted, len(self.hosts)) not in self.warned:
      self.warned.add((wanted, len(self.hosts)))
      log.warning("replicas=%d, but there are %d hosts: each shard gets %d replica copies",
                  wanted, len(self.hosts), most)
    return min(wanted, most)

  def placement(self, replicas: int) -> dict[int, list[int]]:
    """``{host: the hosts that keep its replicas}`` (another slice's first)."""
    slices = {h: int(self.handshakes.get(h, {}).get("slice_id", 0)) for h in self.hosts}
    return {h: replica_hosts(slices, h, replicas) for h in self.hosts}


class Snapshots:
  """A controller's ``sidecars`` as its checkpointers see them: checkpoint clients over its
  channels (``status``: its Status of every sidecar), and snapshots of them, which share
  the replica warnings already given."""

  def __init__(self, sidecars: Sidecars, *, status: Callable[[], list[pb.StatusResponse]]):
    self._sidecars, self._status = sidecars, status
    self._replica_warnings: set[tuple[int, int]] = set()  # (replicas asked, hosts) warned of

  def client(self, timeout: float) -> CheckpointClient:
    """The checkpoint calls on the sidecars, ``timeout`` seconds each by default."""
    return CheckpointClient(select=self._sidecars.select,
                            connection=self._sidecars.conns.__getitem__,
                            worker=self._sidecars.workers.get, status=self._status,
                            timeout=timeout)

  def snapshot(self, client: CheckpointTransport, *, goodput: LedgerClient | None,
               now: Callable[[], SidecarsSnapshot] | None,
               saved: Callable[[Any], None] | None = None) -> SidecarsSnapshot:
    """The sidecars now, through ``client``; with ``now`` (a single controller's: how to
    take the next), one that follows the live hosts (``SidecarsSnapshot.live``)."""
    sidecars = self._sidecars
    return SidecarsSnapshot(
        client=client, hosts=self.live(), local=tuple(sidecars.local_hosts),
        device_hosts=dict(sidecars.device_hosts), handshakes=sidecars.handshakes(),
        mapped=frozenset(h for h in sidecars.workers if h not in sidecars.lost),
        writers=dict(sidecars.writers), warned=self._replica_warnings, goodput=goodput,
        saved=saved, live=self.live if now is not None else None, now=now)

  def live(self) -> tuple[int, ...]:
    """The live hosts' ids, ascending (no rpc)."""
    return tuple(h.host_id for h in self._sidecars.live())


def replica_hosts(slices: dict[int, int], host: int, replicas: int) -> list[int]:
  """The ``replicas`` hosts that keep copies of ``host``'s shards: the next hosts in host
  order (wrapping), those on another slice first."""
  order = sorted(slices)
  i = order.index(host)
  ring = order[i + 1:] + order[:i]
  return ([h for h in ring if slices[h] != slices[host]]
          + [h for h in ring if slices[h] == slices[host]])[:replicas]
