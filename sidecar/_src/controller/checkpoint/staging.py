"""The one copy of a save into the arenas: :func:`copy_in`, over :class:`ShardCopy`s.

Every save, whichever framework's and format's, takes its shards into the arena here:
JAX's and the numpy core's (``plugs.SaveRunner``), DCP's ``write_data`` and its
``dcp.async_save`` stage (``torch/storage.py``). A :class:`ShardCopy` carries a shard
from the plan to the sidecar: its record (``records.ShardRecord``: the shard's one
description, the host that stages it included) and, beside it, its elements and its
arena block. Host arrays are copied on the caller's thread before the save returns (the
trainer's stall; Ctrl-C between two copies fails the save); a shard still on its way from
an accelerator (a ``framework.DeviceCopy``) is copied by the stager thread once it has
landed, in order, by ``data.copy_into(view)``. What is copied goes on to a :class:`Sink`
(told first what will come) as it is: the save's :class:`Lots` (handed to the sidecars as
the copy goes on), or, under ``dcp.async_save``, the staged state dict.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import ShardRecord, Staged
from sidecar._src.controller.framework import DeviceCopy
from sidecar._src.core import interrupts

# A save is staged in lots of about this many bytes per host, as the copy goes, where
# the machine has a core beyond the copy's threads (``shm.COPY_THREADS``): a sidecar then
# writes and checksums one lot while the trainer copies the next. Where the copy takes
# every core, the sidecar's work during it takes one away, and the trainer waits for
# that: 1 GiB on 2 cores, 12 saves each, twice: 512 MiB lots blocked 1.35-1.4x a memcpy
# (durable 0.46-0.50 s), one lot after the copy 0.85-0.9x (durable 0.51-0.53 s). So
# there the save is staged once, after the copy.
STAGE_LOT_BYTES = (512 << 20 if len(os.sched_getaffinity(0)) > shm.COPY_THREADS
                    else sys.maxsize)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardCopy:
  """One shard of a save on the trainer, from the plan to the sidecar: its record and its
  elements beside it, no description of its own.

  Attributes:
    record: the shard (its id, its leaf's or DCP item's number, the sidecar host that
      stages it, dtype, shape, size).
    data: its elements: a host array, or a :class:`DeviceCopy` still on its way from a
      device (copied by the stager thread once landed).
    block: its arena block (None until allocated, and where ``data`` lies in the arena
      already: ``ref`` names it there).
    ref: the block's ``wire.codec.ArenaRef`` where this process maps the host's arena.
  """
  record: ShardRecord
  data: np.ndarray | DeviceCopy
  block: np.ndarray | None = None
  ref: object = None

  @property
  def host(self) -> int:
    """The sidecar host that stages it (its record's)."""
    host = self.record.host
    assert host is not None  # a save's plan places every shard
    return host

  @property
  def nbytes(self) -> int:
    return self.record.nbytes

  @property
  def late(self) -> bool:
    """Whether its elements are still on their way from a device."""
    return isinstance(self.data, DeviceCopy)

  def with_block(self, block: np.ndarray, ref: object) -> ShardCopy:
    return dataclasses.replace(self, block=block, ref=ref)


@dataclasses.dataclass(frozen=True, slots=True)
class Lot:
  """Staged shards of one host on their way to the sidecar, in order; ``last``: the host's
  last lot of the save."""
  host: int
  shards: tuple[Staged, ...]
  last: bool


class Sink(abc.ABC):
  """Where :func:`copy_in` hands each shard once copied into the arena."""

  def expect(self, copies: Sequence[ShardCopy]) -> None:  # noqa: B027 (a hook)
    """``copies`` are the shards :meth:`add` will be handed, before the first."""

  @abc.abstractmethod
  def add(self, shard: ShardCopy, view: np.ndarray) -> None:
    """``shard``'s elements lie in ``view`` (its arena block) now."""

  @abc.abstractmethod
  def close(self) -> None:
    """Every shard was handed on."""

  @abc.abstractmethod
  def fail(self, error: BaseException) -> None:
    """The copy failed with ``error``: what was handed on is let go of."""


class Lots(Sink):
  """A save's staged shards, handed on through ``put`` in :class:`Lot`s of about
  ``STAGE_LOT_BYTES`` per host, in order (to a finisher's queue, or straight to the
  sidecars: ``save_protocol.Sends.put``); a host's last lot goes with its last shard
  (:meth:`expect` counted them), no later. An exception put there aborts the save."""

  def __init__(self, hosts: Sequence[int], put: Callable[[Lot | BaseException], None]):
    self.put = put
    self.stager: threading.Event | None = None  # set once the stager copied the late shards
    self._pending: dict[int, list[Staged]] = {h: [] for h in hosts}
    self._bytes = dict.fromkeys(hosts, 0)
    self._left = dict.fromkeys(hosts, 0)  # per host, the shards still to come

  def expect(self, copies: Sequence[ShardCopy]) -> None:
    for c in copies:
      self._left[c.host] += 1

  def add(self, shard: ShardCopy, view: np.ndarray) -> None:
    host = shard.host
    self._pending[host].append(Staged(shard.record, view, shard.ref))
    self._bytes[host] += view.nbytes
    self._left[host] -= 1
    if self._left[host] == 0:  # its last shard: its last lot, without waiting for the others'
      self.put(Lot(host, tuple(self._pending.pop(host)), True))
    elif self._bytes[host] >= STAGE_LOT_BYTES:
      self.put(Lot(host, tuple(self._pending[host]), False))
      self._pending[host], self._bytes[host] = [], 0

  def close(self) -> None:
    """The last lot of every host still without one: the save is staged."""
    for host in list(self._pending):
      self.put(Lot(host, tuple(self._pending.pop(host)), True))

  def fail(self, error: BaseException) -> None:
    """Aborts the save: the finisher raises ``error`` where it waits for a lot."""
    self._pending.clear()
    self.put(error)


def allocate(empty_like: Callable[[int, list], list], copies: list[ShardCopy],
             host: int) -> None:
  """Gives each of ``copies`` on ``host`` that lies in no arena its block, in one request
  (``empty_like``: the checkpoint client's), in place."""
  mine = [i for i, c in enumerate(copies) if c.host == host and c.ref is None]
  if mine:
    got = empty_like(host, [copies[i].data for i in mine])
    for i, (block, ref) in zip(mine, got):
      copies[i] = copies[i].with_block(block, ref)


def copy_in(copies: list[ShardCopy], sink: Sink, *, threads: int | None = None
            ) -> threading.Event | None:
  """The one copy of a save's shards into their arena blocks (see the module).

  Copies the host arrays of ``copies`` on this thread, in order, each handed to ``sink``
  once copied; hands the late ones (``DeviceCopy``) to the process's stager thread, which
  copies each once it has landed and then closes ``sink`` (this thread closes it where
  none is late). ``copies`` is emptied: a copied block is the sink's. ``threads``: the
  copy's threads (default ``shm.COPY_THREADS``).

  Returns:
    An event the stager sets once the late ones were copied (or failed ``sink``; its
    caller waits for it), or None.

  Raises:
    Whatever a copy raised, KeyboardInterrupt between two copies (Ctrl-C deferred): the
    sink is failed first, and nothing is left to copy.
  """
  late: list[ShardCopy | None] = []
  try:
    sink.expect(copies)
    for i, c in enumerate(copies):
      copies[i] = None  # type: ignore[call-overload]  # the sink holds it from here
      if c.late:
        late.append(c)
        continue
      interrupts.check()  # Ctrl-C aborts the save
      _copy(c, sink, threads)
      del c
  except BaseException as e:
    copies.clear()  # the traceback keeps this frame: let the blocks go
    late.clear()
    sink.fail(e.with_traceback(None))
    raise
  copies.clear()
  if not late:
    sink.close()
    return None
  return STAGER.submit(late, sink, threads)


class Stager:
  """The process's one stager thread, kept from save to save: it copies every save's
  late shards in turn. The runtime's host buffer of each device piece is allocated on the
  thread that takes it, from that thread's malloc arena; a thread made for one save
  starts on fresh pages, which every piece faults in anew. On the lent v5e host (gVisor,
  where a first touch is dear) 1 GiB by 4 MiB pieces took 0.28-0.38 s on a new thread
  each time, 0.166-0.169 s on one thread kept (from its second run), as on the main
  thread (0.164-0.167 s)."""

  def __init__(self) -> None:
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._queued = 0  # jobs handed to it and not yet done

  @property
  def busy(self) -> bool:
    """Whether a save's late copies are queued or being copied."""
    return self._queued > 0

  def submit(self, late: list[ShardCopy | None], sink: Sink, threads: int | None
             ) -> threading.Event:
    done = threading.Event()
    with self._lock:
      self._queued += 1
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(target=self._run, daemon=True, name="sidecar-stager")
        self._thread.start()
    self._jobs.put((late, sink, threads, done))
    return done

  def _run(self) -> None:
    while True:
      late, sink, threads, done = self._jobs.get()
      try:
        _copy_late(late, sink, threads)
      finally:
        with self._lock:
          self._queued -= 1
        done.set()
        del late, sink, done  # the blocks go with the save, not with the next wait


STAGER = Stager()


def _copy(c: ShardCopy, sink: Sink, threads: int | None) -> None:
  if c.block is None:  # in the arena already (a dcp.async_save stage's): no copy
    sink.add(c, np.asarray(c.data))
    return
  if isinstance(c.data, DeviceCopy):
    c.data.copy_into(c.block)  # piece by piece as it lands, no whole host copy
  else:
    shm.copy(c.block, c.data, threads=threads)  # the one copy the trainer waits for
  sink.add(c, c.block)


def _copy_late(late: list[ShardCopy | None], sink: Sink, threads: int | None) -> None:
  """On the stager thread: each late shard into its block once landed, in order."""
  try:
    for i, c in enumerate(late):
      late[i] = None  # the device's copy and its host buffer go as soon as they are used
      assert c is not None
      _copy(c, sink, threads)
      del c
  except BaseException as e:
    late.clear()
    sink.fail(e.with_traceback(None))  # the frames would hold the blocks
    return
  sink.close()
