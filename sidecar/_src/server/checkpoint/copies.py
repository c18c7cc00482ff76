"""The copies of a step's shards beside the step's own object (``step.Step``): what
every copy held here is (:class:`StepCopy`, which a step and a replica share), this
host's shards on their way to its replica hosts (:class:`Replication`), and the shards
another sidecar sent here (:class:`Replica`, which ``ram_tier.RamTier`` holds).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Mapping, Sequence

import numpy as np

from sidecar._src.ckptfmt.records import Manifest, ReplicaTarget, Replicated, ShardId


class StepCopy:
  """A step's copy held on this host: which step of which checkpoint directory, its
  committed item directory (``final_dir``: its key in the RAM tier), read-only; its
  shards' bytes by id (``shards``, a read-only view of its subclass's one map) and their
  size; a DCP step's manifest once told. A ``step.Step`` (this host's own shards) and a
  :class:`Replica` (another host's) are both; each says in its own way whether it is
  ``committed``."""

  def __init__(self, directory: str, step: int, final_dir: str,
               shards: Mapping[ShardId, np.ndarray]):
    self._directory, self._step, self._final_dir = directory, step, final_dir
    self._shard_view = shards
    self._nbytes = 0  # its shards' bytes (its subclass counts them as they come)
    self._manifest: Manifest | None = None  # a DCP step's, told at its commit

  @property
  def directory(self) -> str:
    return self._directory

  @property
  def step(self) -> int:
    return self._step

  @property
  def final_dir(self) -> str:
    return self._final_dir

  @property
  def shards(self) -> Mapping[ShardId, np.ndarray]:
    """Its shards' bytes by id (a read-only view: no copy)."""
    return self._shard_view

  @property
  def nbytes(self) -> int:
    return self._nbytes

  @property
  def manifest(self) -> Manifest | None:
    return self._manifest

  def keep_manifest(self, manifest: Manifest) -> None:
    """A DCP step's manifest, kept with this copy (``info`` answers it)."""
    self._manifest = manifest


class Replication:
  """This host's shards of one step on their way to its replica hosts (``receivers``).

  ``succeeded``/``failed`` end it (its sending thread's); ``cancel`` asks it to stop.
  """

  def __init__(self, receivers: Sequence[ReplicaTarget], bandwidth: int | None = None, *,
               tenant: str | None = None):
    self.receivers: tuple[ReplicaTarget, ...] = tuple(receivers)
    self.bandwidth = bandwidth  # bytes per second, each receiver's copy in turn
    self.tenant = tenant  # whose shards (its replicas carry it), as this sidecar knows
    self._done = threading.Event()
    self._cancelled = threading.Event()
    self._result: Replicated | None = None
    self._error: BaseException | None = None

  @property
  def result(self) -> Replicated | None:
    return self._result

  @property
  def error(self) -> BaseException | None:
    return self._error

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def cancel(self) -> None:
    self._cancelled.set()

  def wait(self, timeout: float | None) -> bool:
    """Waits for its end; whether it ended."""
    return self._done.wait(timeout)

  def succeeded(self, result: Replicated) -> None:
    self._result = result
    self._done.set()

  def failed(self, error: BaseException) -> None:
    self._error = error
    self._done.set()


class Replica(StepCopy):
  """The shards of one step that another sidecar (host ``source``) sent here: a replica.

  Its state changes only through its methods, each called by :class:`RamTier` under its
  lock (``replication.Replicator`` receives it through the tier's commands, the tier marks
  it committed): its shards arrive whole
  (``add_shard``) or in pieces (``piece_block``, ``piece_received``); it is ``whole``
  once its sender said so (``mark_whole``), ``committed`` once its step is (``commit``,
  before or after it is whole). A replica sent again while a whole one is held
  ``replaces`` it once whole itself (``take_place_of``).
  """

  def __init__(self, directory: str, step: int, final_dir: str, source: int, *,
               replaces: Replica | None = None):
    self._shards: dict[ShardId, np.ndarray] = {}  # its whole shards
    super().__init__(directory, step, final_dir, types.MappingProxyType(self._shards))
    self._source = source
    # Shards arriving inline, in pieces: [block, bytes received so far].
    self._partial: dict[ShardId, list] = {}
    self._whole = False  # the source sent everything
    self._committed = False
    # A whole replica held of the same step and source, which this one (sent again)
    # replaces once whole.
    self._replaces = replaces

  def __repr__(self) -> str:
    return f"Replica({self._final_dir!r}, source={self._source}, whole={self._whole})"

  @property
  def source(self) -> int:
    return self._source

  @property
  def partial(self) -> int:
    """How many shards are still arriving in pieces."""
    return len(self._partial)

  @property
  def whole(self) -> bool:
    return self._whole

  @property
  def committed(self) -> bool:
    return self._committed

  @property
  def replaces(self) -> Replica | None:
    return self._replaces

  def add_shard(self, key: ShardId, data: np.ndarray) -> None:
    """A whole shard (checked by its sender's crc32c), in place of one of the same id."""
    old = self._shards.get(key)
    self._nbytes += data.nbytes - (old.nbytes if old is not None else 0)
    self._shards[key] = data

  def piece_block(self, key: ShardId, block: np.ndarray | None = None) -> list | None:
    """The block the shard ``key`` is assembled in from its pieces, with the bytes
    received so far: ``[block, received]``; ``block`` is it at its first piece (None:
    None then, the caller makes one)."""
    entry = self._partial.get(key)
    if entry is None and block is not None:
      entry = self._partial[key] = [block, 0]
    return entry

  def piece_received(self, key: ShardId, entry: list, nbytes: int) -> bool:
    """``nbytes`` more of ``key``'s bytes are in its block (``entry``); whether the shard is
    whole now (then it is no longer arriving: the caller adds it)."""
    entry[1] += nbytes
    whole = entry[1] >= entry[0].nbytes
    if whole:
      self._partial.pop(key, None)
    return whole

  def mark_whole(self) -> None:
    """Its sender sent everything."""
    self._whole = True
    self._partial = {}

  def take_place_of(self, old: Replica) -> None:
    """It replaces ``old`` (the whole replica it was sent again of), committed as it was."""
    self._committed = self._committed or old.committed
    self._replaces = None

  def commit(self) -> None:
    """Its step is committed (before or after it is whole)."""
    self._committed = True
