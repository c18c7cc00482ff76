"""A save's staged shards on their way to the finisher, in parts.

The trainer's thread copies the shards that are host arrays into the arena before
``save()`` returns; a shard still on its way from an accelerator (a
``framework.HostCopy``) is copied by the stager thread (:func:`stage_late`) once it has
landed. Both hand what they copied to the save's finisher through one :class:`Parts`.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Sequence

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import StagedShard

# A save is staged in parts of about this many bytes per host, as the copy goes, where
# the machine has a core beyond the copy's threads (``shm.COPY_THREADS``): a sidecar then
# writes and checksums one part while the trainer copies the next. Where the copy takes
# every core, the sidecar's work during it takes one away, and the trainer waits for
# that: 1 GiB on 2 cores, 12 saves each, twice: 512 MiB parts blocked 1.35-1.4x a memcpy
# (durable 0.46-0.50 s), one part after the copy 0.85-0.9x (durable 0.51-0.53 s). So
# there the save is staged once, after the copy.
STAGE_PART_BYTES = (512 << 20 if len(os.sched_getaffinity(0)) > shm.COPY_THREADS
                    else sys.maxsize)


class Parts:
  """A save's staged shards, handed to the finisher in parts of about
  ``STAGE_PART_BYTES`` per host, in order, then each host's last part."""

  def __init__(self, hosts: Sequence[int], parts: queue.SimpleQueue):
    self.parts = parts
    self.stager: threading.Thread | None = None  # copies the shards still on their way
    self._pending: dict[int, list[StagedShard]] = {h: [] for h in hosts}
    self._bytes = dict.fromkeys(hosts, 0)

  def add(self, host: int, shard: StagedShard, nbytes: int) -> None:
    self._pending[host].append(shard)
    self._bytes[host] += nbytes
    if self._bytes[host] >= STAGE_PART_BYTES:
      self.parts.put((host, self._pending[host], False))
      self._pending[host], self._bytes[host] = [], 0

  def close(self) -> None:
    """Every host's last part: the save is staged."""
    for host in list(self._pending):
      self.parts.put((host, self._pending.pop(host), True))

  def fail(self, error: BaseException) -> None:
    """Aborts the save: the finisher raises ``error`` where it waits for a part."""
    self.clear()
    self.parts.put(error)

  def clear(self) -> None:
    self._pending.clear()


def stage_late(late: list, staging: Parts) -> None:
  """The stager thread: copies each shard in ``late`` into its arena block once its
  device-to-host copy has landed, in order, and hands them on as ``staging``'s parts."""
  try:
    for i, (host, leaf, index, data, copy, ref) in enumerate(late):
      late[i] = None  # the device's copy and its host buffer go as soon as they are used
      data.copy_into(copy)
      staging.add(host, StagedShard(leaf, index, copy, ref), data.nbytes)
      del data, copy, ref
  except BaseException as e:
    late.clear()
    staging.fail(e.with_traceback(None))  # the frames would hold the blocks
    return
  staging.close()
