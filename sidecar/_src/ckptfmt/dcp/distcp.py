"""A checkpoint in ``torch.distributed.checkpoint``'s (DCP's) own layout, written by sidecars.

Stock DCP (``FileSystemWriter``, one file per rank) saves a checkpoint directory::

  <path>/.metadata            DCP's Metadata, pickled: every item, and where it is stored
  <path>/__<rank>_0.distcp    rank r's items, one after the other:
                                a tensor chunk: a whole torch.save archive (archive.py)
                                bytes (non-tensor values): the bytes DCP's planner made

That is the layout written here, so stock ``dcp.load(sd,
storage_reader=FileSystemReader(path))`` restores it with no sidecar running. Each
sidecar writes the files of the ranks beside it (:func:`write_rank_part`) straight from
its arena, and one caller commits (``commit.finalize``) once every rank's file is down:

  <path>.dcp-checkpoint-tmp/    while writing; renamed to <path> to commit (swapped with
                                a committed one there in one step: renameat2's exchange)
    __<rank>_0.distcp ...       fsynced as they are written
    sidecar_manifest.json       each shard's crc32c (what a restore checks)
    .metadata                   written last, then the directory is fsynced and renamed

So a checkpoint is visible only once every rank's part and the metadata are durable;
an attempt that died leaves only a ``*.dcp-checkpoint-tmp`` directory, swept later.

Where each item lies is fixed by the items alone (:func:`layout`): items start on 64
bytes and a tensor's own bytes on 4 KiB, so they go to disk with ``O_DIRECT``, no copy
through the page cache; the trainer computes the same offsets for DCP's ``storage_data``.

**Who pickles.** DCP's ``.metadata`` is a pickle (of ``Metadata``, ``MetadataIndex``,
``_StorageInfo``, torch dtypes...). The sidecar never pickles or unpickles it, and
never imports torch: rank 0's trainer, which has DCP's ``Metadata`` in hand in
``StorageWriter.finish``, pickles it there, in its own process, and the sidecar writes
those bytes as they are (``commit.finalize`` checks only that they begin as a pickle
does). Nothing is unpickled from the network: the trainer that reads ``.metadata``
from storage is doing what stock DCP does with the same file; and for a restore from
the RAM tier (no files read) the trainer gets no pickle at all: the plan travels in our
own typed form (:class:`Item`, :class:`Placement`, JSON in the manifest), and the
trainer rebuilds DCP's ``Metadata`` from it. The bytes items (DCP's own ``torch.save``
of non-tensor values) are opaque to the sidecar too; DCP's load planner turns them back
into values in the trainer, as it does for stock files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import crc32c as crc32c_lib
import numpy as np

from sidecar._src.ckptfmt import direct_io, names, records
from sidecar._src.ckptfmt.dcp import archive
from sidecar._src.ckptfmt.direct_io import background_thread
from sidecar._src.ckptfmt.records import ShardId, ShardRecord, Staged
from sidecar._src.core import errors

METADATA_FILE = ".metadata"
MANIFEST = records.MANIFEST_FILE
TMP_SUFFIX = ".dcp-checkpoint-tmp"
FORMAT = "dcp"
_WRITERS = 4
# A save's id (DCP's ``StorageMeta.save_id``, pickled in ``.metadata`` by the trainer) is
# this and 32 hex digits where a sidecar wrote the checkpoint (``torch/storage.py`` makes
# it); stock DCP's is a plain uuid. So a checkpoint that lost its manifest but keeps the
# one file every DCP reader needs is known as the sidecar's (:func:`written_here`), and is
# not read unchecked.
SAVE_ID_PREFIX = "sidecar-manifest-"
_SAVE_ID = re.compile(re.escape(SAVE_ID_PREFIX.encode()) + rb"[0-9a-f]{32}")
_MAX_METADATA = 1 << 30  # bytes of a .metadata searched for a save id


class ItemKind(enum.StrEnum):
  """What a write item holds, as DCP's ``WriteItemType`` (shards of both tensor kinds)."""
  TENSOR = "tensor"
  BYTES = "bytes"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Item:
  """One write item of a rank: a chunk of a tensor, or the bytes of a non-tensor value.

  Attributes:
    fqn: the state dict key (DCP's flattened name, ``"model.layer.weight"``).
    kind: a tensor chunk or bytes.
    nbytes: the bytes stored: a chunk's C-order bytes, or the blob's length.
    dtype: a tensor's numpy (ml_dtypes) dtype name, ``"float32"``, ``"bfloat16"``.
    sizes: the chunk's shape; ``offsets``: where it starts in the whole tensor.
  """

  fqn: str
  kind: ItemKind
  nbytes: int
  dtype: str = ""
  sizes: tuple[int, ...] = ()
  offsets: tuple[int, ...] = ()

  def __post_init__(self) -> None:
    object.__setattr__(self, "kind", ItemKind(self.kind))
    object.__setattr__(self, "sizes", tuple(int(d) for d in self.sizes))
    object.__setattr__(self, "offsets", tuple(int(d) for d in self.offsets))
    if not isinstance(self.fqn, str) or not self.fqn:
      raise errors.InvalidArgumentError(f"an item's fqn must be a non-empty str, got {self.fqn!r}")
    if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
      raise errors.InvalidArgumentError(
          f"item {self.fqn!r}: nbytes must be an int >= 0, got {self.nbytes!r}")
    if self.kind is ItemKind.TENSOR:
      expected = archive.data_nbytes(self.dtype, self.sizes)
      if len(self.offsets) != len(self.sizes) or self.nbytes != expected:
        raise errors.InvalidArgumentError(
            f"item {self.fqn!r}: a {self.dtype} chunk of sizes {self.sizes} at offsets "
            f"{self.offsets} holds {expected} bytes, got nbytes {self.nbytes}")
    elif self.dtype or self.sizes or self.offsets:
      raise errors.InvalidArgumentError(f"bytes item {self.fqn!r} has no dtype, sizes or offsets")

  @property
  def index(self) -> tuple[tuple[int, int], ...]:
    """The chunk as ``((start, stop), ...)`` per dimension: its RAM-tier key with the fqn."""
    return tuple((o, o + s) for o, s in zip(self.offsets, self.sizes))

  @classmethod
  def of_record(cls, record: ShardRecord) -> Item:
    """The item a staged shard's record describes (:meth:`record`'s inverse): its fqn the
    record's one key, a tensor chunk's sizes its shape and its offsets its index's starts
    (one interval per dimension), a bytes item ``uint8`` of shape ``(nbytes,)`` with no
    index. A DCP Stage carries only the records: the sidecar derives each item here.

    Raises:
      InvalidArgumentError: the record describes no DCP item, naming what does not fit.
    """
    key, index, shape = record.id.key_path, record.id.index, record.shape
    where = f"shard record {list(key)!r:.200} at {[list(i) for i in index]!r:.200}"
    if len(key) != 1 or not isinstance(key[0], str):
      raise errors.InvalidArgumentError(
          f"{where}: a DCP item's record has one key, its fqn (a str)")
    if len(index) == len(shape):  # a tensor chunk (a 0-d tensor's index and shape empty)
      if any(b - a != n for (a, b), n in zip(index, shape)):
        raise errors.InvalidArgumentError(
            f"{where}: a tensor chunk's index spans its shape {list(shape)}")
      return cls(fqn=key[0], kind=ItemKind.TENSOR, nbytes=record.nbytes, dtype=record.dtype,
                 sizes=shape, offsets=tuple(a for a, _ in index))
    if index or record.dtype != "uint8" or shape != (record.nbytes,):
      raise errors.InvalidArgumentError(
          f"{where}: {record.dtype or 'no dtype'} {list(shape)} is neither a tensor chunk (one "
          "interval per dimension) nor a bytes item (uint8 of its bytes, no index)")
    return cls(fqn=key[0], kind=ItemKind.BYTES, nbytes=record.nbytes)

  def record(self, number: int, rank: int, data: Any, *, host: int | None = None
             ) -> ShardRecord:
    """This item's record as rank ``rank`` stages it (``number``: its place in the rank's
    items), ``data`` its bytes: keyed as the RAM tier keys it, ``((fqn,), index)``."""
    return ShardRecord.of(ShardId((self.fqn,), self.index), number, data, host=host, rank=rank)

  def to_dict(self) -> dict[str, Any]:
    return {"fqn": self.fqn, "kind": str(self.kind), "nbytes": self.nbytes, "dtype": self.dtype,
            "sizes": list(self.sizes), "offsets": list(self.offsets)}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Item:
    try:
      return cls(fqn=d["fqn"], kind=d["kind"], nbytes=d["nbytes"], dtype=d.get("dtype", ""),
                 sizes=tuple(d.get("sizes", ())), offsets=tuple(d.get("offsets", ())))
    except (KeyError, TypeError, ValueError) as e:
      if isinstance(e, errors.SidecarError):
        raise
      raise errors.InvalidArgumentError(f"malformed DCP item {dict(d)!r:.200}: {e}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
  """Where an item lies: DCP's ``_StorageInfo`` (file, offset, length of what is stored:
  a tensor's whole archive, or a blob) and where its own bytes start in that file
  (``data_offset``)."""

  relative_path: str
  offset: int
  length: int
  data_offset: int


def file_name(rank: int) -> str:
  """Rank ``rank``'s file, as DCP's ``FileSystemWriter`` names it (one file per rank)."""
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise errors.InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
  return f"__{rank}_0.distcp"


def layout(rank: int, items: Sequence[Item]) -> tuple[list[Placement], int]:
  """Where each of rank ``rank``'s items goes in its file, and the file's size.

  Items follow one another in the order given, each on 64 bytes; a tensor's bytes
  start on 4 KiB where there are at least that many. The same items always give the
  same layout: the sidecar writes it, the trainer records it in DCP's metadata.
  """
  name, at, out = file_name(rank), 0, []
  for item in items:
    placed = place(name, item, at)
    out.append(placed)
    at = placed.offset + placed.length
  return out, at


def place(name: str, item: Item, at: int) -> Placement:
  """Where ``item`` goes in the file ``name`` after the one before it, which ends at ``at``."""
  at += -at % archive.SMALL_ALIGN
  if item.kind is ItemKind.TENSOR:
    length = archive.archive_length(item.dtype, item.sizes, at=at)
  else:
    length = item.nbytes
  return Placement(name, at, length, data_offset(item, at))


def data_offset(item: Item, at: int) -> int:
  """Where the bytes of ``item`` start in its file, where it starts at ``at``."""
  if item.kind is ItemKind.TENSOR:
    return at + len(archive.header(item.dtype, item.sizes, at=at))
  return at


def _as_bytes(item: Item, data: np.ndarray) -> np.ndarray:
  data = np.asarray(data)
  if data.nbytes != item.nbytes:
    raise errors.InvalidArgumentError(
        f"item {item.fqn!r} at {item.offsets}: expected {item.nbytes} bytes, got "
        f"{data.nbytes} ({data.shape} {data.dtype})")
  if item.kind is ItemKind.TENSOR and data.dtype.name != item.dtype:
    raise errors.InvalidArgumentError(
        f"item {item.fqn!r}: expected dtype {item.dtype}, got {data.dtype.name}")
  return data


def write_rank_part(directory: os.PathLike | str, rank: int, count: int,
                    shards: Iterable[Staged], *,
                    progress: Callable[[int], None] | None = None,
                    turn: direct_io.Turn = direct_io.no_turn) -> list[ShardRecord]:
  """Writes rank ``rank``'s file of ``count`` items into the uncommitted checkpoint
  ``directory``, durably.

  ``shards`` yields every item exactly once, in any order, as staged: its record (the
  item's one description, :meth:`Item.of_record`; its ``leaf`` the item's number) with
  its bytes beside it. It may be a generator that waits for parts still being staged.
  An item is placed in the file once the records of the items before it have come (in
  the order the trainer stages them, at once); its write and checksum then start, on
  idle-class threads. The arrays must not change until this returns (they are written
  without a copy). ``progress(nbytes)`` is called as each item is written; its bytes are
  written in ``turn``s (the storage's bandwidth, shared among a pool's tenants).

  Returns:
    Every item's record, written (its crc32c set), in the order of the rank's items.
  """
  directory = pathlib.Path(directory)
  if not directory.name.endswith(TMP_SUFFIX):
    raise errors.InvalidArgumentError(
        f"{directory} is not an uncommitted DCP checkpoint (its name must end with "
        f"{TMP_SUFFIX!r}); make one with commit.create_tmp()")
  path = directory / file_name(rank)
  # Opened beneath the directory's descriptor, no symlink followed (names.py).
  fd = names.open_beneath(directory, path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  try:
    return _write_items(path, fd, rank, count, shards, progress=progress, turn=turn)
  finally:
    os.close(fd)


def _write_items(path: pathlib.Path, fd: int, rank: int, count: int, shards: Iterable[Staged],
                 *, progress: Callable[[int], None] | None, turn: direct_io.Turn
                 ) -> list[ShardRecord]:
  """:func:`write_rank_part`'s work, ``fd`` the rank's file."""
  items: dict[int, Item] = {}
  waiting: dict[int, np.ndarray] = {}  # staged before an earlier item's record came
  placed: list[Placement] = []
  sums: dict[int, concurrent.futures.Future[ShardRecord]] = {}
  writes: list[concurrent.futures.Future[int]] = []
  with (concurrent.futures.ThreadPoolExecutor(_WRITERS, "sidecar-dcp-write",
                                              initializer=background_thread) as pool,
        concurrent.futures.ThreadPoolExecutor(1, "sidecar-dcp-crc32c",
                                              initializer=background_thread) as checksums):
    for shard in shards:
      number = shard.record.leaf
      if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < count:
        raise errors.InvalidArgumentError(f"item number {number!r}: rank {rank} has {count} items")
      if number in sums:
        raise errors.InvalidArgumentError(
            f"item {items[number].fqn!r} of rank {rank} came twice")
      items[number] = item = Item.of_record(shard.record)
      waiting[number] = _as_bytes(item, shard.data)
      sums[number] = checksums.submit(shard.record.with_crc32c_of, waiting[number])
      start = len(placed)
      while len(placed) in items:  # the items now placed in the file
        placed.append(place(path.name, items[len(placed)], _end(placed)))
      if len(placed) > start:
        # The file grows to hold them first: a direct write inside the file goes at once,
        # beside the others; one past its end would extend it, one at a time.
        os.ftruncate(fd, _end(placed))
      for i in range(start, len(placed)):  # their writes start
        writes.append(pool.submit(_write_item, path, items[i], placed[i], waiting.pop(i), turn))
    missing = [i for i in range(count) if i not in items]
    if missing:
      raise errors.InvalidArgumentError(
          f"rank {rank}'s part is missing items number {missing[:8]}"
          f"{'...' * (len(missing) > 8)} of its {count}")
    for w in writes:
      nbytes = w.result()
      if progress is not None:
        progress(nbytes)
    os.fsync(fd)
    return [sums[i].result() for i in range(count)]


def _end(placed: Sequence[Placement]) -> int:
  """Where the last of ``placed`` ends in its file (0: none placed)."""
  return placed[-1].offset + placed[-1].length if placed else 0


def _write_item(path: pathlib.Path, item: Item, where: Placement, data: np.ndarray,
                  turn: direct_io.Turn = direct_io.no_turn) -> int:
  # Its own descriptor (write_at sets O_DIRECT on it), beneath the directory, no symlink.
  fd = names.open_beneath(path.parent, path.name, os.O_WRONLY)
  try:
    if item.kind is ItemKind.TENSOR:
      os.pwrite(fd, archive.header(item.dtype, item.sizes, at=where.offset), where.offset)
      trailer = archive.trailer(item.dtype, item.sizes, at=where.offset)
      os.pwrite(fd, trailer, where.data_offset + item.nbytes)
    direct_io.write_at(fd, data, where.data_offset, turn)
  finally:
    os.close(fd)
  return item.nbytes


# ---- read ------------------------------------------------------------------------------

def is_checkpoint(path: os.PathLike | str) -> bool:
  """Whether ``path`` is a committed DCP checkpoint (it has a ``.metadata``)."""
  return (pathlib.Path(path) / METADATA_FILE).is_file()


def written_here(path: os.PathLike | str) -> bool:
  """Whether a sidecar wrote the committed checkpoint at ``path``: its ``.metadata`` holds a
  save id a sidecar's trainer made (:data:`SAVE_ID_PREFIX`), found in the pickle's bytes
  (never unpickled here).

  Raises:
    OSError: ``.metadata`` cannot be read.
  """
  fd = names.open_beneath(path, METADATA_FILE, os.O_RDONLY | os.O_NONBLOCK,
                          field="the checkpoint's .metadata")
  try:
    with os.fdopen(os.dup(fd), "rb") as f:
      return _SAVE_ID.search(f.read(_MAX_METADATA)) is not None
  finally:
    os.close(fd)


def metadata_crc32c(path: os.PathLike | str) -> int:
  """The crc32c of the committed checkpoint's ``.metadata`` (what its manifest records).

  Raises:
    OSError: it cannot be read.
  """
  fd = names.open_beneath(path, METADATA_FILE, os.O_RDONLY | os.O_NONBLOCK,
                          field="the checkpoint's .metadata")
  try:
    with os.fdopen(os.dup(fd), "rb") as f:
      return crc32c_lib.crc32c(f.read())
  finally:
    os.close(fd)


def read_item(path: os.PathLike | str, where: Placement, out: np.ndarray) -> None:
  """Reads an item's own bytes (a tensor chunk's C-order bytes, or a blob) from the
  committed checkpoint at ``path`` into ``out`` (C-contiguous, its size), direct from disk
  where aligned. Only for checkpoints written here: stock DCP's archives may hold views.

  Raises:
    CorruptCheckpointError: the file is shorter than the item.
    OSError: the file cannot be read.
  """
  # The plan's file is a name (the wire checked it, and so does this): opened beneath the
  # checkpoint's directory, no symlink followed, never a path the plan chose.
  fd = names.open_beneath(path, where.relative_path, os.O_RDONLY, field="the item's file")
  try:
    got = direct_io.read_at(fd, out, where.data_offset)
  finally:
    os.close(fd)
  if got != out.nbytes:
    raise errors.CorruptCheckpointError(
        f"{pathlib.Path(path) / where.relative_path} holds {got} of the {out.nbytes} bytes at "
        f"offset {where.data_offset}: the file is truncated")

