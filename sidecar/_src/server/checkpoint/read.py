"""Restores on the sidecar: an item's manifest and its shards, from the tier asked.

A read names the shard by its record, as the step's manifest lists it (``ShardRecord``, the
same the save wrote): its id finds the copy, its crc32c, dtype and shape check it.
``ram`` (this host's own copy: no copy, the block itself is leased to the caller),
``replica`` (a shard another sidecar sent here), ``disk`` (storage, straight into a new arena
block), or ``any`` (own copy, else storage). Every read with a crc32c checks it, a RAM
copy at every read (``any`` reads storage where it is corrupt). The caller
(``Checkpoints``) has checked the path under the roots.

What a restore believes is checked first (:func:`manifest_of`, :func:`info`): the
manifest against its own crc32c; a committed directory with none is a stock tool's only
where its format finds no sign of a sidecar (``Format.stock_manifest``), else it is
refused, never read unchecked; and the metadata a read from storage uses (Orbax's
``_METADATA`` and ``.zarray``, DCP's ``.metadata``) against the manifest
(``Format.check_stored`` for the whole step, ``Format.read`` for each shard's leaf).
Nothing but a SidecarError leaves a read: a file system's or TensorStore's error is
said as a corrupt checkpoint's, naming the file.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
from collections.abc import Callable

import numpy as np

from sidecar._src.ckptfmt import records, registry as formats_lib
from sidecar._src.ckptfmt.records import MANIFEST_FILE, Manifest, ShardRecord
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import copies, faults, lifecycle, ram_tier, step as step_lib
from sidecar._src.user import outputs

log = logging.getLogger(__name__)


def manifest_of(final_dir: str, formats: formats_lib.Registry = formats_lib.DEFAULT
                ) -> Manifest:
  """The manifest of a committed item, checked against its own crc32c; for a directory
  with none, its format's stock manifest (``Manifest.stock``), or CorruptCheckpointError
  where a sidecar wrote it (``Format.stock_manifest``)."""
  manifest = _manifest_file(final_dir)
  if manifest is not None:
    return manifest
  formats.check_read(final_dir)  # a step of another format: say so, before reading it
  return formats.of_committed(final_dir).stock_manifest(final_dir)


def _manifest_file(final_dir: str) -> Manifest | None:
  """The manifest file of ``final_dir``, checked; None where it has none. Read once per
  version of the file."""
  try:
    st = (pathlib.Path(final_dir) / MANIFEST_FILE).stat()
  except (FileNotFoundError, NotADirectoryError):
    return None
  return _manifest(final_dir, (st.st_ino, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _manifest(final_dir: str, stamp: tuple[int, ...]) -> Manifest:
  del stamp  # in the key only: a rewritten manifest is read again
  try:
    text = (pathlib.Path(final_dir) / MANIFEST_FILE).read_bytes()
  except (FileNotFoundError, NotADirectoryError):
    raise errors.InvalidArgumentError(f"cannot restore {final_dir}: its {MANIFEST_FILE} "
                                      "went while it was read") from None
  return Manifest.from_json(text, final_dir)


def info(final_dir: str, formats: formats_lib.Registry = formats_lib.DEFAULT, *,
         stored: bool = True) -> Manifest:
  """The manifest of a committed item (leaves, shard checksums, data position), checked
  (:func:`manifest_of`); with ``stored``, the item's metadata files too, against it
  (``Format.check_stored``: what a restore from storage reads).

  A directory a stock tool wrote (no manifest, no sign of a sidecar) gets one from its
  metadata: each leaf one shard, with no checksum to check.
  """
  manifest = _said(lambda: manifest_of(final_dir, formats), final_dir)
  if stored and not manifest.stock:
    _said(lambda: formats.get(manifest.format).check_stored(final_dir, manifest), final_dir)
  return manifest


def readable_taken_over(held: step_lib.Step | None) -> bool:
  """Whether ``held`` is a step this host took over and still holds whole, committed or not
  (its write may go on): its bytes are the ones the sidecars commit."""
  return (held is not None and held.takeover is not step_lib.Takeover.NONE
          and held.state in lifecycle.WHOLE)


def taken_over(held: step_lib.Step | None, final_dir: str, host_id: int) -> Manifest:
  """The manifest of a step this host took over (``held``, its RAM tier's), durable or
  not: its leaves, this host's shards' records (crc32c once written), the data position
  the lead's plan carries (on the committer's host; None elsewhere). What an in-process
  rollback restores from the RAM tiers before the step is durable; InvalidArgumentError
  where this host holds no such step (never taken over, failed, abandoned or dropped)."""
  if held is None or not readable_taken_over(held):
    raise errors.InvalidArgumentError(
        f"host {host_id} holds no step taken over at {final_dir!r:.200}"
        + (f" (it is {held.state.value}"
           f"{', taken over' if held.takeover is not step_lib.Takeover.NONE else ''})"
           if held is not None else "")
        + ": restore a committed step (latest_step())")
  records_ = held.written_records if held.state is not step_lib.State.STAGED else []
  if not records_:
    records_ = [s.record for s in held.staged()]
  lead = next((p.data_state_json for p in held.plans if p.lead), "")
  return Manifest.of_save(held.format, step=held.step, leaves=held.leaves, shards=records_,
                          data_state_json=lead, replicas=None)


def _said(read, final_dir: str):
  """``read()``, with what a file system or a library raises said as a SidecarError that
  names the file: no ``builtins.*`` crosses the wire."""
  try:
    return read()
  except errors.SidecarError:
    raise
  except (FileNotFoundError, NotADirectoryError) as e:
    raise errors.InvalidArgumentError(f"cannot read {final_dir}: {e}") from None
  except PermissionError as e:
    raise errors.PermissionDeniedError(
        f"cannot read {final_dir}: {e.filename or ''}: {e.strerror or e}") from None
  except OSError as e:
    raise errors.CorruptCheckpointError(
        f"cannot read {final_dir}: {os.path.relpath(e.filename, final_dir) if e.filename else ''}"
        f": {e.strerror or e}") from None
  except ValueError as e:  # a file's contents a library could not parse
    raise errors.CorruptCheckpointError(
        f"cannot read {final_dir}: {type(e).__name__}: {e}") from None


def _byte_range(data: np.ndarray, byte_range: tuple[int, int]) -> np.ndarray:
  """Bytes ``[offset, offset + nbytes)`` of ``data``'s C-order bytes, as a view."""
  offset, nbytes = byte_range
  flat = data.reshape(-1).view(np.uint8)
  if not (0 <= offset and 0 < nbytes and offset + nbytes <= flat.nbytes):
    raise errors.InvalidArgumentError(
        f"the byte range [{offset}, {nbytes}] (the request's part) does not fit a shard of "
        f"{flat.nbytes} bytes")
  return flat[offset:offset + nbytes]


class Reader:
  """Serves reads of shards from ``tier`` (a sidecar's RAM tier) or from storage."""

  def __init__(self, tier: ram_tier.RamTier, metrics: metrics_lib.Recorder,
               formats: formats_lib.Registry = formats_lib.DEFAULT):
    self._tier = tier
    self._metrics = metrics
    self._formats = formats

  def read(self, final_dir: str, record: ShardRecord, tier: str = "any",
           byte_range: tuple[int, int] | None = None, *, checked: bool = True,
           stored: Stored | None = None) -> np.ndarray:
    """The stored shard ``record`` describes (the step's manifest's record: its id says
    which, the copy served is checked against its crc32c, dtype and shape): from the RAM
    tier (no copy) or from storage into the arena.

    ``byte_range=(offset, nbytes)``: only those bytes of a RAM-tier copy's C-order bytes,
    for a client that reads a large shard over gRPC in messages of bounded size (the
    whole copy checked). ``checked=False``: its crc32c is not checked here (the caller
    checks it, or another piece of the shard asked for it); its dtype and shape are.
    ``stored``: how a read from storage is made (a pool tenant's process); None: here.
    """
    if byte_range is not None and tier not in ("ram", "replica"):
      raise errors.InvalidArgumentError(
          f"a byte range (part) reads a RAM-tier copy (tier 'ram' or 'replica'), got tier {tier!r}")
    step = pathlib.Path(final_dir).parent.name
    if step.isdigit():
      faults.fault("read", int(step))
    if tier not in ("any", "ram", "replica", "disk"):
      raise errors.InvalidArgumentError(
          f"tier must be 'any', 'ram', 'replica' or 'disk', got {tier!r}")
    shard = record.id
    if tier in ("any", "ram", "replica"):
      held: step_lib.Step | copies.Replica | None = None
      if tier == "replica":
        held = self._tier.replica_with(final_dir, shard)
      else:
        held = self._tier.find(final_dir)
        # A step taken over, durable or not: an in-process rollback reads it (the
        # bytes the sidecars commit), its records from ``taken_over``.
        if held is not None and not (
            (held.committed or (tier == "ram" and readable_taken_over(held)))
            and shard in held.shards):
          held = None
      if held is not None:
        data = held.shards[shard]
        out = data if byte_range is None else _byte_range(data, byte_range)
        try:
          # At every read, never once for all: a Worker that maps the arena can write the
          # block after an earlier restore checked it. A corrupt copy is one that is not
          # there: tier "any" reads storage instead, the caller's fallback the next copy.
          what = f"{tier} copy on host {self._tier.host_id}"
          records.check_form(final_dir, record, data, what)
          if checked:
            records.check_crc32c(final_dir, record, data, what)
        except errors.CorruptCheckpointError as e:
          if tier != "any":
            raise
          log.warning("%s; reading the stored copy instead", e)
        else:
          self._metrics.restored_bytes(
              "replica" if isinstance(held, copies.Replica) else "ram", out.nbytes)
          return out
      elif tier != "any":
        raise errors.InvalidArgumentError(
            f"host {self._tier.host_id} holds no {'RAM' if tier == 'ram' else tier} copy of it")
    if stored is None:
      data = read_stored(final_dir, record, allocate=outputs.empty, checked=checked,
                         formats=self._formats)
    else:
      data = stored(final_dir, record, checked)
    self._metrics.restored_bytes("storage", data.nbytes)
    return data


# How a read from storage is made elsewhere (a pool tenant's process: ``tenant_procs/``):
# the shard of ``(final_dir, record)``, checked where ``checked``.
Stored = Callable[[str, ShardRecord, bool], np.ndarray]


def read_stored(final_dir: str, record: ShardRecord, *, allocate: Callable[..., np.ndarray],
                checked: bool, formats: formats_lib.Registry = formats_lib.DEFAULT
                ) -> np.ndarray:
  """The stored shard ``record`` describes, read from ``final_dir`` into ``allocate``
  (``outputs.empty``'s signature), checked against its record (form; crc32c where
  ``checked``): in the sidecar, or in a pool tenant's process, as its user.

  The format its manifest names (a restore names none), and what it says the save wrote:
  the leaf's metadata is checked against it before the read (with no manifest, the format
  refuses a directory a sidecar wrote).
  """
  manifest = _manifest_file(final_dir)
  fmt = formats.of_committed(final_dir) if manifest is None else formats.get(manifest.format)
  data = _said(lambda: fmt.read(final_dir, record, allocate=allocate, manifest=manifest),
               final_dir)
  records.check_form(final_dir, record, data, "stored copy")
  if checked:
    records.check_crc32c(final_dir, record, data, "stored copy")
  return data
