"""DCP's layout (``torch.distributed.checkpoint``) as a
:class:`~sidecar._src.ckptfmt.format.Format`.

A DCP step goes through the same sequence as an Orbax one; what differs is here. Each
trainer rank beside a sidecar stages its own part (:class:`~.parts.DcpPart`: its rank and
item count; each item is its shard's record, ``distcp.Item.of_record``), and each rank's
file is written by its own thread (:func:`write_ranks`, ``distcp.write_rank_part``) as the
rank's shards arrive. The RAM
tier keys a tensor chunk as ``((fqn,), ((start, stop), ...))`` and a bytes item as
``((fqn,), ())``, so restores and replicas treat them as any shard. A read from storage
(:meth:`DcpFormat.read`) finds the item's bytes through the plan in the manifest (plain
JSON values the trainer made); the sidecar never unpickles DCP's ``.metadata`` and never
imports torch, Orbax, TensorStore or JAX.
"""

from __future__ import annotations

import functools
import os
import pathlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import crc32c as crc32c_lib
import numpy as np

from sidecar._src.ckptfmt import dir_fd, names, records
from sidecar._src.ckptfmt.dcp import archive, commit as dcp_commit, distcp
from sidecar._src.ckptfmt.dcp.parts import DcpCommit, DcpPart
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.ckptfmt.format import Allocate, Format, Numbering, Turn, Uncommitted
from sidecar._src.ckptfmt.records import Manifest, ShardRecord, Staged
from sidecar._src.ckptfmt.save_values import Commit
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import dtypes as dtypes_lib, errors

_END = object()
METADATA_CRC32C = "metadata_crc32c"  # the manifest's extra: the crc32c of .metadata
# The ranks one step may stage into one sidecar: the trainer processes beside it (8 on a
# GPU node). Each rank's file is written by a thread of its own (:func:`write_ranks`), so
# a client naming a new rank in each part must not start a thread each (issue 76).
MAX_RANKS = 64


class ItemNumbering(Numbering):
  """A staged shard's number is its item's, in its rank's items: its record is the item's
  one description (``distcp.Item.of_record``), naming the part's rank; each part of a rank
  says how many items it has (``DcpPart.item_count``)."""

  def __init__(self) -> None:
    self.counts: dict[int, int] = {}  # items, by rank

  def take(self, extra: Any, shards: Sequence[Staged]) -> list[Staged]:
    if not isinstance(extra, DcpPart):
      raise errors.InvalidArgumentError(
          f"a Stage of a DCP step carries its rank's part (dcp), got {type(extra).__name__}")
    if extra.rank not in self.counts and len(self.counts) >= MAX_RANKS:
      raise errors.InvalidArgumentError(
          f"dcp.rank {extra.rank}: this step has the parts of {len(self.counts)} ranks on this "
          f"sidecar already, the most one step may (MAX_RANKS = {MAX_RANKS}: the trainer "
          "processes beside one sidecar); stage each rank's part on its own host's sidecar")
    count = self.counts.get(extra.rank, extra.item_count)
    if extra.item_count != count:
      raise errors.InvalidArgumentError(
          f"dcp.item_count: rank {extra.rank} has {count} items (its first part said so), "
          f"this part says {extra.item_count}")
    for s in shards:
      r = s.record
      if r.rank != extra.rank or not 0 <= r.leaf < count:
        raise errors.InvalidArgumentError(
            f"shard of item {r.leaf} names {list(r.id.key_path)} of rank {r.rank}: rank "
            f"{extra.rank}'s part has items 0 to {count - 1}")
      distcp.Item.of_record(r)  # a record that describes no DCP item is refused at its Stage
    self.counts.setdefault(extra.rank, count)
    return list(shards)


class DcpFormat(Format):
  """DCP's layout; see the module's docstring."""

  name: ClassVar[str] = distcp.FORMAT
  tmp_suffix: ClassVar[str] = distcp.TMP_SUFFIX
  markers: ClassVar[tuple[str, ...]] = (records.MANIFEST_FILE, distcp.METADATA_FILE)
  overwrites: ClassVar[bool] = True  # as DCP's: the path is the checkpoint's, not a step's
  stage_extra: ClassVar[type | None] = DcpPart
  commit_extra: ClassVar[type | None] = DcpCommit
  title: ClassVar[str] = "a PyTorch DCP checkpoint"
  readers: ClassVar[str] = "sidecar.torch.Checkpointer or torch.distributed.checkpoint.load"

  def create_tmp(self, directory: str, step: int, *, at: DirFd | None = None
                 ) -> pathlib.Path:
    del step  # ``directory`` is the checkpoint's own path
    return dcp_commit.create_tmp(directory, at=at)

  def tmp_of(self, directory: str, step: int) -> str:
    del step
    return str(dcp_commit.tmp_path(directory))

  def final_of(self, path: pathlib.Path) -> Uncommitted | None:
    if not path.name.endswith(distcp.TMP_SUFFIX):
      return None
    final = path.with_name(path.name.removesuffix(distcp.TMP_SUFFIX))
    return Uncommitted(path, final, final)

  def sweep(self, directory: pathlib.Path, *, at: DirFd | None = None) -> list[pathlib.Path]:
    with dir_fd.held(at, directory) as d:
      for name in d.names():
        if name.endswith(dcp_commit.OLD_SUFFIX):
          dcp_commit.recover(directory / name.removesuffix(dcp_commit.OLD_SUFFIX), at=d)
      # Only what a save made is swept (STYLE 27): anything else of that name stays.
      return [tmp for tmp in super().sweep(directory, at=d) if dcp_commit.is_ours(tmp, at=d)]

  def scratch_suffixes(self) -> tuple[str, ...]:
    return (distcp.TMP_SUFFIX, dcp_commit.OLD_SUFFIX)

  def made_here(self, tmp: pathlib.Path, *, at: DirFd | None = None) -> bool:
    # Ours, or nothing there: never made, or removed since the look by another host's
    # abort (whose removal is one step: the directory renamed away, then its files).
    try:
      with dir_fd.held(at, tmp.parent) as d:
        return dcp_commit.is_ours(tmp, at=d) or d.lstat(tmp.name) is None
    except FileNotFoundError:
      return True  # its directory is gone: nothing there

  def is_checkpoint(self, path: pathlib.Path) -> bool:
    return distcp.is_checkpoint(path)

  def misread(self, final_dir: pathlib.Path) -> tuple[pathlib.Path, list[str]] | None:
    """An item asked for inside a DCP step (an Orbax reader's ``<step>/default``). A step
    another host's retention removes while this looks is not one (no error)."""
    step = final_dir.parent
    if final_dir.exists() or not distcp.is_checkpoint(step):
      return None
    try:
      with os.scandir(step) as entries:
        files = sorted(e.name for e in entries if e.name.endswith(".distcp"))
    except (FileNotFoundError, NotADirectoryError):
      return None  # removed (or replaced) since its check: nothing there to misread
    return step, [distcp.METADATA_FILE, *files[:2], *(["..."] if len(files) > 2 else [])]

  def numbering(self, leaves: Sequence[LeafSpec]) -> ItemNumbering:
    del leaves  # a DCP step has items, by rank
    return ItemNumbering()

  def write(self, tmp_dir: str, host_id: int, numbering: Numbering, incoming: Iterator[Any],
            *, progress: Callable[[int], None], turn: Turn) -> list[ShardRecord]:
    assert isinstance(numbering, ItemNumbering)
    del host_id  # each record names its host (the one that staged it: this one)
    return write_ranks(tmp_dir, numbering.counts, incoming, progress=progress, turn=turn)

  def manifest_extras(self, extra: Any) -> Mapping[str, Any]:
    """The plan (where each item lies), and the crc32c of the ``.metadata`` the commit
    writes: a stock reader's one file, checked against it (:meth:`check_stored`)."""
    extra = _commit_extra(extra)
    return {"plan": extra.plan(), METADATA_CRC32C: crc32c_lib.crc32c(extra.metadata)}

  def commit(self, commit: Commit, manifest: Manifest, *, swapping: Callable[[], None],
             at: DirFd | None = None) -> str:
    """Writes the manifest and DCP's ``.metadata`` (as the trainer pickled it), renames
    (swapping in one step with a committed checkpoint at the path). Every rank's file
    size is checked, not ``commit``'s leaves and host count."""
    tmp_dir = commit.tmp_dir
    if not tmp_dir.endswith(distcp.TMP_SUFFIX):
      raise errors.InvalidArgumentError(
          f"tmp_dir {tmp_dir!r:.200} is not an uncommitted DCP step directory "
          f"(*{distcp.TMP_SUFFIX})")
    extra = _commit_extra(commit.extra)
    return str(dcp_commit.finalize(tmp_dir, metadata=extra.metadata, file_sizes=extra.file_sizes,
                               manifest=manifest, swapping=swapping, at=at))

  def check_stored(self, final_dir: str, manifest: Manifest) -> None:
    """The ``.metadata`` against the crc32c the manifest records (a manifest of an earlier
    release records none), and every rank's file long enough for the items the plan
    puts in it."""
    path = pathlib.Path(final_dir)
    expected = manifest.extras.get(METADATA_CRC32C)
    try:
      if expected is not None and distcp.metadata_crc32c(path) != expected:
        raise _changed(path, distcp.METADATA_FILE, "does not match the crc32c its save wrote")
    except FileNotFoundError:
      raise _changed(path, distcp.METADATA_FILE, "is missing") from None
    ends: dict[str, int] = {}
    for s in (manifest.dcp_plan or {}).get("storage", ()):
      ends[s["path"]] = max(ends.get(s["path"], 0), int(s["at"]) + int(s["length"]))
    for name, end in sorted(ends.items()):
      try:
        fd = names.open_beneath(path, name, os.O_RDONLY | os.O_NONBLOCK, field="a rank's file")
      except FileNotFoundError:
        raise _changed(path, name, "is missing") from None
      try:
        size = os.fstat(fd).st_size
      finally:
        os.close(fd)
      if size < end:
        raise _changed(path, name, f"holds {size} bytes, where its items end at byte {end}")

  def stock_manifest(self, final_dir: str) -> Manifest:
    """A checkpoint stock DCP wrote has no manifest: a stock one, without a plan (the
    trainer reads it with DCP's own reader, unchecked, and says so). One a sidecar wrote
    (its ``.metadata`` holds a sidecar's save id) has lost its checksums:
    CorruptCheckpointError."""
    try:
      ours = distcp.written_here(final_dir)
    except FileNotFoundError:
      raise errors.InvalidArgumentError(
          f"{final_dir} is not a committed checkpoint: it has no {records.MANIFEST_FILE} "
          f"nor {distcp.METADATA_FILE}") from None
    if ours:
      raise errors.CorruptCheckpointError(
          f"{final_dir}: its {records.MANIFEST_FILE} is missing, but its "
          f"{distcp.METADATA_FILE} says a sidecar wrote it (save id "
          f"{distcp.SAVE_ID_PREFIX}...): its checksums are gone with it, so it is not "
          "restored unchecked. Restore an older step (restore(..., fallback=True) skips it), "
          "or put the manifest back; stock DCP's FileSystemReader reads it unchecked")
    return Manifest(self.name, [], [], extras={records.STOCK: True})

  def read(self, final_dir: str, record: ShardRecord, *, allocate: Allocate,
           manifest: Manifest | None) -> np.ndarray:
    """The stored bytes of one item of a committed DCP step (its place from the plan in
    the manifest, whose own crc32c was checked)."""
    del manifest  # the plan is read with the file's stamp as its key (``_index``)
    path = pathlib.Path(final_dir)
    try:
      found = _index(str(path), (path / records.MANIFEST_FILE).stat().st_mtime)
    except errors.CorruptCheckpointError:
      raise
    except (OSError, KeyError, StopIteration, ValueError, TypeError) as e:
      raise errors.InvalidArgumentError(f"cannot read {final_dir}: its manifest: {e}") from None
    key, index = record.key_path, record.index
    entry = found.get((str(key[0]) if key else "", tuple(a for a, _ in index)))
    if entry is None or len(key) != 1:
      raise errors.InvalidArgumentError(
          f"{final_dir} has no item {list(key)} at {[list(i) for i in index]}")
    item, where = entry
    if item.kind is distcp.ItemKind.BYTES:
      out = allocate((item.nbytes,), np.dtype(np.uint8))
    else:
      out = allocate(item.sizes, dtypes_lib.dtype_of(item.dtype, f"item {item.fqn!r}"))
    distcp.read_item(path, where, out)
    return out


def _changed(path: pathlib.Path, name: str, what: str) -> errors.CorruptCheckpointError:
  return errors.CorruptCheckpointError(
      f"{path.parent}: {path.name}/{name} {what} ({records.MANIFEST_FILE}): the file was "
      "changed after the save")


def _commit_extra(extra: Any) -> DcpCommit:
  if not isinstance(extra, DcpCommit):
    raise errors.InvalidArgumentError(
        "a DCP step's commit carries its metadata, file sizes and plan (dcp), got "
        f"{type(extra).__name__}")
  return extra


@functools.lru_cache(maxsize=16)
def _index(final_dir: str, mtime: float
           ) -> dict[tuple[str, tuple[int, ...]], tuple[distcp.Item, distcp.Placement]]:
  """Every item of a committed DCP step by ``(fqn, chunk offsets)``: the item, its place."""
  del mtime  # in the key only: a rewritten step is read again
  path = pathlib.Path(final_dir) / records.MANIFEST_FILE
  plan = Manifest.from_json(path.read_bytes(), final_dir).extras["plan"]
  out = {}
  for s in plan["storage"]:
    entry = plan["state"][s["fqn"]]
    offsets = tuple(s["offset"] or ())
    if entry["kind"] == "bytes":
      item = distcp.Item(fqn=s["fqn"], kind=distcp.ItemKind.BYTES, nbytes=s["length"])
    else:
      sizes = next(c["sizes"] for c in entry["chunks"] if tuple(c["offsets"]) == offsets)
      item = distcp.Item(fqn=s["fqn"], kind=distcp.ItemKind.TENSOR, dtype=entry["dtype"],
                         sizes=sizes, offsets=offsets,
                         nbytes=archive.data_nbytes(entry["dtype"], sizes))
    out[(s["fqn"], offsets)] = (item, distcp.Placement(
        s["path"], s["at"], s["length"], distcp.data_offset(item, s["at"])))
  return out


def write_ranks(tmp: str, counts: Mapping[int, int], incoming: Iterator[Staged], *,
                progress: Callable[[int], None], turn: Turn) -> list[ShardRecord]:
  """Writes the file of every rank that stages into this host, each on its own thread.

  ``counts`` maps each rank to its item count (filled in as the ranks' first parts arrive,
  before their shards); ``incoming`` yields each staged shard (its record's ``rank``, its
  ``leaf`` the item's number) until the step is staged whole. Returns every item's
  record, written, as the manifest lists them.
  """
  queues: dict[int, queue.SimpleQueue] = {}
  threads: dict[int, threading.Thread] = {}
  results: dict[int, list] = {}
  failures: dict[int, BaseException] = {}

  def run(rank: int) -> None:
    ended = False

    def datas() -> Iterator[Staged]:
      nonlocal ended
      while (got := queues[rank].get()) is not _END:
        yield got
      ended = True
    try:
      results[rank] = distcp.write_rank_part(tmp, rank, counts[rank], datas(), progress=progress,
                                             turn=turn)
    except BaseException as e:
      failures[rank] = e
      # Let the router go on (the error is kept), unless the end marker is consumed
      # already: a write that fails after its last item would wait here for good.
      while not ended and queues[rank].get() is not _END:
        pass

  def start(rank: int) -> None:
    queues[rank] = queue.SimpleQueue()
    threads[rank] = threading.Thread(target=run, args=(rank,), daemon=True,
                                     name=f"sidecar-dcp-rank-{rank}")
    threads[rank].start()

  try:
    for s in incoming:
      rank = s.record.rank
      assert rank is not None  # ItemNumbering checked every shard names its rank
      if rank not in threads:
        start(rank)
      queues[rank].put(s)
    for rank in counts:  # a rank whose items never came: its write names what is missing
      if rank not in threads and counts[rank]:
        start(rank)
  finally:
    for q in queues.values():
      q.put(_END)
    for t in threads.values():
      t.join()
  if failures:
    raise failures[min(failures)]
  return [c for rank in sorted(results) for c in results[rank]]
