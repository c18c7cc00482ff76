"""DCP's storage classes through the sidecars: ``dcp.save``, ``dcp.async_save`` and ``dcp.load``
work unchanged with ``storage_writer=StorageWriter(path)`` / ``storage_reader=StorageReader(path)``.

Thin adapters over the core's checkpoint protocol: a save is one of the core's
``controller/checkpoint/save_run.SaveRun``, whose methods DCP's hooks call, with DCP's
coordinator rank as the coordination between the ranks (``coordination.Coordinator``); a restore
is the core's tier fallback (``shard_reads.ShardReads``).

A save stalls each rank for one copy of its tensors into its node's sidecar's arena
(``write_data``, or ``stage`` under ``dcp.async_save``), by the core's one stager
(``staging.copy_in``) in the core's parts (``staging.Lots``); the sidecar then writes the
rank's ``__{rank}_0.distcp`` in DCP's own layout from its arena, in its own process, and
keeps the step in its RAM tier. Rank 0 (DCP's coordinator) begins the step (the tmp
directory) in ``prepare_global_plan`` (``SaveRun.begin``); every rank stages its part in
``write_data`` on DCP's thread (``SaveRun.stage_copies``); in ``finish`` rank 0 pickles
DCP's Metadata and finishes the run as every framework's save does (``SaveRun.finish``:
with ``replicas`` the replication starts, ``replicated`` resolving apart; every sidecar's
part is waited for and committed with one rename, or aborted everywhere): stock
``FileSystemReader`` then reads the directory. ``sidecar.torch.Checkpointer`` is the
core's one Checkpointer with these classes as its driver
(``torch/checkpointer.DcpDriver``).
``StorageReader`` takes each item from the RAM tier of the sidecar that holds it (no
storage read, no pickle: the plan in the manifest rebuilds the Metadata), else a
replica on another sidecar, else storage, each shard's crc32c checked; a directory stock
DCP wrote is read as ``FileSystemReader`` reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import os
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader, metadata as dcp_metadata
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

from sidecar._src.ckptfmt import records, registry as formats_lib
from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart, distcp
from sidecar._src.ckptfmt.records import Manifest, ShardId, ShardRecord
from sidecar._src.ckptfmt.registry import DCP
from sidecar._src.ckptfmt.tiers import Tier
from sidecar._src.controller import controller as core
from sidecar._src.controller.checkpoint import staging
from sidecar._src.controller.checkpoint.coordination import Coordinator
from sidecar._src.controller.checkpoint.options import CheckpointOptions, options_or
from sidecar._src.controller.checkpoint.save_protocol import SaveProtocol, Target
from sidecar._src.controller.checkpoint.save_run import Ending, SaveRun
from sidecar._src.controller.checkpoint.shard_reads import ShardReads, Source, warn_unchecked
from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot
from sidecar._src.controller.checkpoint.staging import ShardCopy, allocate, copy_in
from sidecar._src.core import errors, interrupts, trees
from sidecar._src.torch import (
  controller as torch_controller,
  framework,
  metadata as torch_metadata,
  tensors,
)


def dcp_format(options: CheckpointOptions) -> str:
  """The format a PyTorch save writes: ``options.format``, default DCP's; one whose extras
  are DCP's (``DcpPart``, ``DcpCommit``), which this adapter makes."""
  return options.format_for("PyTorch", default=DCP, extras=(DcpPart, DcpCommit))


def _label(path: str) -> int:
  """A checkpoint's number in its sidecars' RAM tier (their retention order)."""
  name = os.path.basename(path)
  return int(name) if name.isdigit() else time.time_ns() // 1000


def _rank_hosts(ctl: core.Controller, site: SidecarsSnapshot) -> dict[int, int]:
  """``{rank: host}``: a rank's one device id is its rank."""
  if ctl.peers.count == 1:
    return {0: site.local[0]}
  return {r: site.device_hosts[r] for r in range(ctl.peers.count)}


class StorageWriter(_Writer):
  """DCP's ``StorageWriter`` whose bytes go through this rank's sidecar (see the module).

  Example::

    dcp.save(state_dict, storage_writer=sidecar.torch.StorageWriter("/ckpt/step_100"))
    dcp.async_save(state_dict, storage_writer=sidecar.torch.StorageWriter("/ckpt/step_200"))

  Args:
    path: the checkpoint directory (as ``FileSystemWriter``'s); a committed one is replaced.
    replicas: other sidecars that also keep each shard in their RAM tier.
    ram_steps: committed checkpoints under ``path``'s parent that the RAM tier keeps.
    options: a :class:`CheckpointOptions` instead of ``replicas`` and ``ram_steps`` (its
      ``ram_budget`` and ``replica_bandwidth`` too).
    controller: default this rank's, from :func:`sidecar.torch.connect`.

  Attributes:
    replicated: on the coordinator rank, a future of the latest save's replication
      (its results), None before one; resolved once every host's part has its copies.
    last_stats: this rank's latest save: ``stage_s`` (its copy and staging; on the
      coordinator, once replicated, ``replicated_bytes`` and ``replicate_s`` too).
  """

  _synchronize_after_execute = False  # stage() copies synchronously: nothing to wait for

  def __init__(self, path: str | os.PathLike, *, replicas: int = 0, ram_steps: int = 1,
               options: CheckpointOptions | None = None,
               controller: core.Controller | None = None):
    super().__init__()
    self.path = os.path.abspath(os.fspath(path))
    self.options = options_or(options, replicas=replicas, ram_steps=ram_steps)
    self.format = dcp_format(self.options)
    self._ctl = torch_controller.controller_or_connect(controller)
    self._site = self._ctl.checkpoint_sidecars()
    self.replicas = self._site.replicas(self.options.replicas)
    self._ranks = _rank_hosts(self._ctl, self._site)
    self._home = self._site.local[0]  # this rank's sidecar
    self.save_id = distcp.SAVE_ID_PREFIX + uuid.uuid4().hex  # says a sidecar wrote it
    self.is_coordinator = False
    self._opened: set[str] = set()
    self._run: SaveRun | None = None  # this save's step (one per save: reset() drops it)
    self.ending: Ending | None = None  # a Checkpointer's save's end (DcpDriver's)

  @property
  def replicated(self) -> concurrent.futures.Future | None:
    """The latest save's replication (see the class)."""
    return self._run.replication if self._run is not None else None

  @property
  def last_stats(self) -> dict[str, float]:
    """This rank's latest save's stage (and replication) times (see the class)."""
    return dict(self._run.stats) if self._run is not None else {}

  def run(self, target: Target) -> SaveRun:
    """This save's step (``SaveRun``), made once: DCP's coordinator rank begins and
    commits it over every rank's host; each rank stages its own host."""
    if self._run is None or self._run.target.final_dir != target.final_dir:
      writers: dict[int, list[int]] = {}
      for rank, h in sorted(self._ranks.items()):
        writers.setdefault(h, []).append(rank)
      hosts = sorted(writers, key=lambda h: (h != self._home, h))  # its own host first
      protocol = SaveProtocol(client=self._site.client, directory=target.directory,
                              format=self.format, writers=writers)
      placement = {h: p for h, p in self._site.placement(self.replicas).items() if h in hosts}
      self._run = SaveRun(
          protocol, target, hosts=hosts, local=hosts if self.is_coordinator else [self._home],
          placement=placement, bandwidth=self.options.bandwidth, coordination=Coordinator(),
          ending=self.ending, share_manifest=True, path=self.path)
    return self._run

  def end(self, error: BaseException | None, target: Target) -> None:
    """The Checkpointer's end of this save (``SaveRun.end``), once DCP's upload ended."""
    self.run(target).end(error)

  # ---- DCP's StorageWriter ---------------------------------------------

  def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
    if checkpoint_id:
      self.path = os.path.abspath(os.fspath(checkpoint_id))
    self.save_id = distcp.SAVE_ID_PREFIX + uuid.uuid4().hex
    self._run = None

  def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
    self.is_coordinator = is_coordinator

  def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
    return plan

  def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
    """Rank 0 begins the step: the sidecar makes its tmp directory beside ``path``; DCP
    hands every rank the target in its plan."""
    parent = os.path.dirname(self.path)
    if parent not in self._opened:
      self._site.client.open(self._home, parent, ram_steps=self.options.ram_steps,
                             ram_budget=self.options.ram_budget, sweep=False).result()
      self._opened.add(parent)
    target = self.run(Target.for_step(formats_lib.DEFAULT.get(self.format), self.path,
                                      _label(self.path), directory=parent)).begin()
    return [dataclasses.replace(p, storage_data=target) for p in plans]

  @interrupts.deferring  # Ctrl-C: this rank's part is dropped from its sidecar
  def write_data(self, plan: SavePlan, planner: SavePlanner
                 ) -> torch.futures.Future[list[WriteResult]]:
    """Copies this rank's items into its sidecar's arena (the stall) and stages them, in
    the core's parts as the copy goes."""
    run = self.run(plan.storage_data)
    run.begun(plan.storage_data.tmp_step)  # the coordinator's Begin, carried by DCP's plan
    rank = self._ctl.peers.index
    arrays = [np.frombuffer(data.getbuffer(), np.uint8) if isinstance(data, io.BytesIO)
              else framework.numpy_array(data, f"state dict entry {w.index.fqn!r}")
              for w, data in ((w, planner.resolve_data(w)) for w in plan.items)]
    items = [torch_metadata.item_of(w, a.nbytes) for w, a in zip(plan.items, arrays)]
    worker = self._ctl.worker(self._home)  # an array staged by stage() is there already
    copies = [ShardCopy(item.record(i, rank, a, host=self._home), a,
                        ref=worker.ref_of(a) if worker is not None else None)
              for i, (item, a) in enumerate(zip(items, arrays))]
    del arrays
    part = DcpPart(rank, len(items))  # each item is its record, in ``copies``
    run.stage_copies(self._home, copies, extra=part, threads=torch.get_num_threads())
    out: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
    out.set_result(torch_metadata.write_results(rank, plan.items, items))
    return out

  def finish(self, metadata: dcp_metadata.Metadata, results: list[list[WriteResult]]) -> None:
    """Rank 0: every rank's part is staged (DCP gathered their write results): the
    step's run finishes (``SaveRun.finish``: replication, every host's writes, one
    commit with DCP's metadata, or an abort everywhere)."""
    run = self._run
    if run is None or not run.target.tmp_dir:
      raise errors.InvalidArgumentError("finish() before prepare_global_plan(): use dcp.save")
    raw = torch_metadata.finish(metadata, results, checkpoint_id=self.path, save_id=self.save_id)
    sizes = {int(name.removeprefix("__").split("_")[0]): size
             for name, size in torch_metadata.file_sizes(results).items()}
    run.finish(extra=DcpCommit(raw, sizes, json.dumps(torch_metadata.to_plan(metadata))))

  def storage_meta(self) -> dcp_metadata.StorageMeta | None:
    return dcp_metadata.StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

  @classmethod
  def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike))

  # ---- dcp.async_save: the one copy, before the save runs in the background --------

  @property
  def should_synchronize_after_execute(self) -> bool:
    return self._synchronize_after_execute

  @interrupts.deferring  # Ctrl-C: nothing is saved, the blocks go back
  def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Copies every tensor of ``state_dict`` into this rank's sidecar's arena (its blocks
    allocated in one request): the state dict the background save then writes (DCP's
    ``AsyncStager``)."""
    flat, treedef = trees.flatten_with_path(state_dict)
    leaves = [x for _, x in flat]
    found = [(i, x, framework.numpy_array(x.to_local() if isinstance(x, DTensor) else x,
                                         f"state dict entry {'.'.join(map(str, path))!r}"))
             for i, (path, x) in enumerate(flat) if isinstance(x, torch.Tensor)]
    # The one stager, on as many threads as torch's own pool (torchrun gives each of a
    # node's ranks one, so that they do not take each other's cores: 2 ranks on 2 cores
    # blocked 0.90x a memcpy with one copy thread each, 1.06x with two).
    copies = [ShardCopy(ShardRecord.of(ShardId(flat[i][0], ()), i, a, host=self._home), a)
              for i, _, a in found]
    allocate(self._site.client.empty_like, copies, self._home)
    views = _Views()
    copy_in(copies, views, threads=torch.get_num_threads())
    for i, t, _ in found:
      leaves[i] = _over(t, views.pop(i))
    return trees.unflatten(treedef, leaves)

  def synchronize_staging(self) -> None:
    pass

  def close(self) -> None:
    pass


class _Views(staging.Sink):
  """The arena views of a ``dcp.async_save`` stage's copies, by leaf number."""

  def __init__(self) -> None:
    self._views: dict[int, np.ndarray] = {}

  def add(self, shard: ShardCopy, view: np.ndarray) -> None:
    self._views[shard.record.leaf] = view

  def pop(self, leaf: int) -> np.ndarray:
    return self._views.pop(leaf)

  def close(self) -> None:
    pass

  def fail(self, error: BaseException) -> None:
    self._views.clear()


def _over(t: torch.Tensor, block: np.ndarray) -> torch.Tensor:
  """``t`` over its arena copy ``block``."""
  copy = tensors.from_array(block)
  if isinstance(t, DTensor):  # FSDP2's shards: the same placement, over the arena copy
    return DTensor.from_local(copy.view(t.to_local().shape), t.device_mesh, t.placements,
                              run_check=False, shape=t.shape, stride=t.stride())
  return copy.view(t.shape)


class StorageReader(_Reader):
  """DCP's ``StorageReader`` that reads through the sidecars (see the module).

  Example::

    dcp.load(state_dict, storage_reader=sidecar.torch.StorageReader("/ckpt/step_100"))

  Each item comes from the RAM tier of the sidecar that staged it (another sidecar on
  this machine's arena is mapped here: no copy), else from a replica on another sidecar, else from
  storage through this rank's sidecar, its crc32c checked (the core's tier fallback,
  ``shard_reads.ShardReads``). A checkpoint stock DCP wrote (no manifest of ours) is read as
  ``FileSystemReader`` reads it.
  """

  def __init__(self, path: str | os.PathLike, *, controller: core.Controller | None = None):
    super().__init__()
    self.path = os.path.abspath(os.fspath(path))
    self._ctl = torch_controller.controller_or_connect(controller)
    self._site = self._ctl.checkpoint_sidecars()
    self._home = self._site.local[0]
    self._reads = ShardReads(self._site.client, self._site.mapped)
    self._stock: FileSystemReader | None = None
    self._metadata: dcp_metadata.Metadata | None = None
    self._manifest: tuple[str, Manifest | None] | None = None  # path's, once asked
    self._records: dict[tuple[str, tuple[int, ...]], ShardRecord] = {}
    self._replicas: dict[int, tuple[int, ...]] = {}  # {host: the peers that keep its part}
    self._held: dict[int, frozenset[ShardId]] = {}  # {host: the shards its RAM tier keeps}
    self.last_stats: dict[str, int] = {}
    # Where the last load's items came from, by Source.label ("ram:host0", "storage"):
    # items and bytes, a RestoreStats' ``shards`` and ``bytes``.
    self.sources: dict[str, int] = {}
    self.source_bytes: dict[str, int] = {}

  def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
    if checkpoint_id:
      self.path = os.path.abspath(os.fspath(checkpoint_id))
    self._stock, self._metadata, self._manifest = None, None, None

  def check(self) -> None:
    """WrongFormatError if ``path`` is a step of another format (an Orbax one), naming
    it and the API that reads it: called before ``dcp.load``, which would wrap it."""
    self._info()

  def _info(self) -> Manifest | None:
    """Our manifest of ``path``; None for a checkpoint stock DCP wrote (or none there:
    stock DCP's reader says what is missing)."""
    if self._manifest is None or self._manifest[0] != self.path:
      try:
        manifest = self._site.client.info(self._home, self.path).result()
      except errors.WrongFormatError:
        raise
      except errors.InvalidArgumentError:
        manifest = None
      self._manifest = (self.path, manifest)
    return self._manifest[1]

  def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
    manifest = self._info()
    if manifest is None or manifest.dcp_plan is None:
      if manifest is not None and manifest.stock:
        warn_unchecked(self.path, "stock DCP")
      self._stock = FileSystemReader(self.path)
      return self._stock.read_metadata(*args, **kwargs)
    # Each item's record, by its fqn and chunk offsets (a bytes item's: none), as DCP's load
    # plan names it.
    self._records = {(str(r.key_path[0]), tuple(a for a, _ in r.index)): r
                     for r in manifest.shards}
    self._replicas = dict(manifest.replicas)
    self._held = self._ram_held({r.host if r.host is not None else self._home
                                 for r in manifest.shards})
    self._metadata = torch_metadata.from_plan(manifest.dcp_plan)
    return self._metadata

  def _ram_held(self, hosts: set[int]) -> dict[int, frozenset[ShardId]]:
    """The shards of ``path`` each of ``hosts`` keeps in its RAM tier (the core restore's
    ``Held``), so that each read names the tier it reads; a host that does not answer
    keeps none (its items come from a replica or storage)."""
    directory = os.path.dirname(self.path)
    futures = {}
    for h in sorted(hosts):
      try:
        futures[h] = self._site.client.held(h, directory, timeout=5)
      except errors.SidecarError:  # a host known lost
        continue
    held = {}
    for h, f in futures.items():
      try:
        held[h] = frozenset(f.result().own.get(self.path, ()))
      except errors.SidecarError:
        continue
    return held

  def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any,
                            **kwargs: Any) -> None:
    if self._stock is not None:
      self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
    self._metadata = metadata

  def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
    return plan

  def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
    return plans

  def _sources(self, owner: int, shard: ShardId) -> list[Source]:
    """Where to read ``shard``, which ``owner`` staged, in order: its RAM tier where it
    keeps it, the hosts that keep its replica (the manifest names them), storage through
    ``owner`` and through this rank's sidecar. Each names its tier, as a restore's stats
    say it (``RestoreStats``)."""
    ram = [Source(owner, Tier.RAM)] if shard in self._held.get(owner, ()) else []
    return [*ram, *(Source(h, Tier.REPLICA) for h in self._replicas.get(owner, ())),
            *(Source(h, Tier.STORAGE) for h in dict.fromkeys([owner, self._home]))]

  @interrupts.deferring  # Ctrl-C: the reads in flight are dropped, their blocks go back
  def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
    if self._stock is not None:
      return self._stock.read_data(plan, planner)
    assert self._metadata is not None
    pending = [(req, self._start(req)) for req in plan.items]
    counts = {"items": 0, "bytes": 0, "from_replicas": 0, "from_storage": 0}
    self.sources, self.source_bytes = {}, {}
    for req, future in pending:
      data, source = interrupts.wait(future)
      counts["items"] += 1
      counts["bytes"] += data.nbytes
      counts["from_replicas"] += source.tier is Tier.REPLICA
      counts["from_storage"] += source.tier is Tier.STORAGE
      self.sources[source.label] = self.sources.get(source.label, 0) + 1
      self.source_bytes[source.label] = self.source_bytes.get(source.label, 0) + data.nbytes
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
      if target.dtype != src.dtype:  # copy_ would cast: other values than those saved
        raise errors.InvalidArgumentError(
            f"{self.path}: state dict entry {req.storage_index.fqn!r} is {target.dtype}, but "
            f"the step saved {src.dtype}: restore into a state dict of the saved dtypes, "
            "then convert")
      target.copy_(src)
      planner.commit_tensor(req, target)
      del data, src
    self.last_stats = counts
    out: torch.futures.Future[None] = torch.futures.Future()
    out.set_result(None)
    return out

  def _start(self, req: Any) -> concurrent.futures.Future:
    """The read of one load item's stored chunk, through the core's tier fallback: the
    item's record in the manifest (found by its fqn and offsets) goes down to the read."""
    fqn = req.storage_index.fqn
    offsets = () if req.type == LoadItemType.BYTE_IO else tuple(req.storage_index.offset or ())
    record = self._records.get((fqn, offsets))
    if record is None:
      raise errors.CorruptCheckpointError(
          f"{self.path}: its {records.MANIFEST_FILE} lists no record of item {fqn!r} at "
          f"{list(offsets)}, which its plan has: the manifest does not describe this step")
    owner = record.host if record.host is not None else self._home
    return self._reads.first(self.path, record, self._sources(owner, record.id))

  @classmethod
  def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike))
