"""The read path: leaves and shards of a committed step, ours or stock Orbax's.

A shard that is one whole uncompressed chunk file is read straight into the caller's
array with ``O_DIRECT``; anything else (OCDBT, Zarr v3, compressed, edge chunks) goes
through TensorStore, with one cached context per step being restored. Where the caller
has the item's manifest (a sidecar wrote it), the leaf's metadata is checked against it
first (``check.py``); TensorStore's errors are said as a corrupt checkpoint's, naming
the file by the item's path.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import pathlib
import stat
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sidecar._src.ckptfmt import direct_io, names
from sidecar._src.ckptfmt.orbax import check, files, items, libs
from sidecar._src.ckptfmt.records import Manifest, SavedLeaf
from sidecar._src.ckptfmt.spec import Index, KeyPath
from sidecar._src.core import dtypes as dtypes_lib, errors

# Orbax and TensorStore are imported once for the process (``libs.load``: a sidecar that
# serves checkpoints at its start); each function imports what it uses after that load.

def read_leaf(step_dir: os.PathLike | str, key_path: KeyPath,
              index: Sequence[slice | tuple[int, int]] | None = None) -> np.ndarray:
  """Reads a leaf, or the block ``index`` of it, from a committed step.

  Works on steps written here and by stock Orbax (OCDBT or not, Zarr v2 or v3,
  any compressor).

  Raises:
    FileNotFoundError: no such step or leaf.
  """
  return read_item_leaf(files.item_dir(step_dir, must_be_tmp=False), key_path, index)


def read_item_leaf(item_dir: os.PathLike | str, key_path: KeyPath,
                   index: Sequence[slice | tuple[int, int]] | None = None) -> np.ndarray:
  """:func:`read_leaf` from an item directory given as such.

  Raises:
    FileNotFoundError: no such item or leaf.
    PermissionDeniedError: the item's files could be changed by someone other than this
      process's user or root (``pinned.py``) and the read is not of an uncompressed Zarr
      v2 array (whose chunks are then read whole, with no-symlink opens, and sliced).
  """
  with items.opened(pathlib.Path(item_dir).absolute()) as item:
    return _read_leaf(item, key_path, index)


def _read_leaf(item: items.Item, key_path: KeyPath,
               index: Sequence[slice | tuple[int, int]] | None) -> np.ndarray:
  libs.load()  # once, for the process: never raced
  import tensorstore as ts
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  name = _leaf_name(item, key_path)
  if item.pinned.untrusted is not None:  # TensorStore would open files by path there
    return _read_beneath(item, name, index)
  # Paths through the item's descriptor: nothing above it can redirect TensorStore, and
  # nobody else can change anything below it (pinned.py).
  spec = ts_utils.ArrayReadSpec(
      item.pinned.proc, name, use_zarr3=bool(item.meta.get("use_zarr3")),
      use_ocdbt=bool(item.meta.get("use_ocdbt")))
  try:
    store = ts.open(spec.json, open=True, context=item.context).result()
    if index is not None:
      store = store[tuple(_as_slice(i) for i in index)]
    return store.read().result()
  except ValueError as e:  # TensorStore's status, as text: a missing chunk file is NOT_FOUND
    said = check.plain(item, str(e))
    if said.startswith("NOT_FOUND"):
      raise FileNotFoundError(f"leaf {name!r} of {item.pinned.path}: {said}") from None
    raise errors.CorruptCheckpointError(
        f"{check.where(item, name)}: TensorStore cannot read the leaf: {said}") from None


def _leaf_name(item: items.Item, key_path: KeyPath) -> str:
  name = ".".join(str(k) for k in key_path)
  names.check_name(name, "leaf", fix="leaf keys are names: no '/' at the start, no "
                   "'.'/'..' component, no NUL")
  if str(tuple(str(k) for k in key_path)) not in item.meta["tree_metadata"]:
    raise FileNotFoundError(f"leaf {name!r} is not in the checkpoint at {item.pinned.path}")
  return name


def read_item_shard(item_dir: os.PathLike | str, key_path: KeyPath, index: Index, *,
                    allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty,
                    leaf: SavedLeaf | None = None) -> np.ndarray:
  """The block ``index`` of a leaf, read from storage into ``allocate(shape, dtype)``.

  A block that is one whole uncompressed chunk file (each shard this module writes,
  and stock Orbax's without OCDBT or compression) is read straight from its file
  into that array (the sidecar passes its arena: no copy after the disk's) with
  ``O_DIRECT``; any other goes through TensorStore, as :func:`read_item_leaf`. With
  ``leaf`` (the manifest's: a sidecar wrote the item), the leaf's ``_METADATA`` entry and
  ``.zarray`` are checked against it first (``check.check_leaf``), and every chunk file
  must be there (a save stores them all).

  Raises:
    FileNotFoundError: no such item or leaf, or a chunk file of it is missing.
    errors.CorruptCheckpointError: the chunk file has the wrong size; with ``leaf``, the
      leaf's metadata differs from it, or a chunk file is missing.
    PermissionDeniedError: as :func:`read_item_leaf`.
  """
  index = tuple((int(a), int(b)) for a, b in index)
  with items.opened(pathlib.Path(item_dir).absolute()) as item:
    if leaf is not None:
      check.check_leaf(item, leaf)
    name = _leaf_name(item, key_path)
    zarray = _zarray(item, name)
    chunk = None if zarray is None else files.whole_chunk(
        index, zarray.chunks, zarray.separator)
    fd = None if chunk is None else _open_chunk(item, f"{name}/{chunk}")
    if fd is None and chunk is not None and leaf is not None:
      raise errors.CorruptCheckpointError(
          f"{check.where(item, f'{name}/{chunk}')} is missing: the chunk file was removed "
          "after the save")
    if fd is None:  # not one whole chunk, or one never stored (all fill value)
      return _read_leaf(item, key_path, index)
    try:
      assert zarray is not None and chunk is not None
      out = allocate(tuple(b - a for a, b in index), zarray.dtype)
      size = os.fstat(fd).st_size
      if size != out.nbytes or direct_io.read_at(fd, out, 0) != out.nbytes:
        raise errors.CorruptCheckpointError(
            f"{check.where(item, f'{name}/{chunk}')} holds {size} bytes where the "
            f"chunk {[list(i) for i in index]} of {name!r} takes {out.nbytes}: the file is "
            "corrupt or was changed after the save")
      return out
    finally:
      os.close(fd)


@dataclasses.dataclass(frozen=True, slots=True)
class _Zarray:
  """An uncompressed, C-order, little-endian Zarr v2 array's ``.zarray``: what a read of
  its chunk files needs."""

  shape: tuple[int, ...]
  chunks: tuple[int, ...]
  dtype: np.dtype
  separator: str
  fill_value: Any


def _zarray(item: items.Item, name: str) -> _Zarray | None:
  """The leaf's ``.zarray``, read beneath the item with no symlink followed, if it is one
  whose chunk files are its bytes as they are; else None. Only a step saved without OCDBT
  has a directory with a ``.zarray`` per leaf."""
  try:
    zarray = json.loads(items.read_small(item.pinned, f"{name}/.zarray"))
    dtype = np.dtype(zarray["dtype"])
    dtypes_lib.dtype_of(dtype.newbyteorder("=").name)
    shape = tuple(int(n) for n in zarray["shape"])
    chunks = tuple(int(n) for n in zarray.get("chunks") or ())
  except (FileNotFoundError, NotADirectoryError, KeyError, TypeError, ValueError,
          errors.InvalidArgumentError, errors.CorruptCheckpointError):
    return None
  separator = zarray.get("dimension_separator", ".")
  if (zarray.get("zarr_format") != 2 or zarray.get("compressor") or zarray.get("filters")
      or zarray.get("order") != "C" or dtype.byteorder == ">" or len(chunks) != len(shape)
      or any(c <= 0 for c in chunks) or separator not in (".", "/")):
    return None
  return _Zarray(shape, chunks, dtype.newbyteorder("="), separator, zarray.get("fill_value"))


def _open_chunk(item: items.Item, name: str) -> int | None:
  """A descriptor of the chunk file ``name`` (a plain file, no symlink followed), or None
  where TensorStore never stored it (all fill value).

  Raises:
    OSError: a symlink on the way (ELOOP), or another error opening it.
    CorruptCheckpointError: it is no plain file.
    PermissionDeniedError: in a tree others can change, a file with more than one link
      (perhaps someone else's file linked in).
  """
  try:
    fd = item.pinned.open(name, os.O_RDONLY | os.O_NONBLOCK)
  except FileNotFoundError:
    return None
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise errors.CorruptCheckpointError(
          f"{os.path.join(item.pinned.path, name)!r:.300} is not a plain file "
          f"({stat.filemode(st.st_mode)})")
    if item.pinned.untrusted is not None and st.st_nlink > 1:
      raise errors.PermissionDeniedError(
          f"{os.path.join(item.pinned.path, name)!r:.300} has {st.st_nlink} links, in a "
          f"checkpoint whose files others can change ({item.pinned.untrusted.describe()}): "
          "it may be another's file linked in; a chunk file a save wrote has one link")
    return fd
  except BaseException:
    os.close(fd)
    raise


def _read_beneath(item: items.Item, name: str,
                  index: Sequence[slice | tuple[int, int]] | None) -> np.ndarray:
  """The block ``index`` of an uncompressed Zarr v2 leaf, its chunk files read whole
  beneath the item (no symlink followed) and sliced; PermissionDeniedError for any other
  kind of array (only TensorStore reads those)."""
  zarray = _zarray(item, name)
  if zarray is None:
    raise item.pinned.refusal(f"the read of leaf {name!r}")
  index = [slice(None)] * len(zarray.shape) if index is None else list(index)
  box = []
  for i, n in zip(index, zarray.shape, strict=False):
    start, stop, step = _as_slice(i).indices(n)
    if step != 1 or len(index) != len(zarray.shape) or (
        not isinstance(i, slice) and not 0 <= i[0] <= i[1] <= n):
      raise errors.InvalidArgumentError(
          f"the block {index!r} does not lie in leaf {name!r} of shape {zarray.shape}")
    box.append((start, max(start, stop)))
  if len(box) != len(zarray.shape):
    raise errors.InvalidArgumentError(
        f"the block {index!r} does not lie in leaf {name!r} of shape {zarray.shape}")
  out = np.empty(tuple(b - a for a, b in box), zarray.dtype)
  chunk_bytes = math.prod(zarray.chunks) * zarray.dtype.itemsize
  grid = [range(a // c, -(-b // c)) for (a, b), c in zip(box, zarray.chunks)]
  for coords in itertools.product(*grid):
    at = [k * c for k, c in zip(coords, zarray.chunks)]
    inner = tuple(slice(max(a, s) - s, min(b, s + c) - s)
                  for (a, b), s, c in zip(box, at, zarray.chunks))
    where = tuple(slice(max(a, s) - a, min(b, s + c) - a)
                  for (a, b), s, c in zip(box, at, zarray.chunks))
    key = zarray.separator.join(map(str, coords)) if coords else "0"
    fd = _open_chunk(item, f"{name}/{key}")
    if fd is None:
      out[where] = _fill(zarray, name)
      continue
    try:
      chunk = np.empty(zarray.chunks, zarray.dtype)
      size = os.fstat(fd).st_size
      if size != chunk_bytes or direct_io.read_at(fd, chunk, 0) != chunk_bytes:
        raise errors.CorruptCheckpointError(
            f"{os.path.join(item.pinned.path, name, key)} holds {size} bytes where a chunk "
            f"of {name!r} takes {chunk_bytes}: the file is corrupt or was changed after the "
            "save")
    finally:
      os.close(fd)
    out[where] = chunk[inner]
  return out


def _fill(zarray: _Zarray, name: str) -> Any:
  """The value of a chunk never stored: Zarr v2's ``fill_value`` (null: zero)."""
  value = zarray.fill_value
  if value is None:
    return 0
  if isinstance(value, (bool, int, float)):
    return value
  if value in ("NaN", "Infinity", "-Infinity") and zarray.dtype.kind in "fc":
    return float(value.replace("Infinity", "inf"))
  raise errors.CorruptCheckpointError(
      f"leaf {name!r}: fill_value {value!r:.100} of its .zarray is not one this read knows")


def _as_slice(i: slice | tuple[int, int]) -> slice:
  return i if isinstance(i, slice) else slice(*i)


def item_leaves(item_dir: os.PathLike | str) -> list[dict[str, Any]]:
  """Every array leaf of a committed item, ours or stock Orbax's: key path, shape, dtype.

  Read from ``_METADATA`` and each array's TensorStore metadata; no data is read.

  Raises:
    PermissionDeniedError: as :func:`read_item_leaf`, for an array TensorStore must open.
  """
  libs.load()  # once, for the process: never raced
  import tensorstore as ts
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  with items.opened(pathlib.Path(item_dir).absolute()) as item:
    leaves = []
    for entry in item.meta["tree_metadata"].values():
      key_path = tuple(int(k["key"]) if k.get("key_type") == 1 else k["key"]
                       for k in entry["key_metadata"])
      leaves.append((key_path, entry, _leaf_name(item, key_path)))
    if item.pinned.untrusted is not None:  # each .zarray read beneath, or refused
      out = []
      for key_path, entry, name in leaves:
        zarray = _zarray(item, name)
        if zarray is None:
          raise item.pinned.refusal(f"the metadata of leaf {name!r}")
        out.append({"key_path": list(key_path), "shape": list(zarray.shape),
                    "dtype": zarray.dtype.name, "kind": entry["value_metadata"]["value_type"]})
      return out
    opened = [(key_path, entry, ts.open(ts_utils.ArrayReadSpec(
        item.pinned.proc, name, use_zarr3=bool(item.meta.get("use_zarr3")),
        use_ocdbt=bool(item.meta.get("use_ocdbt"))).json, open=True, context=item.context))
              for key_path, entry, name in leaves]  # all at once: each open waits on storage
    out = []
    for key_path, entry, future in opened:
      try:
        store = future.result()
      except ValueError as e:  # TensorStore's status, as text
        raise errors.CorruptCheckpointError(
            f"{check.where(item)}: TensorStore cannot open leaf "
            f"{'.'.join(map(str, key_path))!r}: {check.plain(item, str(e))}") from None
      out.append({"key_path": list(key_path), "shape": list(store.shape),
                  "dtype": np.dtype(store.dtype.numpy_dtype).name,
                  "kind": entry["value_metadata"]["value_type"]})
    return out


def check_item(item_dir: os.PathLike | str, manifest: Manifest) -> None:
  """CorruptCheckpointError unless the committed item's metadata and chunk files are
  those ``manifest`` says its save wrote (``check.check_item``); no chunk is read."""
  with items.opened(pathlib.Path(item_dir).absolute()) as item:
    check.check_item(item, manifest)


def manifest_missing(item_dir: os.PathLike | str) -> errors.CorruptCheckpointError | None:
  """The error of an item a sidecar wrote whose manifest is gone; None for one stock
  Orbax wrote (it never had one)."""
  with items.opened(pathlib.Path(item_dir).absolute()) as item:
    return check.manifest_missing(item) if check.written_here(item) else None


def list_steps(directory: os.PathLike | str) -> list[int]:
  """The committed steps under ``directory``, ascending; tmp directories are skipped."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and p.is_dir())
