"""The sidecar's half of a checkpoint in DCP's layout: write each rank's file, read items back.

A DCP step goes through the same phases as an Orbax one (``save.py``); what differs is
here. Each trainer rank beside this sidecar stages its own part (``DcpPart``: its items,
in the order of its file), and each rank's file is written by its own thread
(:func:`write_ranks`, ``ckptfmt/dcp.write_rank_part``) as the rank's shards arrive. The
RAM tier keys a tensor chunk as ``((fqn,), ((start, stop), ...))`` and a bytes item as
``((fqn,), ())``, so restores and peer replicas treat them as any shard. A read from
storage (:func:`read_item`) finds the item's bytes through the plan in the manifest
(plain JSON values the trainer made); this sidecar never unpickles DCP's ``.metadata``
and never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from sidecar._src.ckptfmt import dcp, dcp_record
from sidecar._src.ckptfmt.shards import ShardChecksum
from sidecar._src.core import dtypes, errors
from sidecar._src.server.checkpoint import faults
from sidecar._src.server.checkpoint.roots import MANIFEST

FORMAT = dcp.FORMAT
_END = object()


def items_from_dicts(items: list[dict[str, Any]]) -> list[dcp.Item]:
  return [dcp.Item.from_dict(d) for d in items]


def write_ranks(tmp: str, items: Mapping[int, list[dcp.Item]],
                incoming: Iterator[tuple[tuple[int, int], np.ndarray]], *, host_id: int,
                progress: Callable[[int], None]) -> list[ShardChecksum]:
  """Writes the file of every rank that stages into this host, each on its own thread.

  ``items`` maps each rank to its items (filled in as the ranks' first parts arrive,
  before their shards); ``incoming`` yields ``((rank, item number), data)`` until the
  step is staged whole. Returns every item's checksum, as the manifest keeps them.
  """
  queues: dict[int, queue.SimpleQueue] = {}
  threads: dict[int, threading.Thread] = {}
  results: dict[int, list] = {}
  failures: dict[int, BaseException] = {}

  def run(rank: int) -> None:
    ended = False

    def datas():
      nonlocal ended
      while (got := queues[rank].get()) is not _END:
        yield got
      ended = True
    try:
      results[rank] = dcp.write_rank_part(tmp, rank, items[rank], datas(), progress=progress)
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
    for (rank, number), data in incoming:
      if rank not in threads:
        start(rank)
      queues[rank].put((number, data))
    for rank in items:  # a rank whose items never came: its write names what is missing
      if rank not in threads and items[rank]:
        start(rank)
  finally:
    for q in queues.values():
      q.put(_END)
    for t in threads.values():
      t.join()
  if failures:
    raise failures[min(failures)]
  return [dataclasses.replace(c, host=host_id) for rank in sorted(results) for c in results[rank]]


def commit(tmp: str, *, step: int, metadata: bytes, file_sizes: Mapping[int, int],
           plan_json: str, checksums: list[ShardChecksum], data_state: str,
           replicas: Mapping | None) -> str:
  """Writes the manifest and DCP's ``.metadata`` (as the trainer pickled it), renames."""
  try:
    plan = json.loads(plan_json)
  except ValueError as e:
    raise errors.InvalidArgumentError(f"dcp.plan_json is not JSON: {e}") from None
  manifest: dict[str, Any] = {
      "format": FORMAT, "version": 1, "step": step, "plan": plan, "leaves": [],
      "shards": [c.to_dict() for c in checksums],
      "data_state": json.loads(data_state) if data_state else None}
  if replicas:
    manifest["replicas"] = {str(h): [int(p) for p in peers] for h, peers in replicas.items()}
  return str(dcp.finalize(tmp, metadata=metadata, file_sizes=file_sizes, manifest=manifest,
                          swapping=lambda: faults.fault("swap", step)))


@functools.lru_cache(maxsize=16)
def _index(final_dir: str, mtime: float) -> dict[tuple[str, tuple[int, ...]], dict[str, Any]]:
  """Every item of a committed DCP step by ``(fqn, chunk offsets)``: file, place, dtype."""
  del mtime  # in the key only: a rewritten step is read again
  with open(pathlib.Path(final_dir) / MANIFEST) as f:
    plan = json.load(f)["plan"]
  out = {}
  for s in plan["storage"]:
    entry = plan["state"][s["fqn"]]
    offsets = tuple(s["offset"] or ())
    if entry["kind"] == "bytes":
      item = dcp.Item(fqn=s["fqn"], kind=dcp.ItemKind.BYTES, nbytes=s["length"])
    else:
      sizes = next(c["sizes"] for c in entry["chunks"] if tuple(c["offsets"]) == offsets)
      item = dcp.Item(fqn=s["fqn"], kind=dcp.ItemKind.TENSOR, dtype=entry["dtype"], sizes=sizes,
                      offsets=offsets, nbytes=dcp_record.data_nbytes(entry["dtype"], sizes))
    out[(s["fqn"], offsets)] = {"item": item, "where": dcp.Placement(
        s["path"], s["at"], s["length"], dcp.data_offset(item, s["at"]))}
  return out


def is_dcp(final_dir: str) -> bool:
  return dcp.is_checkpoint(final_dir) and (pathlib.Path(final_dir) / MANIFEST).is_file()


def read_item(final_dir: str, key: tuple, index: tuple[tuple[int, int], ...], *,
              allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray]) -> np.ndarray:
  """The stored bytes of one item of a committed DCP step, into ``allocate(shape, dtype)``."""
  path = pathlib.Path(final_dir)
  try:
    found = _index(str(path), (path / MANIFEST).stat().st_mtime)
  except (OSError, KeyError, StopIteration, ValueError) as e:
    raise errors.InvalidArgumentError(f"cannot read {final_dir}: its manifest: {e}") from None
  entry = found.get((str(key[0]) if key else "", tuple(a for a, _ in index)))
  if entry is None or len(key) != 1:
    raise errors.InvalidArgumentError(
        f"{final_dir} has no item {list(key)} at {[list(i) for i in index]}")
  item: dcp.Item = entry["item"]
  if item.kind is dcp.ItemKind.BYTES:
    out = allocate((item.nbytes,), np.dtype(np.uint8))
  else:
    out = allocate(item.sizes, dtypes.dtype_of(item.dtype, f"item {item.fqn!r}"))
  dcp.read_item(path, entry["where"], out)
  return out
