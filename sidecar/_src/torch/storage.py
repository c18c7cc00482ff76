"""DCP's storage classes through the sidecars: ``dcp.save``, ``dcp.async_save`` and ``dcp.load``
work unchanged with ``storage_writer=StorageWriter(path)`` / ``storage_reader=StorageReader(path)``.

A save stalls each rank for one copy of its tensors into its node's sidecar's arena
(``write_data``, or ``stage`` under ``dcp.async_save``); the sidecar then writes the rank's
``__{rank}_0.distcp`` in DCP's own layout from its arena, in its own process, and keeps
the step in its RAM tier. Rank 0 (DCP's coordinator) begins the step (the tmp
directory) in ``prepare_global_plan``, and in ``finish`` pickles DCP's Metadata, waits for
every sidecar's part and commits with one rename: stock ``FileSystemReader`` then reads
the directory. ``StorageReader`` takes each item from the RAM tier of the sidecar that
holds it (no storage read, no pickle: the plan in the manifest rebuilds the Metadata),
else from storage, each shard's crc32c checked; a directory stock DCP wrote is read as
``FileSystemReader`` reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import logging
import os
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader, metadata as md
from torch.distributed.checkpoint.planner import (
  LoadItemType,
  LoadPlan,
  LoadPlanner,
  SavePlan,
  SavePlanner,
)
from torch.distributed.checkpoint.storage import (
  StorageReader as _Reader,
  StorageWriter as _Writer,
  WriteResult,
)
from torch.distributed.tensor import DTensor

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import dcp
from sidecar._src.ckptfmt.shards import ShardChecksum
from sidecar._src.controller import controller as core
from sidecar._src.controller.checkpoint import staging
from sidecar._src.controller.checkpoint.checkpointer import replica_peers
from sidecar._src.controller.checkpoint.client import StagedShard
from sidecar._src.core import errors
from sidecar._src.torch import (
  controller as torch_controller,
  framework,
  metadata as plans_lib,
  tensors,
)
from sidecar._src.wire import codec

log = logging.getLogger(__name__)
_LONG_S = 3600.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
  """Where a save goes, as rank 0 began it: in every rank's plan (``storage_data``)."""
  final: str
  tmp: str
  label: int  # the step's number in the sidecars' RAM tier (its retention order)


def _label(path: str) -> int:
  name = os.path.basename(path)
  return int(name) if name.isdigit() else time.time_ns() // 1000


def _rank_hosts(ctl: core.Controller) -> dict[int, int]:
  """``{rank: host}``: a rank's one device id is its rank."""
  hosts = ctl.device_hosts
  if ctl.peers.count == 1:
    return {0: ctl.local_hosts[0]}
  return {r: hosts[r] for r in range(ctl.peers.count)}


def _host_of_this_rank(ctl: core.Controller) -> int:
  return ctl.local_hosts[0]


class StorageWriter(_Writer):
  """DCP's ``StorageWriter`` whose bytes go through this rank's sidecar (see the module).

  Example::

    dcp.save(state_dict, storage_writer=sidecar.torch.StorageWriter("/ckpt/step_100"))
    dcp.async_save(state_dict, storage_writer=sidecar.torch.StorageWriter("/ckpt/step_200"))

  Args:
    path: the checkpoint directory (as ``FileSystemWriter``'s); a committed one is replaced.
    replicas: peer sidecars that also keep each shard in their RAM tier.
    ram_steps: committed checkpoints under ``path``'s parent that the RAM tier keeps.
    controller: default this rank's, from :func:`sidecar.torch.connect`.
  """

  _synchronize_after_execute = False  # stage() copies synchronously: nothing to wait for

  def __init__(self, path: str | os.PathLike, *, replicas: int = 0, ram_steps: int = 1,
               controller: core.Controller | None = None):
    super().__init__()
    self.path = os.path.abspath(os.fspath(path))
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
      raise errors.InvalidArgumentError(f"replicas must be an int >= 0, got {replicas!r}")
    self.replicas, self.ram_steps = replicas, ram_steps
    self._ctl = torch_controller.controller_or_connect(controller)
    hosts = len(self._ctl.hosts)
    if replicas > hosts - 1:  # e.g. an elastic job down to fewer hosts than it planned
      log.warning("replicas=%d, but there are %d hosts: each part gets %d peer copies",
                  replicas, hosts, max(hosts - 1, 0))
      self.replicas = max(hosts - 1, 0)
    self._client = self._ctl._checkpoint_client()
    self.save_id = uuid.uuid4().hex
    self.is_coordinator = False
    self._opened: set[str] = set()
    self._begun: _Target | None = None  # rank 0: the save prepare_global_plan began
    self.last_stats: dict[str, float] = {}

  # ---- DCP's StorageWriter ---------------------------------------------

  def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
    if checkpoint_id:
      self.path = os.path.abspath(os.fspath(checkpoint_id))
    self.save_id = uuid.uuid4().hex

  def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
    self.is_coordinator = is_coordinator

  def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
    return plan

  def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
    """Rank 0 begins the step: the sidecar makes its tmp directory beside ``path``."""
    host = _host_of_this_rank(self._ctl)
    parent = os.path.dirname(self.path)
    if parent not in self._opened:
      self._client.open(host, parent, ram_steps=self.ram_steps, ram_budget=None,
                        sweep=False).result()
      self._opened.add(parent)
    label = _label(self.path)
    tmp = self._client.begin(host, self.path, label, format=dcp.FORMAT).result()
    target = self._begun = _Target(self.path, tmp, label)
    return [dataclasses.replace(p, storage_data=target) for p in plans]

  def write_data(self, plan: SavePlan, planner: SavePlanner
                 ) -> torch.futures.Future[list[WriteResult]]:
    """Copies this rank's items into its sidecar's arena (the stall) and stages them."""
    target: _Target = plan.storage_data
    rank = self._ctl.peers.index
    host = _host_of_this_rank(self._ctl)
    t0 = time.perf_counter()
    arrays, refs = self._to_arena(host, [(planner.resolve_data(w), w.index.fqn)
                                         for w in plan.items])
    items = [plans_lib.item_of(w, a.nbytes) for w, a in zip(plan.items, arrays)]
    copied = time.perf_counter()
    writers = sum(1 for h in _rank_hosts(self._ctl).values() if h == host)
    parent = os.path.dirname(target.final)
    dicts = [item.to_dict() for item in items]
    parts: list[list[StagedShard]] = [[]]
    nbytes = 0
    for i, (item, array) in enumerate(zip(items, arrays)):
      if nbytes >= staging.STAGE_PART_BYTES:  # the core's measured size (one part on 2 cores)
        parts.append([])
        nbytes = 0
      parts[-1].append(StagedShard(i, item.index, array, refs[i]))
      nbytes += array.nbytes
    arrays.clear()
    for n, part in enumerate(parts):
      self._client.stage(host, directory=parent, step=target.label, tmp_dir=target.tmp,
                         final_dir=target.final, leaves=[], shards=part,
                         last=n == len(parts) - 1, writers=writers,
                         dcp=(rank, dicts if n == 0 else [])).result()
    parts.clear()
    self.last_stats = {"copy_s": copied - t0, "stage_s": time.perf_counter() - copied}
    out: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
    out.set_result(plans_lib.write_results(rank, plan.items, items))
    return out

  def _to_arena(self, host: int, entries: list[tuple[Any, str]]
                ) -> tuple[list[np.ndarray], list[codec.ArenaRef | None]]:
    """Each ``(data, fqn)`` (a tensor or DCP's BytesIO) in ``host``'s arena, and its
    descriptor: as is if it is there, else copied into blocks allocated in one request."""
    arrays = [np.frombuffer(data.getbuffer(), np.uint8) if isinstance(data, io.BytesIO)
              else framework.host_array(data, f"state dict entry {fqn!r}")
              for data, fqn in entries]
    worker = self._ctl.worker(host)
    # Staged already (async_save's stage): no second copy.
    refs = [worker.ref_of(a) if worker is not None else None for a in arrays]
    fresh = [i for i, r in enumerate(refs) if r is None]
    for i, (block, ref) in zip(fresh, self._client.empty_like(host, [arrays[i] for i in fresh])):
      shm.copy(block, arrays[i], threads=torch.get_num_threads())
      arrays[i], refs[i] = block, ref
    return arrays, refs

  def finish(self, metadata: md.Metadata, results: list[list[WriteResult]]) -> None:
    """Rank 0: pickles the metadata, waits for every sidecar's part, commits once."""
    target = self._begun
    if target is None:
      raise errors.InvalidArgumentError("finish() before prepare_global_plan(): use dcp.save")
    raw = plans_lib.finish(metadata, results, checkpoint_id=self.path, save_id=self.save_id)
    plan = plans_lib.to_plan(metadata)
    hosts = sorted(set(_rank_hosts(self._ctl).values()))
    sizes: dict[int, int] = {}
    for name, size in plans_lib.file_sizes(results).items():
      sizes[int(name.removeprefix("__").split("_")[0])] = size
    placement = self._placement(hosts)
    try:
      sums = [c for f in [self._client.prepared(h, target.final, timeout=_LONG_S) for h in hosts]
              for c in f.result()]
      home = _host_of_this_rank(self._ctl)
      self._client.commit(home, tmp_dir=target.tmp, step=target.label, num_hosts=len(hosts),
                          leaves=[], checksums=sums, data_state_json="", whole_step=True,
                          replicas=placement or None, timeout=_LONG_S,
                          dcp={"metadata": raw, "file_sizes": sizes,
                               "plan_json": json.dumps(plan)}).result()
    except BaseException:
      for h in hosts:
        try:
          self._client.abort(h, target.tmp, target.final, timeout=90.0).result()
        except errors.SidecarError:
          pass  # that host is gone: its part went with it
      raise
    manifest = json.dumps({"format": dcp.FORMAT, "version": 1, "step": target.label,
                           "plan": plan, "leaves": [], "shards": [c.to_dict() for c in sums],
                           "data_state": None,
                           "replicas": {str(h): p for h, p in placement.items()}})
    for f in [self._client.committed(h, target.final, manifest) for h in hosts]:
      f.result()
    if placement:
      self._replicate(target, placement)

  def _placement(self, hosts: list[int]) -> dict[int, list[int]]:
    """``{host: the peers that keep its part}`` (another slice's first); empty with no
    replicas."""
    if not self.replicas:
      return {}
    records = self._ctl._hosts.sidecar_records()
    slices = {h: int(r.get("slice_id", 0)) for h, r in records.items()}
    return {h: replica_peers(slices, h, self.replicas) for h in hosts}

  def _replicate(self, target: _Target, placement: dict[int, list[int]]) -> None:
    """Each host's part, committed, to its peers' RAM tiers: a lost sidecar's part is then
    restored from memory, with no storage read."""
    records = self._ctl._hosts.sidecar_records()
    t0 = time.perf_counter()
    futures = [self._client.replicate(h, target.final,
                                      [dict(records[p], host_id=p) for p in peers],
                                      bandwidth=None, timeout=_LONG_S)
               for h, peers in placement.items()]
    sent = sum(f.result()["bytes"] for f in futures)
    self.last_stats = {**self.last_stats, "replicated_bytes": float(sent),
                       "replicate_s": time.perf_counter() - t0}

  def storage_meta(self) -> md.StorageMeta | None:
    return md.StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

  @classmethod
  def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike))

  # ---- dcp.async_save: the one copy, before the save runs in the background --------

  @property
  def should_synchronize_after_execute(self) -> bool:
    return self._synchronize_after_execute

  def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Copies every tensor of ``state_dict`` into this rank's sidecar's arena (its blocks
    allocated in one request): the state dict the background save then writes (DCP's
    ``AsyncStager``)."""
    found: list[tuple[torch.Tensor, np.ndarray]] = []

    def collect(t: torch.Tensor, name: str) -> torch.Tensor:
      local = t.to_local() if isinstance(t, DTensor) else t
      found.append((t, framework.host_array(local, f"state dict entry {name!r}")))
      return t
    _map_tensors(state_dict, collect)
    blocks = self._client.empty_like(_host_of_this_rank(self._ctl), [a for _, a in found])
    staged = iter([self._staged(t, a, block) for (t, a), (block, _) in zip(found, blocks)])
    found.clear()
    return _map_tensors(state_dict, lambda t, name: next(staged))

  @staticmethod
  def _staged(t: torch.Tensor, array: np.ndarray, block: np.ndarray) -> torch.Tensor:
    """``t`` over its arena ``block``, once ``array`` (its host copy) is copied there: on
    as many threads as torch's own pool (torchrun gives each of a node's ranks one, so
    that they do not take each other's cores: 2 ranks on 2 cores blocked 0.90x a memcpy
    with one copy thread each, 1.06x with two)."""
    shm.copy(block, array, threads=torch.get_num_threads())
    copy = tensors.from_array(block)
    if isinstance(t, DTensor):  # FSDP2's shards: the same placement, over the arena copy
      return DTensor.from_local(copy.view(t.to_local().shape), t.device_mesh, t.placements,
                                run_check=False, shape=t.shape, stride=t.stride())
    return copy.view(t.shape)

  def synchronize_staging(self) -> None:
    pass

  def close(self) -> None:
    pass


def _map_tensors(tree: Any, fn: Any, prefix: str = "") -> Any:
  if isinstance(tree, torch.Tensor):
    return fn(tree, prefix)
  if isinstance(tree, dict):
    return {k: _map_tensors(v, fn, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    out = [_map_tensors(v, fn, f"{prefix}.{i}") for i, v in enumerate(tree)]
    return type(tree)(out) if isinstance(tree, tuple) else out
  return tree


class StorageReader(_Reader):
  """DCP's ``StorageReader`` that reads through the sidecars (see the module).

  Example::

    dcp.load(state_dict, storage_reader=sidecar.torch.StorageReader("/ckpt/step_100"))

  Each item comes from the RAM tier of the sidecar that staged it (another sidecar on
  this machine's arena is mapped here: no copy), else from storage through this rank's
  sidecar, its crc32c checked. A checkpoint stock DCP wrote (no manifest of ours) is read
  as ``FileSystemReader`` reads it.
  """

  def __init__(self, path: str | os.PathLike, *, controller: core.Controller | None = None):
    super().__init__()
    self.path = os.path.abspath(os.fspath(path))
    self._ctl = torch_controller.controller_or_connect(controller)
    self._client = self._ctl._checkpoint_client()
    self._stock: FileSystemReader | None = None
    self._metadata: md.Metadata | None = None
    self._sums: dict[tuple[str, tuple], ShardChecksum] = {}
    self._replicas: dict[int, list[int]] = {}  # {host: the peers that keep its part}
    self.last_stats: dict[str, int] = {}

  def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
    if checkpoint_id:
      self.path = os.path.abspath(os.fspath(checkpoint_id))
    self._stock, self._metadata = None, None

  def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
    host = _host_of_this_rank(self._ctl)
    try:
      manifest = self._client.info(host, self.path).result()
    except errors.InvalidArgumentError:
      manifest = None
    if manifest is None or manifest.dcp_plan is None:
      self._stock = FileSystemReader(self.path)
      return self._stock.read_metadata(*args, **kwargs)
    self._sums = {(str(s.key_path[0]), s.index): s for s in manifest.shards}
    self._replicas = {int(h): list(peers) for h, peers in (manifest.replicas or {}).items()}
    self._metadata = plans_lib.from_plan(manifest.dcp_plan)
    return self._metadata

  def set_up_storage_reader(self, metadata: md.Metadata, is_coordinator: bool, *args: Any,
                            **kwargs: Any) -> None:
    if self._stock is not None:
      self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
    self._metadata = metadata

  def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
    return plan

  def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
    return plans

  def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
    if self._stock is not None:
      return self._stock.read_data(plan, planner)
    assert self._metadata is not None
    here = _host_of_this_rank(self._ctl)
    counts = {"items": 0, "bytes": 0, "from_replicas": 0, "from_storage": 0}
    pending = []
    for req in plan.items:
      fqn = req.storage_index.fqn
      entry = self._metadata.state_dict_metadata[fqn]
      if req.type == LoadItemType.BYTE_IO:
        index: tuple = ()
      else:
        offsets = tuple(req.storage_index.offset or ())
        assert isinstance(entry, md.TensorStorageMetadata)
        sizes = next(tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == offsets)
        index = tuple((o, o + s) for o, s in zip(offsets, sizes))
      s = self._sums.get((fqn, index))
      crc = s.crc32c if s is not None else None
      source = s.host if s is not None and s.host is not None else here
      shard = ((fqn,), index)
      pending.append((req, shard, crc, source, self._read(source, shard, crc, "any")))
    for req, shard, crc, source, future in pending:
      try:
        data = future.result()
      except (errors.HostLostError, errors.InvalidArgumentError, errors.CorruptCheckpointError):
        # Its sidecar is gone, kept no copy, or its copy fails the committed manifest's
        # crc32c (another save's): a peer's replica, else storage.
        data = self._fallback(shard, crc, source, here, counts)
      counts["items"] += 1
      counts["bytes"] += data.nbytes
      if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data.tobytes()))
        continue
      src = tensors.from_array(data)
      for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
        src = src.narrow(dim, start, length)
      target = planner.resolve_tensor(req).detach()
      if target.size() != src.size():
        raise errors.CorruptCheckpointError(
            f"{self.path}: item {req.storage_index.fqn!r} is {tuple(src.size())}, the state "
            f"dict's entry {tuple(target.size())}")
      target.copy_(src)
      planner.commit_tensor(req, target)
      del data, src
    self.last_stats = counts
    out: torch.futures.Future[None] = torch.futures.Future()
    out.set_result(None)
    return out

  def _read(self, host: int, shard: tuple, crc: int | None, tier: str
            ) -> concurrent.futures.Future:
    """A read of ``shard`` from ``host``'s ``tier``; one the controller refuses at once (a
    host lost, or of the job before an elastic restart) as a failed future."""
    try:
      return self._client.read(host, self.path, shard, crc32c=crc, tier=tier)
    except (errors.HostLostError, errors.InvalidArgumentError) as e:
      failed: concurrent.futures.Future = concurrent.futures.Future()
      failed.set_exception(e)
      return failed

  def _fallback(self, shard: tuple, crc: int | None, source: int, here: int,
                counts: dict[str, int]) -> np.ndarray:
    """A shard its own sidecar could not give: from a peer that keeps a replica of
    ``source``'s part (the manifest names them), else from storage through this rank's."""
    for peer in self._replicas.get(source, []):
      try:
        data = self._read(peer, shard, crc, "replica").result()
      except (errors.HostLostError, errors.InvalidArgumentError, errors.CorruptCheckpointError):
        continue  # that peer is gone too, let its copy go, or holds another save's
      counts["from_replicas"] += 1
      return data
    counts["from_storage"] += 1
    return self._client.read(here, self.path, shard, crc32c=crc, tier="disk").result()

  @classmethod
  def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike))

