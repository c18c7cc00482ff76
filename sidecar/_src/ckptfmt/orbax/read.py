"""The read path: leaves and shards of a committed step, ours or stock Orbax's.

A shard that is one whole uncompressed chunk file is read straight into the caller's
array with ``O_DIRECT``; anything else (OCDBT, Zarr v3, compressed, edge chunks) goes
through TensorStore, with one cached context per step being restored.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sidecar._src.ckptfmt import direct_io, names
from sidecar._src.ckptfmt.orbax import files
from sidecar._src.ckptfmt.spec import METADATA_FILE, Index, KeyPath
from sidecar._src.core import dtypes as dtypes_lib, errors

# Orbax and TensorStore load with the first checkpoint that needs them (a sidecar starts
# without them): each function imports what it uses.
if TYPE_CHECKING:
  import tensorstore as ts


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
  """:func:`read_leaf` from an item directory given as such."""
  import tensorstore as ts
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  item_dir = pathlib.Path(item_dir).absolute()
  meta, context = _reader(item_dir)
  name = ".".join(str(k) for k in key_path)
  files.leaf_dir(item_dir, name)  # a name, beneath the item: TensorStore opens it by path
  if str(tuple(str(k) for k in key_path)) not in meta["tree_metadata"]:
    raise FileNotFoundError(f"leaf {name!r} is not in the checkpoint at {item_dir}")
  spec = ts_utils.ArrayReadSpec(
      item_dir.as_posix(), name, use_zarr3=bool(meta.get("use_zarr3")),
      use_ocdbt=bool(meta.get("use_ocdbt")))
  names.check_store_files(spec.json, f"leaf {name!r}")  # TensorStore follows symlinks
  try:
    store = ts.open(spec.json, open=True, context=context).result()
    if index is not None:
      store = store[tuple(_as_slice(i) for i in index)]
    return store.read().result()
  except ValueError as e:  # TensorStore's status, as text: a missing chunk file is NOT_FOUND
    if str(e).startswith("NOT_FOUND"):
      raise FileNotFoundError(f"leaf {name!r} of {item_dir}: {e}") from None
    raise


def read_item_shard(item_dir: os.PathLike | str, key_path: KeyPath, index: Index, *,
                    allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty
                    ) -> np.ndarray:
  """The block ``index`` of a leaf, read from storage into ``allocate(shape, dtype)``.

  A block that is one whole uncompressed chunk file (each shard this module writes,
  and stock Orbax's without OCDBT or compression) is read straight from its file
  into that array (the sidecar passes its arena: no copy after the disk's) with
  ``O_DIRECT``; any other goes through TensorStore, as :func:`read_item_leaf`.

  Raises:
    FileNotFoundError: no such item or leaf, or a chunk file of it is missing.
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
  # Opened beneath the item's directory, no symlink followed (names.py).
  if size != out.nbytes or direct_io.read_file(
      path.relative_to(item_dir), out, beneath=item_dir) != out.nbytes:
    raise errors.CorruptCheckpointError(
        f"{path} holds {size} bytes where the chunk {[list(i) for i in index]} of "
        f"{'.'.join(map(str, key_path))!r} takes {out.nbytes}: the file is corrupt or was "
        "changed after the save")
  return out


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
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  meta = json.loads((pathlib.Path(item_dir) / METADATA_FILE).read_text())
  return meta, ts_utils.get_ts_context(use_ocdbt=True)


def _stored_chunk(item_dir: pathlib.Path, key_path: KeyPath, index: Index
                  ) -> tuple[pathlib.Path, np.dtype] | None:
  """The uncompressed Zarr v2 chunk file that holds exactly ``index``, if there is one.

  Only a step saved without OCDBT has a directory with a ``.zarray`` per leaf.
  """
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  name = ".".join(str(k) for k in key_path)
  files.leaf_dir(item_dir, name)  # a name, beneath the item (TensorStore opens it too)
  directory = pathlib.Path(ts_utils.ArrayReadSpec(
      item_dir.as_posix(), name, use_zarr3=False, use_ocdbt=False).json["kvstore"]["path"])
  try:
    zarray = json.loads((directory / ".zarray").read_text())
    dtype = np.dtype(zarray["dtype"])
    dtypes_lib.dtype_of(dtype.newbyteorder("=").name)
  except (FileNotFoundError, KeyError, TypeError, ValueError, errors.InvalidArgumentError):
    return None
  chunk = files.whole_chunk(index, zarray.get("chunks") or (),
                            zarray.get("dimension_separator", "."))
  if (zarray.get("zarr_format") != 2 or zarray.get("compressor") or zarray.get("filters")
      or zarray.get("order") != "C" or dtype.byteorder == ">" or chunk is None):
    return None
  path = directory / chunk
  # A chunk TensorStore never stored (all fill value) has no file: it reads as such.
  return (path, dtype.newbyteorder("=")) if path.is_file() else None


def _as_slice(i: slice | tuple[int, int]) -> slice:
  return i if isinstance(i, slice) else slice(*i)


def item_leaves(item_dir: os.PathLike | str) -> list[dict[str, Any]]:
  """Every array leaf of a committed item, ours or stock Orbax's: key path, shape, dtype.

  Read from ``_METADATA`` and each array's TensorStore metadata; no data is read.
  """
  import tensorstore as ts
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  item_dir = pathlib.Path(item_dir).absolute()
  meta, context = _reader(item_dir)
  opened = []  # all at once: each open waits on storage
  for entry in meta["tree_metadata"].values():
    key_path = tuple(int(k["key"]) if k.get("key_type") == 1 else k["key"]
                     for k in entry["key_metadata"])
    spec = ts_utils.ArrayReadSpec(
        item_dir.as_posix(), ".".join(str(k) for k in key_path),
        use_zarr3=bool(meta.get("use_zarr3")), use_ocdbt=bool(meta.get("use_ocdbt")))
    names.check_store_files(spec.json, f"leaf {key_path!r}")  # TensorStore follows symlinks
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
