"""The write engine: one host's shards into a step's chunk files, off the training step.

Whole uncompressed chunks go from the arena straight to their files with ``O_DIRECT``
(:mod:`direct_io`) on a few idle-class (``SCHED_IDLE``) threads; edge chunks, split
shards and compressed ones go through TensorStore. Each shard's crc32c is taken as it
arrives, on an idle-class thread too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sidecar._src.ckptfmt import direct_io, pinned as pinned_lib
from sidecar._src.ckptfmt.direct_io import background_thread
from sidecar._src.ckptfmt.orbax import files, libs
from sidecar._src.ckptfmt.records import ShardId, ShardRecord, Staged
from sidecar._src.ckptfmt.spec import Index, LeafKind, LeafSpec
from sidecar._src.core import errors

# Orbax and TensorStore are imported once for the process (``libs.load``: a sidecar that
# serves checkpoints at its start); each function imports what it uses after that load.
if TYPE_CHECKING:
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

_WRITERS = 4  # chunk files written at once: enough to overlap one file's fsync with the next


def write_host_part(tmp_step_dir: os.PathLike | str, host_index: int,
                    specs: Sequence[LeafSpec], shards: Iterable[Staged], *,
                    use_compression: bool = False) -> list[ShardRecord]:
  """Writes this host's shards into the step's chunk files.

  Every host passes every leaf of the tree (``specs``) and the shards it owns
  (replicated shards on exactly one host), each record numbering its leaf in ``specs``;
  host 0 also writes each array's ``.zarray``, as Orbax's primary host does. The shard
  arrays must not change until this returns: they are written without a copy.

  Returns:
    Every shard's record, written (its crc32c set), in the order given.
  """
  return write_item_part(files.item_dir(tmp_step_dir, must_be_tmp=True), host_index, specs,
                         shards, use_compression=use_compression)


def write_item_part(item_dir: os.PathLike | str, host_index: int, specs: Sequence[LeafSpec],
                    shards: Iterable[Staged], *, use_compression: bool = False,
                    progress: Callable[[int], None] | None = None,
                    turn: direct_io.Turn = direct_io.no_turn) -> list[ShardRecord]:
  """:func:`write_host_part` into an item directory given as such (an Orbax handler's).

  ``specs`` are every leaf of the tree; ``shards`` yields this host's shards as the
  sidecar staged them (:class:`Staged`: each record's ``leaf`` a number in ``specs``,
  its bytes beside it). It may be a generator that waits for shards still being staged:
  each one's write and checksum start as it arrives.
  ``progress(nbytes)`` is called as each shard becomes durable. Its bytes are written in
  ``turn``s (the storage's bandwidth, shared among a pool's tenants).
  """
  libs.load()  # once, for the process: never raced
  import tensorstore as ts
  from orbax.checkpoint._src.metadata import array_metadata_store
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  if isinstance(host_index, bool) or not isinstance(host_index, int) or host_index < 0:
    raise errors.InvalidArgumentError(f"host_index must be an int >= 0, got {host_index!r}")
  files.check_unique(specs)
  # Made here, held by its descriptor: TensorStore writes through /proc/self/fd/N, which
  # no rename above it redirects, into a tree nobody else can change (pinned.py).
  with pinned_lib.pin(item_dir, make=True) as item:
    if item.untrusted is not None:
      raise item.refusal(f"the save into {item.path!r:.300}")
    context = ts_utils.get_ts_context(use_ocdbt=False)
    through = pathlib.Path(item.proc)
    write_specs = [files.write_spec(through, spec, host_index, use_compression)
                   for spec in specs]
    # Host 0 creates every array (its .zarray), as Orbax's primary host does.
    opened = [ts.open(w.json, create=host_index == 0, open=True,
                      assume_metadata=host_index != 0, context=context)
              for w in write_specs]
    try:
      sums = _write_shards(item, specs, write_specs, opened, shards, use_compression,
                           progress, turn)
    except BaseException:
      # The opens create .zarray files on TensorStore's threads: let them end before the
      # descriptor closes and the caller removes the directory of a failed or aborted
      # save (a file landing after the removal would leave the directory behind). Their
      # own failures add nothing.
      for f in opened:
        with contextlib.suppress(Exception):
          f.result()
      raise
    array_metas = [w.metadata for w, spec in zip(write_specs, specs)
                   if spec.kind is LeafKind.JAX_ARRAY]
    if array_metas:
      files.write_text_beneath(item, f"array_metadatas/process_{host_index}",
                               array_metadata_store.Serializer().serialize(array_metas))
  return sums


def _write_shards(item: pinned_lib.Pinned, specs: Sequence[LeafSpec], write_specs: Sequence[Any],
                  opened: Sequence[Any], shards: Iterable[Staged], use_compression: bool,
                  progress: Callable[[int], None] | None,
                  turn: direct_io.Turn) -> list[ShardRecord]:
  """Writes each shard as it comes; returns their records, written, once all are durable."""
  writes: list[tuple[Any, int]] = []  # (future of the write, its bytes)
  pending_sums: list[concurrent.futures.Future[ShardRecord]] = []
  # TensorStore runs on this thread; its chunk files and the checksums on idle-class ones.
  with (concurrent.futures.ThreadPoolExecutor(_WRITERS, "sidecar-ckpt-write",
                                              initializer=background_thread) as pool,
        concurrent.futures.ThreadPoolExecutor(1, "sidecar-ckpt-crc32c",
                                              initializer=background_thread) as checksums):
    try:
      for shard in shards:
        leaf = shard.record.leaf
        if not isinstance(leaf, int) or not 0 <= leaf < len(specs):
          raise errors.InvalidArgumentError(
              f"shard of leaf {leaf!r}: there are {len(specs)} leaves")
        spec, w = specs[leaf], write_specs[leaf]
        shard = _resolve(spec, shard)
        index, data = shard.record.id.index, shard.data
        name = _chunk_file(item.proc, w, index, data, use_compression)
        if name is not None:  # The common case: one uncompressed chunk, its bytes as they are.
          write: Any = pool.submit(functools.partial(direct_io.write_file, beneath=item),
                                   name, data, turn)
        else:
          store = opened[leaf].result()
          target = store[tuple(slice(a, b) for a, b in index)]
          if turn is direct_io.no_turn:  # TensorStore's own threads, as many as it likes
            write = target.write(data, can_reference_source_data_indefinitely=True)
          else:  # one of the pool's, in a turn
            write = pool.submit(_write_through, target, data, turn)
        writes.append((write, data.nbytes))
        # The checksum too: those of the first parts then run while the trainer is
        # still copying the rest, not while it trains.
        pending_sums.append(checksums.submit(shard.record.with_crc32c_of, data))
      for f in opened:
        f.result()  # .zarray written (host 0), or the spec checked
      for write, nbytes in writes:
        write.result()  # Durable: both paths fsync before they resolve.
        if progress is not None:
          progress(nbytes)
    except BaseException:
      # TensorStore's writes go through the item's descriptor: none may still run once it
      # closes (its number may then name another directory).
      for write, _ in writes:
        with contextlib.suppress(Exception):
          write.result()
      raise
    return [f.result() for f in pending_sums]


def _write_through(target: Any, data: np.ndarray, turn: direct_io.Turn) -> None:
  """TensorStore's write of ``data`` into ``target`` (a slice of an opened array), durable,
  in one turn."""
  with turn(data.nbytes):
    target.write(data, can_reference_source_data_indefinitely=True).result()




def _resolve(spec: LeafSpec, shard: Staged) -> Staged:
  """The shard, its index normalized to (start, stop) pairs and its data an array, checked
  to fit its leaf: the same record where it was normalized already."""
  given = shard.record.id.index
  if len(given) != len(spec.shape):
    raise errors.InvalidArgumentError(
        f"shard of {spec.param_name!r}: index {given!r} has {len(given)}"
        f" entries for a {len(spec.shape)}-d array")
  pairs = []
  for i, dim in zip(given, spec.shape):
    start, stop, step = (i if isinstance(i, slice) else slice(*i)).indices(dim)
    if step != 1:
      raise errors.InvalidArgumentError(
          f"shard of {spec.param_name!r}: index {given!r} has a stride")
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
  record = shard.record
  if index != record.id.index:
    record = dataclasses.replace(record, id=ShardId(record.id.key_path, index))
  if record is shard.record and data is shard.data:
    return shard
  return Staged(record, data, shard.ref)


def _chunk_file(item_dir: str, spec: ts_utils.ArrayWriteSpec, index: Index,
                data: np.ndarray, use_compression: bool) -> str | None:
  """The Zarr v2 chunk file that holds exactly ``data``, if it can be written as is: its
  name in ``item_dir`` (opened beneath it, ``names.open_beneath``).

  An uncompressed chunk is its array's C-order bytes (little-endian, as on every
  host JAX runs on); a shard that is one whole chunk can go to its file straight
  from the arena. Edge chunks (padded), split shards and compressed ones go
  through TensorStore.
  """
  name = files.whole_chunk(index, spec.metadata.chunk_shape)
  if use_compression or data.dtype.byteorder == ">" or name is None:
    return None
  return f"{os.path.relpath(spec.json['kvstore']['path'], item_dir)}/{name}"
