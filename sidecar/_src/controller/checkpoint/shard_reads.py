"""One stored shard's read for a restore, from the first of its sources that gives a valid
copy: the tier fallback of every framework and format (:class:`ShardReads`).

A source is a tier on a host (:class:`Source`): the arena of the host that staged the
shard (``ram``), a replica another sidecar keeps (``replica``), the step's files read
through a host (``storage``). Each copy read is checked against the shard's record in the
step's manifest (dtype, shape, crc32c) before it is taken; one that fails, or whose host
is gone, falls back to the next source. ``restore.Restorer`` (JAX's and the numpy core's
restores) and ``torch/storage.StorageReader`` (DCP's) read through it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from sidecar._src.ckptfmt import records
from sidecar._src.ckptfmt.records import ShardRecord
from sidecar._src.ckptfmt.tiers import Tier
from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.core import dtypes as dtypes_lib, errors

log = logging.getLogger(__name__)
# A RAM-tier shard read over gRPC (its host's arena not mapped here) comes in pieces of
# at most this many bytes: well under the channel's 256 MiB message limit.
READ_PIECE_BYTES = 64 << 20
# The tiers of RAM copies: one in an arena this process maps is read there.
_IN_RAM = (Tier.RAM, Tier.REPLICA)


class Source(NamedTuple):
  """One place a restore reads a shard's copy from: ``tier`` on ``host`` (a frozen pair:
  ``host, tier = source`` reads it too)."""

  host: int
  tier: Tier

  @property
  def label(self) -> str:
    """The source as a restore's stats name it (``RestoreStats.shards``): ``"ram:host0"``,
    ``"replica:host1"``, ``"storage"`` (through whichever host), ``"any:host0"``."""
    return "storage" if self.tier is Tier.STORAGE else f"{self.tier.value}:host{self.host}"


def tier_of(label: str) -> str:
  """The tier a :attr:`Source.label` names, as a restore's stats say it: ``"ram"``,
  ``"replica"``, ``"storage"``, ``"any"``."""
  return label.split(":", 1)[0]


class ShardReads:
  """The tier fallback of a restore, for every framework and format: the stored shard a
  record of the step's manifest describes, read from the first of its sources
  (:class:`Source`: a host's ``Tier``) whose copy reads and passes the record's checks
  (crc32c, dtype, shape). The record goes down to the sidecar's read as it is
  (``CheckpointTransport.read``).

  Args:
    client: the sidecars.
    mapped: the hosts whose arenas this process maps (a RAM-tier shard of another host,
      read over gRPC, comes in pieces of at most ``READ_PIECE_BYTES``).
  """

  def __init__(self, client: CheckpointTransport, mapped: set[int] | frozenset[int]):
    self.client, self.mapped = client, mapped

  def first(self, final_dir: str, record: ShardRecord, sources: Iterable[tuple[int, str]],
            dtype: np.dtype | None = None) -> concurrent.futures.Future:
    """A future of ``(data, source)``, ``source`` the :class:`Source` read, from the first
    of ``sources`` (``(host, tier)`` pairs) that gives a valid copy; else of
    ShardsLostError naming every try (or another failure as it is).
    ``dtype``: the leaf's, for a record that says none (an earlier release's manifest)."""
    return self.start(final_dir, record, sources, dtype).out

  def start(self, final_dir: str, record: ShardRecord, sources: Iterable[tuple[int, str]],
            dtype: np.dtype | None = None,
            checks: concurrent.futures.Executor | None = None, *,
            private: bool = False) -> ShardRead:
    """:meth:`first`'s read, begun; with ``checks``, a RAM copy this process maps is read
    unchecked and checked here, on ``checks`` (:class:`ShardRead`); ``private``: a copy
    this process maps comes copy-on-write (``CheckpointTransport.read``)."""
    typed = [Source(host, Tier(tier)) for host, tier in sources]
    read = ShardRead(self, final_dir, record, typed, _Form.of(record, dtype), checks, private)
    read.attempt(0)
    return read

  def read(self, source: Source, final_dir: str, record: ShardRecord, form: _Form,
           *, checked: bool = True, private: bool = False) -> concurrent.futures.Future:
    """One source's read of the shard: in pieces where it is large and not mapped here."""
    host, tier = source
    if (tier in _IN_RAM and host not in self.mapped and form.known
        and form.nbytes > READ_PIECE_BYTES):
      return self._read_pieces(final_dir, record, tier, host, form, checked)
    return self.client.read(host, final_dir, record, tier=tier, checked=checked,
                            private=private)

  def _read_pieces(self, final_dir: str, record: ShardRecord, tier: Tier, host: int,
                   form: _Form, checked: bool) -> concurrent.futures.Future:
    """A future of a RAM-tier shard read from ``host`` over gRPC in pieces of at most
    READ_PIECE_BYTES, assembled here (the host checks the whole shard's crc32c, with the
    first piece)."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    assert form.shape is not None
    data = np.empty(form.shape, form.dtype)
    flat = data.reshape(-1).view(np.uint8)
    pieces = [(o, min(READ_PIECE_BYTES, flat.nbytes - o))
             for o in range(0, flat.nbytes, READ_PIECE_BYTES)]
    left = [len(pieces)]
    lock = threading.Lock()

    def done(offset: int, f: concurrent.futures.Future) -> None:
      error = f.exception()
      if error is None:
        piece = f.result()
        flat[offset:offset + piece.nbytes] = piece
      with lock:  # the first failure fails the shard; else the last piece completes it
        left[0] -= 1
        if out.done():
          return
        if error is not None:
          out.set_exception(error)
        elif left[0] == 0:
          out.set_result(data)

    for offset, nbytes in pieces:
      # Only the first piece asks for the check: the host checks the whole shard once, and
      # its failure fails the shard (the pieces all go at once, so each would check it).
      future = self.client.read(host, final_dir, record, tier=tier,
                                checked=checked and offset == 0, byte_range=(offset, nbytes))
      future.add_done_callback(functools.partial(done, offset))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Form:
  """The dtype and shape a shard's copy must have: its record's; where the record says
  none (an earlier release's manifest), its leaf's dtype and its index's extent (None:
  not known, a DCP bytes item's, or no dtype given)."""

  dtype: np.dtype | None
  shape: tuple[int, ...] | None

  @classmethod
  def of(cls, record: ShardRecord, dtype: np.dtype | None) -> _Form:
    if record.dtype:
      return cls(dtypes_lib.dtype_of(record.dtype, f"the record of {list(record.key_path)}"),
                 record.shape)
    return cls(dtype, tuple(b - a for a, b in record.index) if record.index else None)

  @property
  def known(self) -> bool:
    return self.dtype is not None and self.shape is not None

  @property
  def nbytes(self) -> int:
    assert self.dtype is not None and self.shape is not None
    return math.prod(self.shape) * self.dtype.itemsize


class ShardRead:
  """One stored shard's read, trying its sources in turn until one reads and checks.

  ``out``: a future of ``(data, source)`` (a :class:`Source`), checked. ``ready``: the
  same as soon as a copy is read, before its check where it is this process's to make:
  with ``checks`` (an executor), a RAM copy in an arena this process maps is read without
  the sidecar's check and checked here, so its transfers can start while the crc32c runs
  (``out`` then says whether they must be done again, from the next source).

  Its callbacks are partials of its methods, and nothing here refers back to them: no
  reference cycle holds the shard (an arena view), so its block goes back at the last
  reference to the restored array, without the garbage collector.
  """

  def __init__(self, reads: ShardReads, final_dir: str, record: ShardRecord,
               sources: list[Source], form: _Form,
               checks: concurrent.futures.Executor | None, private: bool = False):
    self._reads, self._final_dir, self._record = reads, final_dir, record
    self._private = private
    self._sources, self._form, self._checks = sources, form, checks
    self.failures: list[tuple[str, errors.SidecarError]] = []
    self.ready: concurrent.futures.Future = concurrent.futures.Future()
    self.out: concurrent.futures.Future = concurrent.futures.Future()

  def attempt(self, i: int) -> None:
    if i == len(self._sources):
      self._finish(error=_failed(self.failures))
      return
    source = self._sources[i]
    here = (self._checks is not None and self._record.crc32c is not None
            and source.tier in _IN_RAM and source.host in self._reads.mapped)
    try:
      f = self._reads.read(source, self._final_dir, self._record, self._form,
                           checked=not here, private=self._private)
    except errors.SidecarError as e:
      self._try_next(i, e)
      return
    f.add_done_callback(functools.partial(self._done, i, here))

  def _try_next(self, i: int, error: errors.SidecarError) -> None:
    """Source ``i`` gave no valid copy (``error``): the next one is tried."""
    source = self._sources[i]
    self.failures.append((f"{source.label} (host {source.host})", error.with_traceback(None)))
    self.attempt(i + 1)

  def _done(self, i: int, here: bool, f: concurrent.futures.Future) -> None:
    source = self._sources[i]
    try:
      data = self._as_saved(f.result(), source.label)
    except errors.SidecarError as e:
      self._try_next(i, e)
      return
    if not here:
      self._finish((data, source))
      return
    if not self.ready.done():
      self.ready.set_result((data, source))
    assert self._checks is not None
    try:
      self._checks.submit(functools.partial(self._check, i, data))
    except RuntimeError:  # the restore that owns the executor ended (interrupted)
      self._finish(error=errors.ClosedError("the restore ended before this shard was checked"))

  def _as_saved(self, data: np.ndarray, label: str) -> np.ndarray:
    """``data`` if it has the dtype and shape the save wrote (``_Form``); else
    CorruptCheckpointError: a copy whose metadata was changed reads the same bytes as
    other numbers, and its crc32c still matches."""
    dtype, shape = self._form.dtype, self._form.shape
    if (dtype is not None and data.dtype != dtype) or (shape is not None and data.shape != shape):
      r = self._record
      name = ".".join(str(k) for k in r.key_path)
      raise errors.CorruptCheckpointError(
          f"{self._final_dir}: array {name!r} shard {[list(i) for i in r.index]} came "
          f"from {label} as {data.dtype}{list(data.shape)}, where the save wrote "
          f"{dtype}{list(shape or data.shape)}: its metadata was changed after the save")
    return data

  def _check(self, i: int, data: np.ndarray) -> None:
    source = self._sources[i]
    try:
      records.check_crc32c(self._final_dir, self._record, data,
                           f"{source.tier} copy on host {source.host}")
    except errors.CorruptCheckpointError as e:
      self._try_next(i, e)
      return
    self._finish((data, source))

  def _finish(self, result: tuple[np.ndarray, Source] | None = None,
              error: BaseException | None = None) -> None:
    for f in (self.ready, self.out):
      if f.done():
        continue
      if error is not None:
        f.set_exception(error)
      else:
        f.set_result(result)


# A copy that fails with one of these is not there (its host is gone, it holds none, the
# file is missing) or not valid (its checksum): the shard is lost only if every copy is.
_GONE = (errors.CorruptCheckpointError, errors.HostLostError, errors.InvalidArgumentError)


def _failed(failures: list[tuple[str, errors.SidecarError]]) -> errors.SidecarError:
  """The error of a shard no source gave: ShardsLostError (naming every try) if no copy
  is there or valid; else the first other failure (an arena full, a deadline) as it is."""
  other = next((e for _, e in failures if not isinstance(e, _GONE)), None)
  if other is not None:
    return other
  return errors.ShardsLostError(
      "; ".join(f"{where}: {str(e).splitlines()[0]}" for where, e in failures)
      or "no source to read it from")


def warn_unchecked(final_dir: str, tool: str) -> None:
  """Says (a warning) that the checkpoint at ``final_dir``, which ``tool`` wrote with no
  manifest, is restored with nothing to check its bytes against."""
  log.warning("%s was written by %s (it has no %s): it has no checksums, so its bytes are "
              "restored unchecked; a checkpoint the sidecars save has one per shard",
              final_dir, tool, records.MANIFEST_FILE)
