"""The plugs of the one :class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer`.

The Checkpointer owns what every framework's checkpoints share: the options, the steps
(``retention.Retention``), one save in flight and the processes' one decision on it
(``if_busy``), the :class:`~sidecar._src.controller.checkpoint.save_run.SaveHandle`,
``wait``, ``close``, the RAM tier's drop. Every save is one ``save_run.SaveRun`` (begin,
stage, the one finish, the end). What differs between frameworks is one small object, as
Orbax v1's ``training.Checkpointer`` holds its policies, made from a :class:`Setup`
(what it needs, handed over explicitly):

- the **driver** (:class:`Driver`): who drives a save's run, how the trainer
  processes coordinate it (its ``coordination.Coordination``) and how leaves are described,
  copied and rebuilt. :class:`KeyValueDriver` (JAX's, the numpy core's): the
  framework's shards (``controller/framework.Framework``), process 0 begins and commits,
  the processes coordinate through their key-value store (``coordination.KeyValue``), each
  stages its own shards from one finisher thread (:class:`SaveRunner`, here: the
  key-value driver's saves).
  ``torch/checkpointer.DcpDriver``: DCP's planner over the state dict, through
  ``dcp.async_save`` with ``torch/storage.StorageWriter``, whose hooks drive the run
  (``coordination.Coordinator``: DCP's own gather and scatter around ``prepare_global_plan``
  and ``finish``).

A plug answers by method (``mark_committed``, ``restore_from``: an Orbax manager's items,
which only the key-value plug saves), never by a type test.

The key-value driver's saves (:class:`SaveRunner`): a save copies every addressable
shard once into the arena of the host that owns its device (replicated shards once)
through the one stager (``staging.copy_in``), hands the blocks on in lots and returns; a
shard still on its way from an accelerator (a ``DeviceCopy``) is copied by the stager
thread once it has landed, after the save returned. One finisher (on a thread of
``finishers.FINISHERS``, kept from save to save) then drives the
step's ``save_run.SaveRun`` (begin, stage the lots, finish: replicate, prepared, commit
or abort, mark committed) and ends it (``durable``, ``replicated``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import functools
import json
import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import registry as formats_lib, spec as spec_lib
from sidecar._src.ckptfmt.records import ShardRecord
from sidecar._src.controller.checkpoint import finishers as finishers_lib
from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.controller.checkpoint.coordination import KeyValue
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.checkpoint.restore import Restorer, RestoreStats
from sidecar._src.controller.checkpoint.save_protocol import SaveProtocol, Target
from sidecar._src.controller.checkpoint.save_run import Ending, SaveRun
from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot
from sidecar._src.controller.checkpoint.staging import Lots, ShardCopy, allocate, copy_in
from sidecar._src.controller.framework import DeviceCopy, Framework
from sidecar._src.controller.peers import Peers
from sidecar._src.core import errors, interrupts

log = logging.getLogger(__name__)
NUMPY_KEEP_BYTES = 64 << 20  # the most numpy values a save copies for a device rollback


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
  """What a driver is made with, from its Checkpointer (nothing read back from
  the Checkpointer itself).

  Attributes:
    site: the sidecars it saves on and restores from (their hosts, the client).
    directory: the checkpoint directory (absolute).
    options: the checkpointer's options (the format's choice, replica bandwidth).
    replicas: replica copies per shard (as many as there are other hosts, at most);
      ``placement``: each host's replica hosts.
    steps: the committed steps, as the Checkpointer lists them now.
  """
  site: SidecarsSnapshot
  directory: str
  options: CheckpointOptions
  replicas: int
  placement: Mapping[int, Sequence[int]]
  steps: Callable[[], list[int]]


class Driver(abc.ABC):
  """Who drives a save's sequence on the sidecars, how the trainer processes coordinate
  them, and how a step is restored (see the module). Not the sidecars' agreement on a
  commit (``server/checkpoint/agreement.py``): a driver's processes only exchange keys."""

  @abc.abstractmethod
  def target(self, directory: str, step: int) -> Target:
    """Where step ``step`` of ``directory`` goes, in the layout of the format it saves."""

  @abc.abstractmethod
  def start(self, target: Target, tree: Any, *, data_state_json: str, ending: Ending
            ) -> None:
    """Copies ``tree`` into the arenas (returns once this process's copy is made or on its
    way: ``ending.handle.staged`` resolves when staged) and writes ``target`` in the
    background, one ``save_run.SaveRun``, which a thread of the save (not the caller's)
    ends once (``SaveRun.end``) when the step is committed (and the RAM tiers told) or the
    save failed. ``ending.key``: the prefix of the save's keys between the processes."""

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers that ``target`` (an item another commits) is visible."""
    del target
    raise errors.InvalidArgumentError(
        "this checkpointer saves through DCP's coordinator: items of an Orbax manager "
        "need ctl.checkpointer")

  def restore_from(self, final_dir: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    """Restores the committed item at ``final_dir`` onto ``target``."""
    del final_dir, step, target, progress
    raise errors.InvalidArgumentError(
        "this checkpointer saves through DCP's coordinator: items of an Orbax manager "
        "need ctl.checkpointer")

  @abc.abstractmethod
  def restore(self, step: int, target: Any, *, progress: Callable[[str], None] | None
              ) -> Any:
    """Restores committed step ``step`` onto ``target``; returns the restored tree."""

  def restore_taken_over(self, step: int, target: Any) -> tuple[Any, dict[str, Any] | None]:
    """Restores step ``step``, which the sidecars took over (durable or not), from their
    RAM tiers onto ``target``; returns the tree and its data position. A plug whose
    steps its trainers commit has none: it raises."""
    del step, target
    raise errors.InvalidArgumentError(
        "this checkpointer's saves are committed by its trainers (DCP's coordinator): a "
        "step not durable yet cannot be restored; restore a committed step")

  def restore_on_device(self, step: int, target: Any
                        ) -> tuple[Any, dict[str, Any] | None] | None:
    """Restores step ``step``, a save in flight not staged yet, from the copies it still
    holds on this process's devices onto ``target``; returns the tree and its data
    position, or None where they do not make the whole of it (then nothing is
    restored). By default None: a plug that keeps no device copies."""
    del step, target
    return None

  def last_restore_stats(self) -> Any:
    """Where the latest restore's shards came from (None: not known)."""
    return None

  def data_state(self, step: int) -> dict[str, Any] | None:
    """The data position saved with ``step``, or None."""
    del step
    return None

  @abc.abstractmethod
  def join(self) -> None:
    """Waits until every save it started has called its ``end`` (Ctrl-C stops the wait)."""

  def follow(self, setup: Setup) -> Driver:
    """This plug on ``setup``'s hosts, the controller's live hosts now (one was lost, or
    came back); the saves this one started are joined by the one returned. By default
    itself: a plug that asks the controller for its sidecars at each save follows them
    already (DCP's makes a ``StorageWriter`` for each save)."""
    del setup
    return self


class KeyValueDriver(Driver):
  """JAX's and the numpy core's: :class:`SaveRunner` stages this process's shards,
  process 0 begins and commits, the processes coordinate through their key-value store; a
  restore reads each shard from a live copy (``restore.Restorer``)."""

  def __init__(self, runner: SaveRunner, restorer: Restorer, *,
               make: Callable[[Setup], KeyValueDriver]):
    self.runner, self._restorer, self._make = runner, restorer, make
    self._last: RestoreStats | None = None

  def target(self, directory: str, step: int) -> Target:
    """Step ``step`` of ``directory`` as Begin takes it, in the chosen format's layout."""
    return Target.for_step(self.runner.fmt, directory, step)

  def start(self, target: Target, tree: Any, *, data_state_json: str, ending: Ending
            ) -> None:
    self.runner.save_to(target, tree, data_state_json=data_state_json, ending=ending)

  def mark_committed(self, target: Target) -> None:
    self.runner.mark_committed(target)

  def restore(self, step: int, target: Any, *, progress: Callable[[str], None] | None
              ) -> Any:
    return self.restore_from(self.target(self.runner.directory, step).final_dir,
                             step, target, progress=progress)

  def restore_from(self, final_dir: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    tree, self._last = self._restorer.restore(final_dir, step, target, progress=progress)
    return tree

  def restore_taken_over(self, step: int, target: Any) -> tuple[Any, dict[str, Any] | None]:
    tree, self._last = self._restorer.restore(
        self.target(self.runner.directory, step).final_dir, step, target, taken_over=True)
    return tree, self._last.data_state

  def restore_on_device(self, step: int, target: Any
                        ) -> tuple[Any, dict[str, Any] | None] | None:
    held = self.runner.on_device
    if held is None or held.step != step:
      return None
    t0 = time.perf_counter()
    tree = self.runner._framework.restore_on_device(target, held.copies)
    if tree is None:
      return None
    data_state = json.loads(held.data_state_json) if held.data_state_json else None
    self._last = RestoreStats(step, time.perf_counter() - t0, {"device": len(held.copies)},
                              {"device": sum(c.nbytes for _, c in held.copies)}, data_state)
    return tree, data_state

  def last_restore_stats(self) -> RestoreStats | None:
    return self._last

  def data_state(self, step: int) -> dict[str, Any] | None:
    r = self.runner
    return interrupts.wait(r.client.info(
        r.local[0], self.target(r.directory, step).final_dir)).data_state

  def join(self) -> None:
    for finisher in list(self.runner.finishers):
      if not finisher.on_this_thread():
        while finisher.is_alive():  # a join Ctrl-C can stop
          finisher.join(interrupts.POLL_S)
          interrupts.check()

  def follow(self, setup: Setup) -> KeyValueDriver:
    """A new runner and restorer on ``setup``'s hosts; the saves still running on the
    old hosts are this one's finishers, which the new one joins."""
    new = self._make(setup)
    new.runner.finishers = [t for t in self.runner.finishers if t.is_alive()]
    new._last = self._last
    return new


def key_value_driver(*, options: CheckpointOptions, peers: Peers, framework: Framework
                     ) -> Callable[[Setup], Driver]:
  """Makes ``ctl.checkpointer``'s driver: the key-value driver over ``framework``, on
  the setup's sidecars, in the format ``options`` choose (stock Orbax's by default)."""

  def plug(setup: Setup) -> KeyValueDriver:
    site = setup.site
    hosts, local = list(site.hosts), list(site.local)
    runner = SaveRunner(
        client=site.client, directory=setup.directory, hosts=hosts, local=local,
        device_hosts=site.device_hosts, peers=peers, replicas=setup.replicas,
        placement=setup.placement, replica_bandwidth=options.bandwidth,
        framework=framework, format=options.format_for("JAX", default=formats_lib.ORBAX),
        writers=site.writers)
    restorer = Restorer(client=site.client, directory=setup.directory, hosts=hosts,
                        local=local, device_hosts=dict(site.device_hosts),
                        mapped=set(site.mapped),
                        ask_all=bool(setup.replicas) or peers.count == 1,
                        framework=framework)
    return KeyValueDriver(runner, restorer, make=plug)

  return plug


@dataclasses.dataclass(frozen=True, slots=True)
class OnDevice:
  """A save's shards still on their way from this process's devices (its late
  ``DeviceCopy``s) and its host values as saved (:func:`kept_numpy_values`), held until the
  save is staged: till then a rollback restores the step from them
  (``Driver.restore_on_device``), not waiting for the copy; with its data position."""
  step: int
  copies: tuple[tuple[ShardRecord, DeviceCopy | np.ndarray], ...]
  data_state_json: str

  def release(self) -> None:
    """The save is staged (or failed): each copy lets its device buffers go as they land."""
    for _, copy in self.copies:
      if isinstance(copy, DeviceCopy):
        copy.release()


def kept_numpy_values(host: Sequence[tuple[ShardRecord, np.ndarray]]
                     ) -> tuple[tuple[ShardRecord, np.ndarray], ...]:
  """Copies of a save's host values, for a rollback from the devices; none past
  :data:`NUMPY_KEEP_BYTES` (each save pays them: such a state rolls back from the RAM tier)."""
  if sum(data.nbytes for _, data in host) > NUMPY_KEEP_BYTES:
    return ()
  return tuple((record, np.array(data, copy=True)) for record, data in host)


def _mib(nbytes: int) -> str:
  """``nbytes`` rounded up to whole MiB, as --shm-size takes it."""
  return f"{-(-nbytes // (1 << 20))}MiB"


class SaveRunner:
  """Runs saves: stages this process's shards, then commits with the others or aborts.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute).
    hosts: every sidecar host; ``local``: those this process stages into.
    device_hosts: the host of each device id.
    peers: the trainer processes; process 0 begins, commits and aborts.
    replicas: replica copies per shard; ``placement``: each host's replica hosts (by host
      id: each sidecar knows their addresses); ``replica_bandwidth``: bytes/s, or None.
    framework: describes a state tree's shards (which this process saves).
    format: the format the sidecars write (``CheckpointOptions.format_for`` chose it).
    writers: the processes that stage into each host, where several share one (each
      sends its own parts; the host's step is whole once all of them have).
  """

  def __init__(self, *, client: CheckpointTransport, directory: str, hosts: list[int],
               local: list[int], device_hosts: Mapping[int, int], peers: Peers,
               replicas: int, placement: Mapping[int, Sequence[int]],
               replica_bandwidth: int | None, framework: Framework, format: str,
               writers: Mapping[int, Sequence[int]] | None = None):
    self._framework = framework
    self.client, self.directory, self._hosts, self.local = client, directory, hosts, local
    self._device_hosts, self._peers = device_hosts, peers
    self._lead = peers.index == 0
    self._replicas, self._placement = replicas, placement
    self._replica_bandwidth = replica_bandwidth
    self.fmt = formats_lib.DEFAULT.get(format)  # its layout: where a step's Target goes
    self._protocol = SaveProtocol(client=client, directory=directory, format=format,
                                  writers=writers)
    # Every save's finisher that may still run: one copies and commits while the trainer
    # goes on; ``close`` joins them.
    self.finishers: list[finishers_lib.Finishing] = []
    self.on_device: OnDevice | None = None  # the latest save's copies on the devices

  def save_to(self, target: Target, tree: Any, *, data_state_json: str,
              ending: Ending) -> None:
    """Copies ``tree`` into the arenas; the sidecars write and commit ``target`` (one
    :class:`~sidecar._src.controller.checkpoint.save_run.SaveRun`, which the finisher
    thread drives and ends: ``plugs.Driver.start``)."""
    run = self.run(target, ending)
    # Parts go to the sidecars while the copy goes on: their writes overlap the rest
    # of the copy.
    staged: queue.SimpleQueue = queue.SimpleQueue()  # the lots, as copied
    lots = Lots(self.local, staged.put)
    try:
      specs, copies, host = self._plan(tree)
      need = self._check_fits(copies)
    except BaseException as e:
      if self._peers.count > 1:  # the other processes wait for this one's part: tell them
        staged.put(e)
        self._start_finisher(run, lots, staged, [], data_state_json).join()
      raise
    self._hold(target.step, copies, host, data_state_json, ending)  # till it is staged
    del host
    finisher = self._start_finisher(run, lots, staged, specs, data_state_json)
    try:
      self._allocate(copies, need)
    except BaseException as e:
      copies.clear()  # The traceback keeps this frame: let the blocks go.
      lots.fail(e.with_traceback(None))  # the save is aborted
      finisher.join()  # and its files are gone before the caller can retry the step
      raise
    try:
      lots.stager = copy_in(copies, lots)
    except BaseException:  # copy_in failed the lots: the save is aborted
      finisher.join()
      raise
    # The finisher joins the stager, if any. With nothing left to copy from a device, the
    # save returns once staged: every host then took the step over (its sidecars commit
    # it whatever happens to this process), or it failed (said by ``durable``).
    if lots.stager is None:
      interrupts.wait_done(ending.handle.staged)

  def _hold(self, step: int, copies: list[ShardCopy], host: list[tuple[ShardRecord, Any]],
            data_state_json: str, ending: Ending) -> None:
    """Holds the save's late copies (on the devices still) until it is staged, and copies
    of its ``host`` values (the trainer's arrays, which it may change once it returned)."""
    late = tuple((c.record, c.data) for c in copies if isinstance(c.data, DeviceCopy))
    if not late:
      return
    self.on_device = OnDevice(step, late + kept_numpy_values(host), data_state_json)
    # The callback stays with the handle (a Future keeps its callbacks): it lets go of
    # the copies once run, so that a copy that failed holds no device buffer after it.
    box: list[OnDevice | None] = [self.on_device]

    def staged(_: concurrent.futures.Future) -> None:
      held, box[0] = box[0], None
      if held is None:
        return
      held.release()
      if self.on_device is held:
        self.on_device = None
    ending.handle.staged.add_done_callback(staged)

  def run(self, target: Target, ending: Ending | None) -> SaveRun:
    """The save of ``target``: this process stages its own hosts, the processes
    coordinate through their key-value store (``ending.key``'s)."""
    key = ending.key if ending is not None else ""
    return SaveRun(self._protocol, target, hosts=self._hosts, local=self.local,
                   placement=self._placement, bandwidth=self._replica_bandwidth,
                   coordination=KeyValue(self._peers, key, self.local), ending=ending)

  def _allocate(self, copies: list[ShardCopy], need: Mapping[int, int]) -> None:
    """An arena block for each shard to copy: one request per host."""
    for host in self.local:
      try:
        allocate(self.client.empty_like, copies, host)
      except errors.ResourceExhaustedError as e:
        if isinstance(e, errors.BusyError):
          raise
        raise errors.ResourceExhaustedError(
            f"the state does not fit host {host}'s arena now ({shm.format_size(need[host])} "
            f"to copy there): {e}; nothing was kept") from None

  def _plan(self, tree: Any) -> tuple[list[spec_lib.LeafSpec], list[ShardCopy],
                                      list[tuple[ShardRecord, np.ndarray]]]:
    """Leaf specs, a :class:`ShardCopy` for every shard to copy, each once, and the
    shards of the host values (on no device) as this process holds them, process 0's
    saved or not (``_hold`` keeps them for a rollback).

    The framework says which shards this process saves (of replicated ones only
    replica 0, by the process that holds it), each with its record; the plan only
    chooses the host that stages it: the host of its device, or, for those on no
    device, process 0's first host.
    """
    specs, plan, host_values = [], [], []
    for i, leaf in enumerate(self._framework.save_leaves(tree)):
      specs.append(leaf.spec)
      for shard in leaf.shards:
        r = shard.record
        if (r.leaf, r.key_path, r.host) != (i, leaf.spec.key_path, None):
          raise errors.InvalidArgumentError(
              f"leaf {i} {leaf.spec.param_name!r} has a shard whose record names leaf "
              f"{r.leaf} {list(r.key_path)} and host {r.host}: a framework's save_leaves "
              "records each shard as ShardRecord.of(ShardId(key_path, index), the leaf's "
              "number, data), its host None (the save chooses it)")
        if shard.device_id is None:
          if isinstance(shard.data, np.ndarray):
            host_values.append((shard.record, shard.data))
          if self._lead:
            plan.append(ShardCopy(shard.record.on(self.local[0]), shard.data))
          continue
        host = self._device_hosts.get(shard.device_id)
        if host is None:
          raise errors.InvalidArgumentError(
              f"leaf {leaf.spec.param_name!r} has a shard on device {shard.device_id}, which "
              "no sidecar host declares (sidecar serve --device-ids)")
        if host not in self._hosts:
          raise errors.HostLostError(
              f"leaf {leaf.spec.param_name!r} has a shard on device {shard.device_id} of "
              f"host {host}, which is lost (the live hosts: {self._hosts}): save a state "
              "on the live hosts' devices, a mesh of sidecar.elastic.devices(ctl, hosts) as "
              "the retried function builds it", host_id=host)
        plan.append(ShardCopy(shard.record.on(host), shard.data))
    return specs, plan, host_values

  def _check_fits(self, copies: list[ShardCopy]) -> dict[int, int]:
    """The arena bytes the copies take on each host; raises where they exceed a whole arena
    (no rpc while the trainer waits: an arena too full now fails the copy's allocation)."""
    need: dict[int, int] = {}
    for c in copies:
      need[c.host] = need.get(c.host, 0) + -(-max(c.nbytes, 1) // shm.PAGE) * shm.PAGE
    short = {h: (n, size) for h, n in need.items()
             if (size := self.client.arena_size(h)) is not None and n > size}
    if short:
      detail = "; ".join(f"host {h} needs {shm.format_size(n)}, its arena is "
                         f"{shm.format_size(size)}" for h, (n, size) in short.items())
      most = max(n for n, _ in short.values())
      keep = 2 + self._replicas  # this save, the last committed step, R others' replicas
      raise errors.ResourceExhaustedError(
          f"the state does not fit the arenas ({detail}); nothing was copied. This save "
          f"alone needs --shm-size {_mib(most)} (LocalCluster's shm_size=\"{_mib(most)}\"); "
          f"saving on while training needs about --shm-size {_mib(keep * most)}: "
          f"{keep} x {shm.format_size(most)}, assuming the default ram_steps=1 (the last "
          "committed step stays in the arena beside the next save)"
          + (f" and replicas={self._replicas} (as many other hosts' parts held here)"
             if self._replicas else "")
          + ", plus the bytes of the batches your feeds prefetch")
    return need

  def _start_finisher(self, run: SaveRun, lots: Lots, staged: queue.SimpleQueue,
                      leaves: list, data_json: str) -> finishers_lib.Finishing:
    finisher = finishers_lib.FINISHERS.submit(
        functools.partial(self._finish, run, lots, staged, leaves, data_json),
        name=f"sidecar-save-{run.step}")
    self.finishers = [t for t in self.finishers if t.is_alive()] + [finisher]
    return finisher

  def _finish(self, run: SaveRun, lots: Lots, staged: queue.SimpleQueue,
              leaves: list[spec_lib.LeafSpec], data_json: str) -> None:
    """The finisher: begins the step, stages this process's lots, finishes the run
    with the others (commit or abort), then ends it (``durable``, ``replicated``)."""
    try:
      error: BaseException | None = None
      try:
        run.begin()
        run.stage(staged, leaves=leaves, data_state_json=data_json)
      except BaseException as e:  # every process must reach the commit's exchange
        error = e.with_traceback(None)  # its frames would hold the staged blocks
      try:
        run.finish(error, leaves=leaves, data_state_json=data_json)
        error = None
      except BaseException as e:  # the save failed: its futures say why
        error = e
      run.end(error)
    finally:
      if lots.stager is not None:
        lots.stager.wait()  # done, or copying what nobody will stage

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers the step is visible (an Orbax manager's commit)."""
    self._protocol.mark_committed(target, self.local)
