"""A checkpoint in ``torch.distributed.checkpoint``'s (DCP's) own layout, written by sidecars.

Stock DCP (``FileSystemWriter``, one file per rank) saves a checkpoint directory::

  <path>/.metadata            DCP's Metadata, pickled: every item, and where it is stored
  <path>/__<rank>_0.distcp    rank r's items, one after the other:
                                a tensor chunk: a whole torch.save archive (archive.py)
                                bytes (non-tensor values): the bytes DCP's planner made

That is the layout written here, so stock ``dcp.load(sd,
storage_reader=FileSystemReader(path))`` restores it with no sidecar running. Each
sidecar writes the files of the ranks beside it (:func:`write_rank_part`) straight from
its arena, and one caller commits (:func:`finalize`) once every rank's file is down:

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
those bytes as they are (:func:`finalize` checks only that they begin as a pickle
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
import contextlib
import dataclasses
import enum
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import crc32c as crc32c_lib
import numpy as np

from sidecar._src.ckptfmt import dir_fd, direct_io, names, records
from sidecar._src.ckptfmt.dcp import archive
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.ckptfmt.direct_io import background_thread
from sidecar._src.ckptfmt.records import ShardId, ShardRecord, Staged
from sidecar._src.core import errors

METADATA_FILE = ".metadata"
MANIFEST = records.MANIFEST_FILE
TMP_SUFFIX = ".dcp-checkpoint-tmp"
OLD_SUFFIX = ".dcp-checkpoint-old"  # a replaced checkpoint, until its removal
MADE_FILE = ".sidecar-made"  # in an uncommitted directory: a save made it (gone once committed)
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
        f"{TMP_SUFFIX!r}); make one with create_tmp()")
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


# ---- commit ----------------------------------------------------------------------------

def tmp_path(path: os.PathLike | str) -> pathlib.Path:
  """Where the checkpoint at ``path`` is written before its commit."""
  path = pathlib.Path(path)
  return path.with_name(path.name + TMP_SUFFIX)


def create_tmp(path: os.PathLike | str, *, at: DirFd | None = None) -> pathlib.Path:
  """Makes the uncommitted directory of the checkpoint at ``path`` (a leftover of an
  attempt that never committed is removed first, if a save made it: :func:`is_ours`) and
  returns it, marked as made by a save (:data:`MADE_FILE`). ``at``: the directory ``path``
  lies in, opened (made here where missing, if None): every look, removal and rename is
  relative to it.

  Raises:
    PermissionDeniedError: something a save did not make is where the directory goes.
  """
  path = pathlib.Path(path)
  tmp = tmp_path(path)
  with dir_fd.held(at, path.parent, make=True) as d:
    recover(path, at=d)  # a complete copy first, where an overwrite was cut short
    remove_ours(tmp, at=d)
    try:
      d.mkdir(tmp.name)
    except FileExistsError as e:
      raise FileExistsError(e.errno, e.strerror, str(tmp)) from None
    with d.child(tmp.name) as made:
      fd = os.open(MADE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                   | os.O_CLOEXEC, 0o644, dir_fd=made.fd)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
  return tmp


def is_ours(path: os.PathLike | str, *, at: DirFd | None = None) -> bool:
  """Whether ``path`` is a directory a save made: an uncommitted one (:data:`MADE_FILE`
  in it) or a checkpoint written here (our manifest and DCP's ``.metadata``); never a
  symlink. ``at``: the directory ``path`` lies in, opened."""
  path = pathlib.Path(path)
  try:
    with dir_fd.held(at, path.parent) as d, _opened_child(d, path.name) as c:
      return c is not None and _made_by_a_save(c)
  except FileNotFoundError:
    return False  # (its directory gone: nothing there)


def _made_by_a_save(c: DirFd) -> bool:
  """:func:`is_ours` of the directory ``c``, opened."""
  return c.is_file(MADE_FILE) or (c.is_file(METADATA_FILE) and c.is_file(MANIFEST))


def remove_ours(path: os.PathLike | str, *, at: DirFd | None = None) -> None:
  """Removes the directory ``path`` (a save's ``-tmp`` or ``-old`` sibling) if a save made
  it (:func:`is_ours`); nothing there is fine; anything else is left as it is and refused
  (PermissionDeniedError): a sidecar removes only what it made. ``at``: the directory
  ``path`` lies in, opened; what is removed is the directory found there before the check
  (``DirFd.remove``'s ``expect``), never one swapped in since."""
  path = pathlib.Path(path)
  with dir_fd.held(at, path.parent) as d:
    seen = d.lstat(path.name)
    if not is_ours(path, at=d):
      if d.lstat(path.name) is None:
        return  # nothing there, or removed since the look (another host's abort or open)
      raise errors.PermissionDeniedError(
          f"{path} is in the way of a DCP save and was not made by one (no {MADE_FILE} nor "
          f"{MANIFEST} in it); it is left as it is: move it away, or save the checkpoint "
          "under another name")
    if seen is not None:
      d.remove(path.name, expect=(seen.st_dev, seen.st_ino))


@contextlib.contextmanager
def _opened_child(d: DirFd, name: str) -> Iterator[DirFd | None]:
  """The directory ``name`` in ``d`` opened (no symlink followed), or None where nothing
  is there or it is no directory (a file, a symlink)."""
  try:
    c = d.child(name)
  except (FileNotFoundError, NotADirectoryError, errors.PermissionDeniedError):
    yield None
    return
  with c:
    yield c


def old_path(path: os.PathLike | str) -> pathlib.Path:
  """Where a replaced checkpoint waits for its removal (only where the file system has
  no atomic exchange: :func:`finalize`)."""
  path = pathlib.Path(path)
  return path.with_name(path.name + OLD_SUFFIX)


def recover(path: os.PathLike | str, *, at: DirFd | None = None) -> bool:
  """Puts the replaced copy back at ``path`` if an overwrite was cut short between its two
  renames (nothing at ``path``, a complete copy at :func:`old_path`); whether it did.
  Another process that put it back first (another host's open of the same directory)
  leaves nothing to do here. ``at``: the directory ``path`` lies in, opened."""
  path, old = pathlib.Path(path), old_path(path)
  with dir_fd.held(at, path.parent) as d:
    if d.lstat(path.name) is not None or not _is_checkpoint_in(d, old.name):
      return False
    try:
      d.rename(old.name, path.name)
    except (FileNotFoundError, FileExistsError):
      return False  # put back (or the path made) by another process since the check
    d.fsync()
  return True


def _is_checkpoint_in(d: DirFd, name: str) -> bool:
  """Whether the directory ``name`` in ``d`` (no symlink) is a committed DCP checkpoint."""
  with _opened_child(d, name) as c:
    return c is not None and c.is_file(METADATA_FILE)


def _exchange(d: DirFd, a: str, b: str) -> bool:
  """Swaps the directories ``a`` and ``b`` of ``d`` in one step (``DirFd.exchange``);
  False where the system or the file system has no such swap."""
  return d.exchange(a, b)


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


def finalize(tmp: os.PathLike | str, *, metadata: bytes, file_sizes: Mapping[int, int],
             manifest: records.Manifest | None = None, replace: bool = True,
             swapping: Callable[[], None] | None = None,
             at: DirFd | None = None) -> pathlib.Path:
  """Commits the checkpoint written into ``tmp``: checks every rank's file, writes the
  manifest and ``.metadata`` (the bytes rank 0's trainer pickled), fsyncs, renames.

  Args:
    tmp: the directory :func:`create_tmp` returned.
    metadata: DCP's ``Metadata``, pickled by the trainer; written as it is.
    file_sizes: every rank's file size (:func:`layout`), by rank.
    manifest: our manifest of the checkpoint (its plan, checksums), written as its JSON.
    replace: a committed checkpoint already at the path is replaced (as DCP's
      ``overwrite=True``): it stays whole until the rename and is removed after;
      False: FileExistsError.
    at: the directory ``tmp`` lies in, opened: every look, rename and removal of the
      commit is relative to it (None: opened here).

  Returns:
    The committed checkpoint directory.

  Raises:
    InvalidArgumentError: a rank's file is missing or of the wrong size, or
      ``metadata`` is not a pickle.
    FileExistsError: something other than a committed checkpoint is at the path, or
      one is and ``replace`` is False.
  """
  tmp = pathlib.Path(tmp)
  if not tmp.name.endswith(TMP_SUFFIX):
    raise errors.InvalidArgumentError(f"{tmp} is not an uncommitted DCP checkpoint (*{TMP_SUFFIX})")
  final = tmp.with_name(tmp.name.removesuffix(TMP_SUFFIX))
  if not isinstance(metadata, bytes) or not metadata.startswith(b"\x80"):
    raise errors.InvalidArgumentError(
        "metadata must be DCP's Metadata as pickle bytes (rank 0's trainer pickles it), got "
        f"{type(metadata).__name__} {bytes(metadata[:8]) if isinstance(metadata, bytes) else ''!r}")
  for rank, size in sorted(file_sizes.items()):
    path = tmp / file_name(rank)
    got = path.stat().st_size if path.is_file() else None
    if got != size:
      raise errors.InvalidArgumentError(
          f"checkpoint at {final} is incomplete: rank {rank}'s {path.name} is "
          + ("missing" if got is None else f"{got} bytes, expected {size}")
          + "; every rank's part must be written before the commit")
  if manifest is not None:
    direct_io.write_small(tmp / MANIFEST, manifest.to_json().encode())
  direct_io.write_small(tmp / METADATA_FILE, metadata)
  direct_io.fsync_dir(tmp)
  with dir_fd.held(at, tmp.parent) as d:
    return _swap_in(d, tmp, final, replace=replace, swapping=swapping)


def _swap_in(d: DirFd, tmp: pathlib.Path, final: pathlib.Path, *, replace: bool,
             swapping: Callable[[], None] | None) -> pathlib.Path:
  """:func:`finalize`'s renames, in the directory ``d`` both lie in."""
  recover(final, at=d)
  old = None
  if d.lstat(final.name) is not None:
    if not _is_checkpoint_in(d, final.name):
      raise FileExistsError(f"{final} exists and is not a DCP checkpoint; not replacing it")
    if not replace:
      raise FileExistsError(f"a checkpoint is already committed at {final}")
    stale = old_path(final)  # a stale copy (``final`` is whole), or what a save made
    if _is_checkpoint_in(d, stale.name):
      d.rmtree(stale.name)
    else:
      remove_ours(stale, at=d)
    if _exchange(d, tmp.name, final.name):  # one step: the path always holds a whole one
      if swapping is not None:
        swapping()
      d.fsync()
      d.rmtree(tmp.name)  # the replaced copy, now at the tmp name
      _committed(d, final.name)
      return final
    # No atomic swap here: two renames, and recover() puts the old copy back if this
    # process dies between them (the next open or save of the path calls it).
    old = old_path(final)
    d.rename(final.name, old.name)
    if swapping is not None:
      swapping()
  d.rename(tmp.name, final.name)
  d.fsync()
  _committed(d, final.name)
  if old is not None:
    d.rmtree(old.name)
  return final


def _committed(d: DirFd, name: str) -> None:
  """The committed checkpoint ``name`` in ``d`` is no longer a save's own: its
  :data:`MADE_FILE` goes."""
  with _opened_child(d, name) as c:
    if c is not None:
      c.unlink(MADE_FILE)


# ---- read ------------------------------------------------------------------------------

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

