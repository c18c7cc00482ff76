"""A checkpoint step in stock Orbax's on-disk layout, written by N sidecars.

Stock Orbax (0.12) saves with ``StandardCheckpointHandler(use_ocdbt=False)`` (Zarr v2
without OCDBT, POSIX atomic rename) a step laid out as::

  <directory>/<step>.orbax-checkpoint-tmp/   while writing; renamed to <step> to commit
    _CHECKPOINT_METADATA        step metadata: item handlers, init/commit timestamps
    commit_success.txt          written just before the rename
    default/                    the one item, "default"
      _METADATA                 tree metadata: key paths, value types, write shapes
      _sharding                 {base64url(param name): serialized NamedSharding}
      array_metadatas/process_<i>   per-process write and chunk shapes of jax.Array leaves
      <param>/.zarray           each array's Zarr metadata, written by process 0
      <param>/<i>.<j>           one file per chunk, written by the process that owns it
      commit_success.txt

That is the layout written here. Orbax's default (OCDBT) packs chunks into a few
database files, which suits object stores; plain files let a sidecar write each
uncompressed chunk straight from the arena with O_DIRECT (``direct_io``): no copy
through the page cache, almost no CPU taken from the training step, and the disk
busy from the first byte. Stock Orbax restores either (it looks for
``manifest.ocdbt``), and :func:`read_leaf` reads both.

A sidecar is not part of a ``jax.distributed`` job, so Orbax's own barriers and
``jax.process_index()`` cannot place its part. Each sidecar instead plays the Orbax
process ``host_index``: :func:`write_host_part` writes the shards its host owns with
Orbax's own TensorStore specs (and file names), and once every host is done one
caller runs :func:`finalize`, which checks every chunk is there, writes the metadata
files and commits with one atomic rename.

Chunks are stored uncompressed by default: Orbax's default zstd makes a save CPU-bound,
and stock Orbax reads whatever compressor ``.zarray`` names.

Typical flow (host 0 or the controller on shared storage)::

  tmp = orbax_layout.create_tmp_step(directory, step)
  # on every host h, concurrently, with that host's shards:
  sums = orbax_layout.write_host_part(tmp, h, host_leaves)
  # once all hosts reported:
  final = orbax_layout.finalize(tmp, specs, num_hosts=n)
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import crc32c
import numpy as np
import tensorstore as ts
from orbax.checkpoint._src.handlers import standard_checkpoint_handler
from orbax.checkpoint._src.metadata import (
  array_metadata_store,
  checkpoint as checkpoint_metadata,
  step_metadata_serialization,
  tree as tree_metadata,
  value_metadata_entry,
)
from orbax.checkpoint._src.metadata.pytree_metadata_options import PyTreeMetadataOptions
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from sidecar._src import codec, direct_io, errors
from sidecar._src.layout_spec import (
    COMMIT_SUCCESS_FILE,
    ITEM,
    METADATA_FILE,
    SHARDING_FILE,
    TMP_SUFFIX,
    Index,
    KeyPath,
    LeafKind,
    LeafSpec,
    tmp_step_path,
)

_HANDLER_TYPESTR = standard_checkpoint_handler.StandardCheckpointHandler.typestr()
_WRITERS = 4  # chunk files written at once: enough to overlap one file's fsync with the next


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
  """One block of a leaf: where it sits in the global array, and its bytes.

  ``index`` takes slices or ``(start, stop)`` pairs (``jax`` ``Shard.index`` works
  as is) and is stored as ``(start, stop)`` pairs once a leaf resolves it.
  """

  index: tuple[slice | tuple[int, int], ...]
  data: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class HostLeaf:
  """A leaf and the shards of it this host writes (possibly none)."""

  spec: LeafSpec
  shards: tuple[Shard, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "shards", tuple(self.shards))


@dataclasses.dataclass(frozen=True, slots=True)
class ShardChecksum:
  """The crc32c of one written shard's C-order bytes, for the step's manifest."""

  key_path: KeyPath
  index: Index
  nbytes: int
  crc32c: int


def shard_crc32c(data: np.ndarray) -> int:
  """crc32c of an array's C-order bytes, as :class:`ShardChecksum` records it."""
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return crc32c.crc32c(memoryview(flat))  # type: ignore[arg-type]


def _checksum(spec: LeafSpec, index: Index, data: np.ndarray) -> ShardChecksum:
  return ShardChecksum(spec.key_path, index, data.nbytes, shard_crc32c(data))


def create_tmp_step(directory: os.PathLike | str, step: int) -> pathlib.Path:
  """Creates the uncommitted step directory and its ``_CHECKPOINT_METADATA``.

  A tmp directory left over by an attempt that never committed is removed first,
  as Orbax's CheckpointManager does at start.

  Raises:
    FileExistsError: the step is already committed.
  """
  final = pathlib.Path(directory) / str(int(step))
  if final.exists():
    raise FileExistsError(f"step {step} is already committed at {final}")
  tmp = tmp_step_path(directory, step)
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  _write_step_metadata(tmp, init_timestamp_nsecs=time.time_ns())
  return tmp


def write_host_part(tmp_step_dir: os.PathLike | str, host_index: int,
                    leaves: Sequence[HostLeaf], *, use_compression: bool = False,
                    ) -> list[ShardChecksum]:
  """Writes this host's shards into the step's chunk files.

  Every host passes every leaf of the tree, with the shards it owns (replicated
  shards on exactly one host); host 0 also writes each array's ``.zarray``, as Orbax's
  primary host does. The shard arrays must not change until this returns: they are
  written without a copy.

  Returns:
    The crc32c of every shard written, in the order given.
  """
  leaves = list(leaves)
  return write_item_part(_item_dir(tmp_step_dir, must_be_tmp=True), host_index,
                         [leaf.spec for leaf in leaves],
                         [(i, shard) for i, leaf in enumerate(leaves) for shard in leaf.shards],
                         use_compression=use_compression)


def _background_thread() -> None:
  """Puts the calling thread in Linux's idle scheduling class (``SCHED_IDLE``).

  A save persists while the training step runs on the same cores: its chunk writes
  and checksums run only on a core nothing else wants, and a waking training thread
  preempts them at once (a niced thread may finish its time slice first). Threads a
  ``SCHED_IDLE`` thread starts inherit the class, so these threads never call
  TensorStore: its shared pool outlives them and serves restores too.
  """
  try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
  except (AttributeError, OSError):  # not Linux: the ordinary priority
    pass


def write_item_part(item_dir: os.PathLike | str, host_index: int, specs: Sequence[LeafSpec],
                    shards: Iterable[tuple[int, Shard]], *, use_compression: bool = False,
                    progress: Callable[[int], None] | None = None) -> list[ShardChecksum]:
  """:func:`write_host_part` into an item directory given as such (an Orbax handler's).

  ``specs`` are every leaf of the tree; ``shards`` yields this host's shards as
  ``(leaf number, shard)``. It may be a generator that waits for shards still being
  staged: each one's write and checksum start as it arrives.
  ``progress(nbytes)`` is called as each shard becomes durable.
  """
  item_dir = pathlib.Path(item_dir).absolute()
  if not isinstance(host_index, int) or host_index < 0:
    raise errors.InvalidArgumentError(f"host_index must be an int >= 0, got {host_index!r}")
  _check_unique(specs)
  item_dir.mkdir(parents=True, exist_ok=True)
  context = ts_utils.get_ts_context(use_ocdbt=False)
  write_specs = [_write_spec(item_dir, spec, host_index, use_compression) for spec in specs]
  # Host 0 creates every array (its .zarray), as Orbax's primary host does.
  opened = [ts.open(w.json, create=host_index == 0, open=True,
                    assume_metadata=host_index != 0, context=context)
            for w in write_specs]
  writes: list[tuple[Any, int]] = []  # (future of the write, its bytes)
  pending_sums: list[concurrent.futures.Future[ShardChecksum]] = []
  # TensorStore runs on this thread; its chunk files and the checksums on idle-class ones.
  with (concurrent.futures.ThreadPoolExecutor(_WRITERS, "sidecar-ckpt-write",
                                              initializer=_background_thread) as pool,
        concurrent.futures.ThreadPoolExecutor(1, "sidecar-ckpt-crc32c",
                                              initializer=_background_thread) as checksums):
    for leaf, shard in shards:
      if not isinstance(leaf, int) or not 0 <= leaf < len(specs):
        raise errors.InvalidArgumentError(f"shard of leaf {leaf!r}: there are {len(specs)} leaves")
      spec, w = specs[leaf], write_specs[leaf]
      index, data = _resolve(spec, shard)
      path = _chunk_file(w, index, data, use_compression)
      if path is not None:  # The common case: one uncompressed chunk, its bytes as they are.
        write: Any = pool.submit(direct_io.write_file, path, data)
      else:
        store = opened[leaf].result()
        write = store[tuple(slice(a, b) for a, b in index)].write(
            data, can_reference_source_data_indefinitely=True)
      writes.append((write, data.nbytes))
      # The checksum too: those of the first parts then run while the trainer is
      # still copying the rest, not while it trains.
      pending_sums.append(checksums.submit(_checksum, spec, index, data))
    for f in opened:
      f.result()  # .zarray written (host 0), or the spec checked
    for write, nbytes in writes:
      write.result()  # Durable: both paths fsync before they resolve.
      if progress is not None:
        progress(nbytes)
    sums = [f.result() for f in pending_sums]
  array_metas = [w.metadata for w, spec in zip(write_specs, specs)
                 if spec.kind is LeafKind.JAX_ARRAY]
  if array_metas:
    _write_text(item_dir / "array_metadatas" / f"process_{host_index}",
                array_metadata_store.Serializer().serialize(array_metas))
  return sums


def _chunk_file(spec: ts_utils.ArrayWriteSpec, index: Index, data: np.ndarray,
                use_compression: bool) -> pathlib.Path | None:
  """The Zarr v2 chunk file that holds exactly ``data``, if it can be written as is.

  An uncompressed chunk is its array's C-order bytes (little-endian, as on every
  host JAX runs on); a shard that is one whole chunk can go to its file straight
  from the arena. Edge chunks (padded), split shards and compressed ones go
  through TensorStore.
  """
  name = _whole_chunk(index, spec.metadata.chunk_shape)
  if use_compression or data.dtype.byteorder == ">" or name is None:
    return None
  directory = pathlib.Path(spec.json["kvstore"]["path"])
  directory.mkdir(parents=True, exist_ok=True)
  return directory / name


def _whole_chunk(index: Index, chunk: Sequence[int], separator: str = ".") -> str | None:
  """The name of the Zarr v2 chunk file that holds exactly the block ``index``; None
  where the block is not one whole chunk (or is a scalar, which TensorStore keeps)."""
  if (not chunk or len(chunk) != len(index)
      or any(b - a != c or a % c for (a, b), c in zip(index, chunk))):
    return None
  return separator.join(str(a // c) for (a, _), c in zip(index, chunk))


def finalize(tmp_step_dir: os.PathLike | str, leaves: Sequence[LeafSpec], *,
             num_hosts: int, custom_metadata: Mapping[str, Any] | None = None,
             ) -> pathlib.Path:
  """Checks the hosts' parts, writes the tree metadata and commits the step.

  Run once, after every host's :func:`write_host_part` returned. Checks that every
  chunk of every leaf was written before anything becomes visible.

  Args:
    tmp_step_dir: the directory :func:`create_tmp_step` returned.
    leaves: every leaf of the tree, in tree-flattening order.
    num_hosts: how many hosts wrote parts.
    custom_metadata: JSON-serializable, stored in ``_METADATA`` as Orbax's
      ``StandardSave(custom_metadata=...)`` does.

  Returns:
    The committed step directory.

  Raises:
    InvalidArgumentError: a host's part is missing or disagrees with the others.
    FileExistsError: the step was committed meanwhile.
  """
  tmp = pathlib.Path(tmp_step_dir)
  item_dir = _item_dir(tmp, must_be_tmp=True)
  final = tmp.with_name(tmp.name.removesuffix(TMP_SUFFIX))
  finalize_item(item_dir, leaves, num_hosts=num_hosts, custom_metadata=custom_metadata)
  _write_step_metadata(tmp, commit_timestamp_nsecs=time.time_ns())
  _write_text(tmp / COMMIT_SUCCESS_FILE, f"Checkpoint commit was successful to {final}")
  _fsync_dir(tmp)  # Its entries are durable (finalize_item synced the item's) before the rename.
  if final.exists():
    raise FileExistsError(f"step {final.name} was committed meanwhile at {final}")
  os.rename(tmp, final)
  _fsync_dir(final.parent)
  return final


def finalize_item(item_dir: os.PathLike | str, leaves: Sequence[LeafSpec], *, num_hosts: int,
                  custom_metadata: Mapping[str, Any] | None = None) -> None:
  """The item half of :func:`finalize`: check, metadata. No step files, no rename.

  What an Orbax checkpoint handler does for its item; the CheckpointManager then
  commits the step. ``item_dir`` is the item's directory inside the uncommitted step.
  """
  item_dir = pathlib.Path(item_dir).absolute()
  _check_unique(leaves)
  _check_array_metadatas(item_dir, leaves, num_hosts)
  _check_complete(item_dir, leaves)
  shardings = {base64.urlsafe_b64encode(leaf.param_name.encode()).decode(): leaf.sharding
               for leaf in leaves if leaf.sharding is not None}
  if shardings:
    _write_text(item_dir / SHARDING_FILE, json.dumps(shardings, separators=(",", ":")))
  _write_text(item_dir / METADATA_FILE,
              json.dumps(_tree_metadata(leaves, custom_metadata).to_json()))
  _write_text(item_dir / COMMIT_SUCCESS_FILE,
              f"Checkpoint commit was successful to {item_dir}")
  for d in [*(p for p in item_dir.rglob("*") if p.is_dir()), item_dir]:
    _fsync_dir(d)


def read_leaf(step_dir: os.PathLike | str, key_path: KeyPath,
              index: Sequence[slice | tuple[int, int]] | None = None) -> np.ndarray:
  """Reads a leaf, or the block ``index`` of it, from a committed step.

  Works on steps written here and by stock Orbax (OCDBT or not, Zarr v2 or v3,
  any compressor).

  Raises:
    FileNotFoundError: no such step or leaf.
  """
  return read_item_leaf(_item_dir(step_dir, must_be_tmp=False), key_path, index)


def _reader(item_dir: pathlib.Path) -> tuple[dict[str, Any], ts.Context]:
  """A committed item's parsed ``_METADATA``, and one TensorStore context to read its
  leaves with: a restore reads each leaf apart, and a context per leaf would parse
  the metadata and read an OCDBT step's manifest and b-tree again for every one."""
  try:
    stat = (item_dir / METADATA_FILE).stat()
  except FileNotFoundError:
    raise FileNotFoundError(
        f"no checkpoint item at {item_dir} ({METADATA_FILE} is missing)") from None
  # A step deleted and written again (its number reused) has a new _METADATA file.
  return _cached_reader(str(item_dir), (stat.st_ino, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)  # the steps being restored; each caches <= 100 MB of OCDBT nodes
def _cached_reader(item_dir: str, stamp: tuple[int, int, int]
                   ) -> tuple[dict[str, Any], ts.Context]:
  del stamp  # part of the key only
  meta = json.loads((pathlib.Path(item_dir) / METADATA_FILE).read_text())
  return meta, ts_utils.get_ts_context(use_ocdbt=True)


def read_item_leaf(item_dir: os.PathLike | str, key_path: KeyPath,
                   index: Sequence[slice | tuple[int, int]] | None = None) -> np.ndarray:
  """:func:`read_leaf` from an item directory given as such."""
  item_dir = pathlib.Path(item_dir).absolute()
  meta, context = _reader(item_dir)
  name = ".".join(str(k) for k in key_path)
  if str(tuple(str(k) for k in key_path)) not in meta["tree_metadata"]:
    raise FileNotFoundError(f"leaf {name!r} is not in the checkpoint at {item_dir}")
  spec = ts_utils.ArrayReadSpec(
      item_dir.as_posix(), name, use_zarr3=bool(meta.get("use_zarr3")),
      use_ocdbt=bool(meta.get("use_ocdbt")))
  store = ts.open(spec.json, open=True, context=context).result()
  if index is not None:
    store = store[tuple(_as_slice(i) for i in index)]
  return store.read().result()


def read_item_shard(item_dir: os.PathLike | str, key_path: KeyPath, index: Index, *,
                    allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty
                    ) -> np.ndarray:
  """The block ``index`` of a leaf, read from storage into ``allocate(shape, dtype)``.

  A block that is one whole uncompressed chunk file (each shard this module writes,
  and stock Orbax's without OCDBT or compression) is read straight from its file
  into that array (the sidecar passes its arena: no copy after the disk's) with
  ``O_DIRECT``; any other goes through TensorStore, as :func:`read_item_leaf`.

  Raises:
    FileNotFoundError: no such item or leaf.
    errors.CorruptCheckpointError: the chunk file has the wrong size.
  """
  item_dir = pathlib.Path(item_dir).absolute()
  index = tuple((int(a), int(b)) for a, b in index)
  chunk = _stored_chunk(item_dir, key_path, index)
  if chunk is None:
    return read_item_leaf(item_dir, key_path, index)
  path, dtype = chunk
  out = allocate(tuple(b - a for a, b in index), dtype)
  size = path.stat().st_size
  if size != out.nbytes or direct_io.read_file(path, out) != out.nbytes:
    raise errors.CorruptCheckpointError(
        f"{path} holds {size} bytes where the chunk {[list(i) for i in index]} of "
        f"{'.'.join(map(str, key_path))!r} takes {out.nbytes}: the file is corrupt or was "
        "changed after the save")
  return out


def _stored_chunk(item_dir: pathlib.Path, key_path: KeyPath, index: Index
                  ) -> tuple[pathlib.Path, np.dtype] | None:
  """The uncompressed Zarr v2 chunk file that holds exactly ``index``, if there is one.

  Only a step saved without OCDBT has a directory with a ``.zarray`` per leaf.
  """
  name = ".".join(str(k) for k in key_path)
  directory = pathlib.Path(ts_utils.ArrayReadSpec(
      item_dir.as_posix(), name, use_zarr3=False, use_ocdbt=False).json["kvstore"]["path"])
  try:
    zarray = json.loads((directory / ".zarray").read_text())
    dtype = np.dtype(zarray["dtype"])
    codec.dtype_of(dtype.newbyteorder("=").name)
  except (FileNotFoundError, KeyError, TypeError, ValueError, errors.InvalidArgumentError):
    return None
  chunk = _whole_chunk(index, zarray.get("chunks") or (), zarray.get("dimension_separator", "."))
  if (zarray.get("zarr_format") != 2 or zarray.get("compressor") or zarray.get("filters")
      or zarray.get("order") != "C" or dtype.byteorder == ">" or chunk is None):
    return None
  path = directory / chunk
  # A chunk TensorStore never stored (all fill value) has no file: it reads as such.
  return (path, dtype.newbyteorder("=")) if path.is_file() else None


def item_leaves(item_dir: os.PathLike | str) -> list[dict[str, Any]]:
  """Every array leaf of a committed item, ours or stock Orbax's: key path, shape, dtype.

  Read from ``_METADATA`` and each array's TensorStore metadata; no data is read.
  """
  item_dir = pathlib.Path(item_dir).absolute()
  meta, context = _reader(item_dir)
  opened = []  # all at once: each open waits on storage
  for entry in meta["tree_metadata"].values():
    key_path = tuple(int(k["key"]) if k.get("key_type") == 1 else k["key"]
                     for k in entry["key_metadata"])
    spec = ts_utils.ArrayReadSpec(
        item_dir.as_posix(), ".".join(str(k) for k in key_path),
        use_zarr3=bool(meta.get("use_zarr3")), use_ocdbt=bool(meta.get("use_ocdbt")))
    opened.append((key_path, entry, ts.open(spec.json, open=True, context=context)))
  out = []
  for key_path, entry, future in opened:
    store = future.result()
    out.append({"key_path": list(key_path), "shape": list(store.shape),
                "dtype": np.dtype(store.dtype.numpy_dtype).name,
                "kind": entry["value_metadata"]["value_type"]})
  return out


def list_steps(directory: os.PathLike | str) -> list[int]:
  """The committed steps under ``directory``, ascending; tmp directories are skipped."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and p.is_dir())


# --- internals -------------------------------------------------------------------


def _item_dir(step_dir: os.PathLike | str, *, must_be_tmp: bool) -> pathlib.Path:
  step_dir = pathlib.Path(step_dir)
  if must_be_tmp and not step_dir.name.endswith(TMP_SUFFIX):
    raise errors.InvalidArgumentError(
        f"{step_dir} is not an uncommitted step directory (name must end with"
        f" {TMP_SUFFIX!r}); create one with create_tmp_step()")
  if not step_dir.is_absolute():
    step_dir = step_dir.absolute()  # TensorStore needs absolute paths.
  return step_dir / ITEM


def _check_unique(specs: Iterable[LeafSpec]) -> None:
  seen = set()
  for spec in specs:
    if spec.param_name in seen:
      raise errors.InvalidArgumentError(f"leaf {spec.param_name!r} is given twice")
    seen.add(spec.param_name)


def _write_spec(item_dir: pathlib.Path, spec: LeafSpec, host_index: int,
                use_compression: bool) -> ts_utils.ArrayWriteSpec:
  return ts_utils.ArrayWriteSpec(
      item_dir.as_posix(), spec.param_name, global_shape=spec.shape,
      write_shape=spec.write_shape, dtype=spec.dtype, use_ocdbt=False,
      use_zarr3=False, use_compression=use_compression, process_id=host_index)


def _resolve(spec: LeafSpec, shard: Shard) -> tuple[Index, np.ndarray]:
  """Normalizes a shard's index to (start, stop) pairs and checks it fits."""
  if len(shard.index) != len(spec.shape):
    raise errors.InvalidArgumentError(
        f"shard of {spec.param_name!r}: index {shard.index!r} has {len(shard.index)}"
        f" entries for a {len(spec.shape)}-d array")
  pairs = []
  for i, dim in zip(shard.index, spec.shape):
    start, stop, step = (i if isinstance(i, slice) else slice(*i)).indices(dim)
    if step != 1:
      raise errors.InvalidArgumentError(
          f"shard of {spec.param_name!r}: index {shard.index!r} has a stride")
    pairs.append((start, stop))
  index = tuple(pairs)
  data = np.asarray(shard.data)
  expected = tuple(b - a for a, b in index)
  if data.shape != expected or data.dtype != spec.dtype:
    raise errors.InvalidArgumentError(
        f"shard of {spec.param_name!r} at {index}: expected {expected} {spec.dtype},"
        f" got {data.shape} {data.dtype}")
  for (a, b), w, dim in zip(index, spec.write_shape, spec.shape):  # type: ignore[arg-type]
    if a % w or (b != dim and b - a != w):
      raise errors.InvalidArgumentError(
          f"shard of {spec.param_name!r} at {index} is not one block of write_shape"
          f" {spec.write_shape}; hosts must write whole chunks")
  return index, data


def _as_slice(i: slice | tuple[int, int]) -> slice:
  return i if isinstance(i, slice) else slice(*i)


def _check_array_metadatas(item_dir: pathlib.Path, leaves: Sequence[LeafSpec],
                           num_hosts: int) -> None:
  """Checks every host wrote its part and all agree, as Orbax's finalize does."""
  if not any(leaf.kind is LeafKind.JAX_ARRAY for leaf in leaves):
    return
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
  return tuple(_write_spec(item_dir, leaf, 0, False).metadata.chunk_shape)


def _tree_metadata(leaves: Sequence[LeafSpec],
                   custom_metadata: Mapping[str, Any] | None,
                   ) -> tree_metadata.InternalTreeMetadata:
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


def _write_step_metadata(step_dir: pathlib.Path, **timestamps: int) -> None:
  path = checkpoint_metadata.step_metadata_file_path(step_dir)
  fields = {}
  if path.exists():
    fields = json.loads(path.read_text())
  fields = step_metadata_serialization.serialize(checkpoint_metadata.StepMetadata(
      item_handlers={ITEM: _HANDLER_TYPESTR},
      init_timestamp_nsecs=timestamps.get(
          "init_timestamp_nsecs", fields.get("init_timestamp_nsecs")),
      commit_timestamp_nsecs=timestamps.get("commit_timestamp_nsecs")))
  _write_text(pathlib.Path(path), json.dumps(fields))


def _write_text(path: pathlib.Path, text: str) -> None:
  """Writes a small file durably; its directory is synced before the commit."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
