"""Stock Orbax's layout (Zarr v2 without OCDBT) as a :class:`~sidecar._src.ckptfmt.format.Format`.

A step is ``<directory>/<step>.orbax-checkpoint-tmp/`` while written, each host writing
its shards of the item ``default`` into it (``write.write_item_part``), renamed to
``<step>`` at the commit (``commit.finalize``). A staged shard's number is its leaf's
(the step's leaves come with its first part), and its id names that leaf; the writer
takes the staged records as they are. Orbax and TensorStore are imported once for the
process (``libs.load``: :meth:`OrbaxFormat.load`, a sidecar's start), by ``write``,
``commit`` and ``read`` inside the functions that use them: importing this module loads
none of them.
"""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from sidecar._src.ckptfmt import direct_io, records
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.ckptfmt.format import Allocate, Format, Numbering, Turn, Uncommitted
from sidecar._src.ckptfmt.orbax import (
  commit as orbax_commit,
  libs as orbax_libs,
  read as orbax_read,
  write as orbax_write,
)
from sidecar._src.ckptfmt.records import Manifest, ShardId, ShardRecord, Staged
from sidecar._src.ckptfmt.save_values import Commit
from sidecar._src.ckptfmt.spec import (
  COMMIT_SUCCESS_FILE,
  ITEM,
  METADATA_FILE,
  TMP_SUFFIX,
  LeafSpec,
  tmp_step_path,
)
from sidecar._src.core import errors

MARKERS = ("_CHECKPOINT_METADATA", METADATA_FILE, COMMIT_SUCCESS_FILE, records.MANIFEST_FILE)


class LeafNumbering(Numbering):
  """A staged shard's number is its leaf's, in the step's leaves, and its id names that
  leaf."""

  def __init__(self, leaves: Sequence[LeafSpec]):
    self.leaves = tuple(leaves)

  def take(self, extra: Any, shards: Sequence[Staged]) -> list[Staged]:
    del extra  # Orbax's steps carry none
    for s in shards:
      r = s.record
      if not 0 <= r.leaf < len(self.leaves):
        raise errors.InvalidArgumentError(
            f"shard of leaf {r.leaf}: the step has {len(self.leaves)} leaves")
      if r.id.key_path != self.leaves[r.leaf].key_path or r.rank is not None:
        raise errors.InvalidArgumentError(
            f"shard of leaf {r.leaf} names {list(r.id.key_path)}"
            f"{'' if r.rank is None else f' of rank {r.rank}'}, the leaf is "
            f"{list(self.leaves[r.leaf].key_path)}")
    return list(shards)


class OrbaxFormat(Format):
  """Stock Orbax's layout; see the module's docstring."""

  name: ClassVar[str] = "orbax"
  tmp_suffix: ClassVar[str] = TMP_SUFFIX
  markers: ClassVar[tuple[str, ...]] = MARKERS
  item: ClassVar[str] = ITEM
  overwrites: ClassVar[bool] = False
  title: ClassVar[str] = "an Orbax checkpoint"
  readers: ClassVar[str] = "ctl.checkpointer (sidecar.jax) or orbax.checkpoint"

  def installed(self) -> bool:
    return orbax_libs.installed()

  def load(self) -> None:
    try:
      orbax_libs.load()
    except ImportError as e:
      raise errors.InvalidArgumentError(
          f"format {self.name!r} cannot be written or read by this sidecar: {e}; or save in "
          "DCP's layout (CheckpointOptions(format=\"dcp\"))") from None

  def create_tmp(self, directory: str, step: int, *, at: DirFd | None = None
                 ) -> pathlib.Path:
    return orbax_commit.create_tmp_step(directory, step, at=at)

  def begin_tmp(self, directory: str, step: int, *, at: DirFd | None = None
                ) -> tuple[pathlib.Path, Callable[[], None]]:
    # The step's _CHECKPOINT_METADATA later: no other host writes it, finalize reads it.
    tmp = orbax_commit.make_tmp_step(directory, step, at=at)
    return tmp, functools.partial(orbax_commit.write_tmp_metadata, tmp, time.time_ns())

  def tmp_of(self, directory: str, step: int) -> str:
    return str(tmp_step_path(directory, step))

  def final_of(self, path: pathlib.Path) -> Uncommitted | None:
    # A save writes its item directory inside the tmp step directory.
    tmp = next((p for p in path.parents if TMP_SUFFIX in p.name), None)
    if tmp is None:
      return None
    step_dir = tmp.with_name(tmp.name.split(TMP_SUFFIX)[0])
    return Uncommitted(tmp, step_dir, step_dir / path.relative_to(tmp))

  def is_checkpoint(self, path: pathlib.Path) -> bool:
    """Orbax's markers or our manifest in ``path`` or one of its item directories. A
    step another host's retention removes while this looks is not one (no error)."""
    if not path.is_dir():
      return False
    if any((path / m).is_file() for m in self.markers):
      return True
    try:
      children = list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
      return False  # removed (or replaced) since is_dir: not a checkpoint now
    return any(child.is_dir() and not child.is_symlink()
               and any((child / m).is_file() for m in self.markers) for child in children)

  def misread(self, final_dir: pathlib.Path) -> tuple[pathlib.Path, list[str]] | None:
    """An Orbax step directory asked for as a checkpoint of its own (a DCP reader's
    ``<step>``): Orbax's readers read its item, never the step. A step another host's
    retention removes while this looks is not one (no error)."""
    if not final_dir.is_dir() or any((final_dir / m).is_file()
                                     for m in (METADATA_FILE, records.MANIFEST_FILE)):
      return None  # not there, or an item itself
    shown = [m for m in MARKERS[:1] if (final_dir / m).is_file()]
    try:
      children = sorted(final_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
      return None  # removed (or replaced) since is_dir: nothing there to misread
    shown += [f"{c.name}/" for c in children
              if c.is_dir() and any((c / m).is_file() for m in MARKERS)]
    return (final_dir, shown) if shown else None

  def numbering(self, leaves: Sequence[LeafSpec]) -> LeafNumbering:
    return LeafNumbering(leaves)

  def write(self, tmp_dir: str, host_id: int, numbering: Numbering, incoming: Iterator[Any],
            *, progress: Callable[[int], None], turn: Turn) -> list[ShardRecord]:
    assert isinstance(numbering, LeafNumbering)
    return orbax_write.write_item_part(tmp_dir, host_id, numbering.leaves, incoming,
                                       progress=progress, turn=turn)

  def commit(self, commit: Commit, manifest: Manifest, *, swapping: Callable[[], None],
             at: DirFd | None = None) -> str:
    """The manifest, the checks and the metadata files; with ``whole_step`` the step's
    rename (the rename acts on ``tmp_dir``'s parent, the tmp step directory), else the
    item is done and the Orbax CheckpointManager that owns the step commits it. No
    overwrite: one rename (``swapping`` runs just before it); no extra."""
    tmp_dir, leaves, num_hosts = commit.tmp_dir, commit.leaves, commit.num_hosts
    whole_step = commit.whole_step
    if whole_step and not pathlib.Path(tmp_dir).parent.name.endswith(TMP_SUFFIX):
      raise errors.InvalidArgumentError(
          f"tmp_dir {tmp_dir!r:.200} is not in an uncommitted step directory (*{TMP_SUFFIX})")
    try:
      direct_io.write_small(pathlib.Path(tmp_dir) / records.MANIFEST_FILE,
                            manifest.to_json().encode())
    except (FileNotFoundError, NotADirectoryError) as e:
      raise errors.InvalidArgumentError(
          f"commit: tmp_dir {tmp_dir!r:.200} is not a directory this sidecar staged and wrote "
          f"({e.strerror}); stage and prepare a step before committing it") from None
    if whole_step:
      return str(orbax_commit.finalize(pathlib.Path(tmp_dir).parent, leaves, num_hosts=num_hosts,
                                       manifest=records.MANIFEST_FILE, renaming=swapping,
                                       at=at))
    orbax_commit.finalize_item(tmp_dir, leaves, num_hosts=num_hosts,
                               manifest=records.MANIFEST_FILE)
    return tmp_dir

  def read(self, final_dir: str, record: ShardRecord, *, allocate: Allocate,
           manifest: Manifest | None) -> np.ndarray:
    shard, leaf = record.id, None
    if manifest is None:
      missing = orbax_read.manifest_missing(final_dir)
      if missing is not None:
        raise missing
    else:
      leaf = next((x for x in manifest.leaves if x.key_path == shard.key_path), None)
      if leaf is None:
        raise errors.InvalidArgumentError(
            f"{final_dir} has no leaf {list(shard.key_path)} (its {records.MANIFEST_FILE})")
    return orbax_read.read_item_shard(final_dir, shard.key_path, shard.index,
                                      allocate=allocate, leaf=leaf)

  def check_stored(self, final_dir: str, manifest: Manifest) -> None:
    """The item's ``_METADATA``, every leaf's ``.zarray`` and every chunk file's presence
    and size against the manifest (``check.check_item``)."""
    orbax_read.check_item(final_dir, manifest)

  def stock_manifest(self, final_dir: str) -> Manifest:
    """An item stock Orbax wrote has no manifest: each leaf counts as one shard, with no
    checksum to check. One a sidecar wrote (its ``_METADATA`` says so) has lost its
    checksums: CorruptCheckpointError."""
    try:
      missing = orbax_read.manifest_missing(final_dir)
      if missing is not None:
        raise missing
      leaves = [records.SavedLeaf.from_dict(d) for d in orbax_read.item_leaves(final_dir)]
    except FileNotFoundError as e:
      raise errors.InvalidArgumentError(f"cannot restore {final_dir}: {e}") from None
    return Manifest(self.name, leaves,
                    [ShardRecord(ShardId(leaf.key_path, tuple((0, n) for n in leaf.shape)), i,
                                 None, leaf.dtype, leaf.shape, 0)
                     for i, leaf in enumerate(leaves)], extras={records.STOCK: True})
