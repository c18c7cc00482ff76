"""A committed item's metadata checked against the manifest its sidecar wrote.

A restore reads an item through its metadata: ``_METADATA`` (which leaves there are,
whether the arrays are Zarr v3 or OCDBT) and each leaf's ``.zarray`` (dtype, shape, chunk
shape, fill value, order, compressor). A chunk file's crc32c says nothing of those: a
``.zarray`` whose dtype was changed from ``<f4`` to ``<i4`` reads the same bytes as other
numbers, with the same checksum. So where a sidecar wrote the item (its manifest beside
it), every one of them is compared with what the manifest says the save wrote before a
byte is read: a leaf's ``_METADATA`` entry and ``.zarray`` at each read of one of its
shards (:func:`check_leaf`), and the whole item, every chunk file's presence and size
included, when a restore asks for its manifest (:func:`check_item`).

What the save wrote is known exactly: the sidecar writes uncompressed Zarr v2 without
OCDBT, every chunk stored, through Orbax's own write spec (``files.write_spec``), so the
``.zarray`` of a leaf of dtype D, shape S and write shape W is TensorStore's for that
spec. An item stock Orbax wrote has no manifest, and is read as it is (with a warning
in the trainer that nothing can be checked). Every error names the file, relative to the
step, and what differs.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import stat
from collections.abc import Iterable
from typing import Any

import numpy as np

from sidecar._src.ckptfmt.orbax import files, items
from sidecar._src.ckptfmt.records import MANIFEST_FILE, Manifest, SavedLeaf, ShardRecord
from sidecar._src.ckptfmt.spec import METADATA_FILE
from sidecar._src.core import dtypes as dtypes_lib, errors

_SEQUENCE = 1  # Orbax's KeyType.SEQUENCE in a _METADATA key entry (DICT is 2)
_ABSENT = object()


def written_here(item: items.Item) -> bool:
  """Whether a sidecar's commit wrote the item (its ``_METADATA`` names the manifest)."""
  return isinstance(item.meta, dict) and item.meta.get(files.MANIFEST_KEY) is not None


def where(item: items.Item, name: str = "") -> str:
  """``name`` (a file of the item) as a message names it: the step's directory, then the
  path in it (``/ck/5: default/w/.zarray``)."""
  path = pathlib.Path(item.pinned.path)
  return f"{path.parent}: {path.name}/{name}" if name else f"{path.parent}: {path.name}"


def plain(item: items.Item, text: str) -> str:
  """``text`` (a TensorStore error, say) with the item's ``/proc/self/fd/N`` path said as
  the item's own: a descriptor number means nothing to whoever reads it."""
  return text.replace(item.pinned.proc, str(item.pinned.path))


def _changed(item: items.Item, name: str, what: str) -> errors.CorruptCheckpointError:
  """``what`` says what the file says and what the save wrote (its manifest's word)."""
  return errors.CorruptCheckpointError(
      f"{where(item, name)} {what} ({MANIFEST_FILE}): the file was changed after the save, "
      "and would restore other values")


def check_item(item: items.Item, manifest: Manifest) -> None:
  """CorruptCheckpointError unless the item's metadata and chunk files are those the
  manifest says its save wrote (see the module); no chunk's bytes are read."""
  _check_tree(item, manifest.leaves)
  leaves = {leaf.key_path: leaf for leaf in manifest.leaves}
  by_leaf: dict[Any, list[ShardRecord]] = {}
  for shard in manifest.shards:
    by_leaf.setdefault(shard.key_path, []).append(shard)
  for key_path, shards in by_leaf.items():
    leaf = leaves.get(key_path)
    if leaf is None:
      raise errors.CorruptCheckpointError(
          f"{where(item, MANIFEST_FILE)} lists shards of {_name(key_path)!r}, which is none "
          "of its leaves: the file was changed after the save")
    name = _name(key_path)
    chunks = check_zarray(item, name, leaf)
    _check_chunk_files(item, name, leaf, chunks, shards)


def check_leaf(item: items.Item, leaf: SavedLeaf) -> None:
  """CorruptCheckpointError unless the leaf's ``_METADATA`` entry and ``.zarray`` are those
  its save wrote (``leaf``: the manifest's)."""
  _check_entry(item, leaf, _tree(item).get(_tree_key(leaf.key_path), _ABSENT))
  check_zarray(item, _name(leaf.key_path), leaf)


def _tree(item: items.Item) -> dict[str, Any]:
  """The ``_METADATA``'s tree of leaves, its flags checked (Zarr v2, no OCDBT)."""
  if not isinstance(item.meta, dict) or not isinstance(item.meta.get("tree_metadata"), dict):
    raise _changed(item, METADATA_FILE, "has no tree of leaves where the save wrote one")
  _check_flags(item)
  return item.meta["tree_metadata"]


def _check_tree(item: items.Item, leaves: Iterable[SavedLeaf]) -> None:
  tree = _tree(item)
  wanted = {_tree_key(leaf.key_path): leaf for leaf in leaves}
  extra = sorted(set(tree) - set(wanted))
  if extra:
    raise _changed(item, METADATA_FILE, f"names leaves {extra[:4]} the save did not have")
  for key, leaf in wanted.items():
    _check_entry(item, leaf, tree.get(key, _ABSENT))


def _check_flags(item: items.Item) -> None:
  for flag in ("use_ocdbt", "use_zarr3"):
    if item.meta.get(flag):
      raise _changed(item, METADATA_FILE, f"says {flag}: {item.meta[flag]!r} where the save "
                     "wrote Zarr v2 without OCDBT")


def _check_entry(item: items.Item, leaf: SavedLeaf, entry: Any) -> None:
  """A leaf's ``_METADATA`` entry: there, naming the leaf's key path, of its kind."""
  name = _name(leaf.key_path)
  if entry is _ABSENT:
    raise _changed(item, METADATA_FILE, f"has no leaf {name!r} where the save wrote one")
  try:
    keys = tuple(int(k["key"]) if k.get("key_type") == _SEQUENCE else k["key"]
                 for k in entry["key_metadata"])
    value = entry["value_metadata"]
    kind = value.get("value_type")
    write_shape = value.get("write_shape")
  except (KeyError, TypeError, ValueError, AttributeError):
    raise _changed(item, METADATA_FILE, f"has an entry for {name!r} that is not Orbax's "
                   "(key_metadata, value_metadata) where the save wrote one") from None
  if keys != tuple(leaf.key_path):
    raise _changed(item, METADATA_FILE, f"names leaf {name!r} by the key path {list(keys)} "
                   f"where the save wrote {list(leaf.key_path)}")
  if leaf.kind and kind != leaf.kind:
    raise _changed(item, METADATA_FILE, f"says leaf {name!r} is a {kind!r} where the save "
                   f"wrote a {leaf.kind!r}")
  if write_shape is not None and leaf.write_shape and tuple(write_shape) != leaf.write_shape:
    raise _changed(item, METADATA_FILE, f"says leaf {name!r} was written in blocks of "
                   f"{list(write_shape)} where the save wrote {list(leaf.write_shape)}")


def expected_zarray(leaf: SavedLeaf) -> dict[str, Any]:
  """The ``.zarray`` a sidecar's save writes for ``leaf`` (its dtype aside: the spelling
  is TensorStore's, ``<f4``, compared as a dtype). Its chunk shape is Orbax's for the
  leaf's write shape (shards over 2 GiB are split); where the manifest has no write shape
  (a manifest of an early release), the chunk shape is not compared."""
  out: dict[str, Any] = {"zarr_format": 2, "shape": list(leaf.shape), "compressor": None,
                         "filters": None, "order": "C", "fill_value": None,
                         "dimension_separator": "."}
  if leaf.write_shape or not leaf.shape:
    out["chunks"] = list(files.chunk_shape(leaf.shape, leaf.write_shape or leaf.shape,
                                           dtypes_lib.dtype_of(leaf.dtype)))
  return out


def check_zarray(item: items.Item, name: str, leaf: SavedLeaf) -> tuple[int, ...]:
  """CorruptCheckpointError unless the ``.zarray`` of leaf ``name`` is the one its save
  wrote (:func:`expected_zarray`); its chunk shape."""
  rel = f"{name}/.zarray"
  try:
    found = json.loads(items.read_small(item.pinned, rel))
  except (FileNotFoundError, NotADirectoryError):
    raise errors.CorruptCheckpointError(
        f"{where(item, rel)} is missing: the leaf's metadata was removed after the save"
    ) from None
  except ValueError as e:
    raise _changed(item, rel, f"is not JSON ({e}) where the save wrote Zarr's") from None
  if not isinstance(found, dict):
    raise _changed(item, rel, "is not a JSON object where the save wrote Zarr's")
  expected = expected_zarray(leaf)
  unchecked = {"dtype"} | ({"chunks"} - set(expected))
  for key in sorted((set(found) | set(expected)) - unchecked):
    have, want = found.get(key, _ABSENT), expected.get(key, _ABSENT)
    if have == want:
      continue
    if have is _ABSENT:
      raise _changed(item, rel, f"has no {key} where the save wrote {json.dumps(want)}")
    raise _changed(item, rel, f"says {key}: {json.dumps(have)!s:.100} where the save wrote "
                   + ("none" if want is _ABSENT else json.dumps(want)))
  _check_dtype(item, rel, found.get("dtype"), leaf)
  return tuple(found.get("chunks") or ())


def _check_dtype(item: items.Item, rel: str, found: Any, leaf: SavedLeaf) -> None:
  try:
    have = np.dtype(found)
  except (TypeError, ValueError):
    have = None
  want = dtypes_lib.dtype_of(leaf.dtype, _name(leaf.key_path))
  if have is None or have.byteorder == ">" or have.newbyteorder("=") != want:
    shown = have.name if have is not None and have.byteorder != ">" else repr(found)
    raise _changed(item, rel, f"says dtype {shown} ({found!r:.40}) where the save wrote "
                   f"{want.name}")


def _check_chunk_files(item: items.Item, name: str, leaf: SavedLeaf,
                       chunks: tuple[int, ...], shards: Iterable[ShardRecord]) -> None:
  """Every chunk file of the leaf's shards is there, a plain file of a whole chunk's bytes
  (uncompressed Zarr v2 stores edge chunks whole too)."""
  itemsize = dtypes_lib.dtype_of(leaf.dtype).itemsize
  nbytes = math.prod(chunks) * itemsize
  keys: set[str] = set()
  for shard in shards:
    grid = [range(a // c, -(-b // c)) for (a, b), c in zip(shard.index, chunks)]
    keys.update(".".join(map(str, coords)) if coords else "0"
                for coords in itertools.product(*grid))
  for key in sorted(keys):
    rel = f"{name}/{key}"
    try:
      fd = item.pinned.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
      raise errors.CorruptCheckpointError(
          f"{where(item, rel)} is missing: the chunk file was removed after the save"
      ) from None
    try:
      st = os.fstat(fd)
    finally:
      os.close(fd)
    if not stat.S_ISREG(st.st_mode):
      raise errors.CorruptCheckpointError(
          f"{where(item, rel)} is not a plain file ({stat.filemode(st.st_mode)}) where the "
          "save wrote a chunk file")
    if st.st_size != nbytes:
      raise errors.CorruptCheckpointError(
          f"{where(item, rel)} holds {st.st_size} bytes where a chunk of {name!r} takes "
          f"{nbytes}: the file is corrupt or was changed after the save")


def manifest_missing(item: items.Item) -> errors.CorruptCheckpointError:
  """The error of an item a sidecar wrote whose manifest is gone: not read unchecked."""
  return errors.CorruptCheckpointError(
      f"{where(item, MANIFEST_FILE)} is missing, but the item's {METADATA_FILE} says a "
      f"sidecar wrote it ({files.MANIFEST_KEY!r}): its checksums are gone with it, so it is "
      "not restored unchecked. Restore an older step (restore(..., fallback=True) skips "
      "it), or put the manifest back; stock orbax.checkpoint reads the step unchecked")


def _name(key_path: Any) -> str:
  return ".".join(str(k) for k in key_path)


def _tree_key(key_path: Any) -> str:
  return str(tuple(str(k) for k in key_path))

