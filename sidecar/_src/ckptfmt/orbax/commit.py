"""Committing a step: the tmp directory, the checks, the metadata files, one rename.

:func:`create_tmp_step` makes ``<step>.orbax-checkpoint-tmp`` with its
``_CHECKPOINT_METADATA`` (in two halves, :func:`make_tmp_step` and
:func:`write_tmp_metadata`, where a sidecar leaves the second to the step's writer
thread); once every host wrote its part, :func:`finalize` checks every
chunk is there, writes the item's ``_sharding``, ``_METADATA`` and
``commit_success.txt``, fsyncs the directories and renames the step into place.

Both remove or rename only relative to the step's checkpoint directory opened once
(``ckptfmt/dir_fd.py``: the sidecar's, opened from its root with no symlink followed, or
opened here from a path): a directory swapped for a symlink meanwhile never moves them.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sidecar._src.ckptfmt import dir_fd, direct_io
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.ckptfmt.orbax import files, libs
from sidecar._src.ckptfmt.spec import (
  COMMIT_SUCCESS_FILE,
  ITEM,
  METADATA_FILE,
  SHARDING_FILE,
  TMP_SUFFIX,
  LeafKind,
  LeafSpec,
  tmp_step_path,
)
from sidecar._src.core import errors

# Orbax is imported once for the process (``libs.load``: a sidecar that serves checkpoints
# at its start); each function imports what it uses after that load.
if TYPE_CHECKING:
  from orbax.checkpoint._src.metadata import tree as tree_metadata


def create_tmp_step(directory: os.PathLike | str, step: int, *, at: DirFd | None = None
                    ) -> pathlib.Path:
  """Creates the uncommitted step directory and its ``_CHECKPOINT_METADATA``.

  A tmp directory left over by an attempt that never committed is removed first,
  as Orbax's CheckpointManager does at start.

  Raises:
    FileExistsError: the step is already committed.
  """
  tmp = make_tmp_step(directory, step, at=at)
  write_tmp_metadata(tmp, time.time_ns())
  return tmp


def make_tmp_step(directory: os.PathLike | str, step: int, *, at: DirFd | None = None
                  ) -> pathlib.Path:
  """:func:`create_tmp_step`'s directory alone (anew), without its metadata file
  (:func:`write_tmp_metadata`): what the other hosts write their parts into once told.
  ``at``: ``directory`` opened (made here where missing, if None).

  Raises:
    FileExistsError: the step is already committed, or its directory was made meanwhile
      by another process (between the removal of a leftover and the ``mkdir``).
  """
  tmp = tmp_step_path(directory, step)
  with dir_fd.held(at, directory, make=True) as d:
    if d.lstat(str(int(step))) is not None:
      raise FileExistsError(f"step {step} is already committed at {d.join(str(int(step)))}")
    d.rmtree(tmp.name)
    try:
      d.mkdir(tmp.name)
    except FileExistsError as e:
      raise FileExistsError(e.errno, e.strerror, str(tmp)) from None
  return tmp


def write_tmp_metadata(tmp: pathlib.Path, init_timestamp_nsecs: int) -> None:
  """The ``_CHECKPOINT_METADATA`` of the uncommitted step ``tmp`` (made by
  :func:`make_tmp_step` at ``init_timestamp_nsecs``), which only the host that made it
  writes, any time before :func:`finalize`.

  Not fsynced (0.3-4 ms of a Begin, which save() waits for): :func:`finalize` writes it
  again, synced, before the rename; a step never committed is swept anyway.
  """
  _write_step_metadata(tmp, sync=False, init_timestamp_nsecs=init_timestamp_nsecs)


def finalize(tmp_step_dir: os.PathLike | str, leaves: Sequence[LeafSpec], *,
             num_hosts: int, custom_metadata: Mapping[str, Any] | None = None,
             manifest: str | None = None,
             renaming: Callable[[], None] | None = None,
             at: DirFd | None = None) -> pathlib.Path:
  """Checks the hosts' parts, writes the tree metadata and commits the step.

  Run once, after every host's :func:`write_host_part` returned. Checks that every
  chunk of every leaf was written before anything becomes visible.

  Args:
    tmp_step_dir: the directory :func:`create_tmp_step` returned.
    leaves: every leaf of the tree, in tree-flattening order.
    num_hosts: how many hosts wrote parts.
    custom_metadata: JSON-serializable, stored in ``_METADATA`` as Orbax's
      ``StandardSave(custom_metadata=...)`` does.
    manifest: the file name of the manifest written beside it, recorded in ``_METADATA``
      (``files.MANIFEST_KEY``); None: no manifest.
    renaming: called once every file is in place, just before the rename (a fault point).
    at: the step's checkpoint directory (where ``tmp_step_dir`` lies), opened: the rename
      is relative to it (None: opened here).

  Returns:
    The committed step directory.

  Raises:
    InvalidArgumentError: a host's part is missing or disagrees with the others.
    FileExistsError: the step was committed meanwhile.
  """
  tmp = pathlib.Path(tmp_step_dir)
  item_dir = files.item_dir(tmp, must_be_tmp=True)
  final = tmp.with_name(tmp.name.removesuffix(TMP_SUFFIX))
  finalize_item(item_dir, leaves, num_hosts=num_hosts, custom_metadata=custom_metadata,
                manifest=manifest)
  _write_step_metadata(tmp, commit_timestamp_nsecs=time.time_ns())
  files.write_text(tmp / COMMIT_SUCCESS_FILE, f"Checkpoint commit was successful to {final}")
  # Its entries are durable (finalize_item synced the item's) before the rename.
  direct_io.fsync_dir(tmp)
  with dir_fd.held(at, tmp.parent) as d:
    if renaming is not None:
      renaming()
    try:
      d.rename(tmp.name, final.name)  # never over a step committed meanwhile
    except FileExistsError:
      raise FileExistsError(f"step {final.name} was committed meanwhile at {final}") from None
    d.fsync()
  return final


def finalize_item(item_dir: os.PathLike | str, leaves: Sequence[LeafSpec], *, num_hosts: int,
                  custom_metadata: Mapping[str, Any] | None = None,
                  manifest: str | None = None) -> None:
  """The item half of :func:`finalize`: check, metadata. No step files, no rename.

  What an Orbax checkpoint handler does for its item; the CheckpointManager then
  commits the step. ``item_dir`` is the item's directory inside the uncommitted step.
  """
  item_dir = pathlib.Path(item_dir).absolute()
  files.check_unique(leaves)
  _check_array_metadatas(item_dir, leaves, num_hosts)
  _check_complete(item_dir, leaves)
  shardings = {base64.urlsafe_b64encode(leaf.param_name.encode()).decode(): leaf.sharding
               for leaf in leaves if leaf.sharding is not None}
  if shardings:
    files.write_text(item_dir / SHARDING_FILE, json.dumps(shardings, separators=(",", ":")))
  metadata = _tree_metadata(leaves, custom_metadata).to_json()
  if manifest is not None:
    metadata[files.MANIFEST_KEY] = manifest
  files.write_text(item_dir / METADATA_FILE, json.dumps(metadata))
  files.write_text(item_dir / COMMIT_SUCCESS_FILE,
              f"Checkpoint commit was successful to {item_dir}")
  for d in [*(p for p in item_dir.rglob("*") if p.is_dir()), item_dir]:
    direct_io.fsync_dir(d)


def _check_array_metadatas(item_dir: pathlib.Path, leaves: Sequence[LeafSpec],
                           num_hosts: int) -> None:
  """Checks every host wrote its part and all agree, as Orbax's finalize does."""
  if not any(leaf.kind is LeafKind.JAX_ARRAY for leaf in leaves):
    return
  libs.load()  # once, for the process: never raced
  from orbax.checkpoint._src.metadata import array_metadata_store
  meta_dir = item_dir / "array_metadatas"
  found = sorted(p.name for p in meta_dir.glob("process_*"))
  # One part per host, named by host id: after a lost host the ids need not be 0..n-1.
  if len(found) != num_hosts or not all(n.removeprefix("process_").isdigit() for n in found):
    raise errors.InvalidArgumentError(
        f"expected the parts of {num_hosts} hosts in {item_dir}, found {found}; run"
        " write_host_part on every host (with every leaf) before finalize")
  serializer = array_metadata_store.Serializer()
  per_host = {int(name.removeprefix("process_")):
              serializer.deserialize((meta_dir / name).read_text()) for name in found}
  names = {leaf.param_name for leaf in leaves if leaf.kind is LeafKind.JAX_ARRAY}
  for host, metas in per_host.items():
    if {m.param_name for m in metas} != names:
      raise errors.InvalidArgumentError(
          f"host {host} wrote metadata for {sorted(m.param_name for m in metas)},"
          f" expected {sorted(names)}")
  if len(per_host) > 1:
    try:
      array_metadata_store.Validator().validate_all_array_metadatas(per_host)
    except ValueError as e:
      raise errors.InvalidArgumentError(f"hosts disagree on the arrays: {e}") from e


def _check_complete(item_dir: pathlib.Path, leaves: Sequence[LeafSpec]) -> None:
  """Checks that every leaf has its ``.zarray`` and a file for every chunk."""
  for leaf in leaves:
    directory = item_dir / leaf.param_name
    names = os.listdir(directory) if directory.is_dir() else []
    chunk = _chunk_shape(item_dir, leaf)
    expected = math.prod(-(-s // c) for s, c in zip(leaf.shape, chunk))
    got = sum(not name.startswith(".") for name in names)  # chunk keys: "0.1", ...
    if ".zarray" not in names or got != expected:
      raise errors.InvalidArgumentError(
          f"step at {item_dir.parent} is incomplete: leaf {leaf.param_name!r} has"
          f" {got} of {expected} chunks (metadata written: {'.zarray' in names});"
          " some host did not write its shards")


def _chunk_shape(item_dir: pathlib.Path, leaf: LeafSpec) -> tuple[int, ...]:
  # Computed as write_host_part did: Orbax may split shards over 2 GiB.
  return tuple(files.write_spec(item_dir, leaf, 0, False).metadata.chunk_shape)


def _tree_metadata(leaves: Sequence[LeafSpec],
                   custom_metadata: Mapping[str, Any] | None,
                   ) -> tree_metadata.InternalTreeMetadata:
  libs.load()  # once, for the process: never raced
  from orbax.checkpoint._src.metadata import tree as tree_metadata, value_metadata_entry
  from orbax.checkpoint._src.metadata.pytree_metadata_options import PyTreeMetadataOptions
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  entries = []
  for leaf in leaves:
    key_metadata = tree_metadata.KeyMetadataEntry([
        tree_metadata.NestedKeyMetadataEntry(
            str(k), tree_metadata.KeyType.SEQUENCE if isinstance(k, int)
            else tree_metadata.KeyType.DICT)
        for k in leaf.key_path])
    value = value_metadata_entry.ValueMetadataEntry(
        value_type=str(leaf.kind),
        write_shape=leaf.write_shape if leaf.kind is LeafKind.JAX_ARRAY else None)
    entries.append(tree_metadata.InternalTreeMetadataEntry(
        str(tuple(str(k) for k in leaf.key_path)), key_metadata, value))
  return tree_metadata.InternalTreeMetadata(
      tree_metadata_entries=entries, use_ocdbt=False, use_zarr3=False,
      custom_metadata=dict(custom_metadata) if custom_metadata is not None else None,
      store_array_data_equal_to_fill_value=ts_utils.STORE_ARRAY_DATA_EQUAL_TO_FILL_VALUE,
      pytree_metadata_options=PyTreeMetadataOptions(support_rich_types=False))


def _write_step_metadata(step_dir: pathlib.Path, *, sync: bool = True, **timestamps: int
                         ) -> None:
  libs.load()  # once, for the process: never raced
  from orbax.checkpoint._src.handlers import standard_checkpoint_handler
  from orbax.checkpoint._src.metadata import (
    checkpoint as checkpoint_metadata,
    step_metadata_serialization,
  )
  path = checkpoint_metadata.step_metadata_file_path(step_dir)
  fields = {}
  if path.exists():
    fields = json.loads(path.read_text())
  fields = step_metadata_serialization.serialize(checkpoint_metadata.StepMetadata(
      item_handlers={ITEM: standard_checkpoint_handler.StandardCheckpointHandler.typestr()},
      init_timestamp_nsecs=timestamps.get(
          "init_timestamp_nsecs", fields.get("init_timestamp_nsecs")),
      commit_timestamp_nsecs=timestamps.get("commit_timestamp_nsecs")))
  files.write_text(pathlib.Path(path), json.dumps(fields), sync=sync)
