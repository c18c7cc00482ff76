"""The key-value agreement's driver of the save protocol: :class:`SaveCoordinator`
(``plugs.KeyValueAgreement``'s, JAX's and the numpy core's).

A save copies every addressable shard once into the arena of the host that owns its
device (replicated shards once) through the one stager (``staging.copy_in``), hands the
blocks to the sidecars in parts (``staged``) and returns; a shard still on its way from an
accelerator (a ``HostCopy``) is copied by the stager thread once it has landed, after the
save returned. A finisher thread then begins the step (process 0's sidecar answers its
tmp directory), stages the parts, starts the replication, waits for every host's
writes (prepared) and commits once (process 0), or aborts everywhere, then hands the
save's end to the Checkpointer (``durable``, ``replicated``): the phases of
``save_protocol.SaveProtocol``, the processes agreeing through their key-value store
(``controller/peers.Peers``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import registry as formats_lib, spec as spec_lib
from sidecar._src.ckptfmt.records import ShardChecksum
from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.controller.checkpoint.save_protocol import (
  LONG_S,
  End,
  SaveProtocol,
  describe,
  resolve,
)
from sidecar._src.controller.checkpoint.staging import Lots, ShardCopy, allocate, copy_in
from sidecar._src.controller.checkpoint.target import SaveHandle, Target
from sidecar._src.controller.framework import Framework
from sidecar._src.controller.peers import Peers, sync_timeout
from sidecar._src.core import errors
from sidecar._src.wire import protocol

log = logging.getLogger(__name__)


def _mib(nbytes: int) -> str:
  """``nbytes`` rounded up to whole MiB, as --shm-size takes it."""
  return f"{-(-nbytes // (1 << 20))}MiB"


class SaveCoordinator:
  """Runs saves: stages this process's shards, then commits with the others or aborts.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute).
    hosts: every sidecar host; ``local``: those this process stages into.
    device_hosts: the host of each device id.
    peers: the trainer processes; process 0 begins, commits and aborts.
    replicas: peer copies per shard; ``placement``: each host's peers (by host id: each
      sidecar knows their addresses); ``replica_bandwidth``: bytes/s, or None.
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
    self.finishers: list[threading.Thread] = []

  def save_to(self, target: Target, tree: Any, *, data_state_json: str, key: str,
              handle: SaveHandle, end: End) -> None:
    """Copies ``tree`` into the arenas; the sidecars write and commit ``target``; ``end``
    (the Checkpointer's) ends the save (``plugs.Agreement.start``)."""
    # Parts go to the sidecars while the copy goes on: their writes overlap the rest
    # of the copy.
    parts: queue.SimpleQueue = queue.SimpleQueue()
    staging = Lots(self.local, parts)
    try:
      specs, copies = self._plan(tree)
      need = self._check_fits(copies)
    except BaseException as e:
      if self._peers.count > 1:  # the other processes wait for this one's part: tell them
        parts.put(e)
        self._start_finisher(handle, target, staging, [], data_state_json, key, end).join()
      raise
    finisher = self._start_finisher(handle, target, staging, specs, data_state_json, key, end)
    try:
      self._allocate(copies, need)
    except BaseException as e:
      copies.clear()  # The traceback keeps this frame: let the blocks go.
      staging.fail(e.with_traceback(None))  # the save is aborted
      finisher.join()  # and its files are gone before the caller can retry the step
      raise
    try:
      staging.stager = copy_in(copies, staging)
    except BaseException:  # copy_in failed the parts: the save is aborted
      finisher.join()
      raise
    # The finisher joins the stager, if any.

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

  def _plan(self, tree: Any) -> tuple[list[spec_lib.LeafSpec], list[ShardCopy]]:
    """Leaf specs, and a :class:`ShardCopy` for every shard to copy, each once.

    The framework says which shards this process saves (of replicated ones only
    replica 0, by the process that holds it); those on no device, process 0 copies
    into its first host.
    """
    specs, plan = [], []
    for i, leaf in enumerate(self._framework.save_leaves(tree)):
      specs.append(leaf.spec)
      for shard in leaf.shards:
        if shard.device_id is None:
          if self._lead:
            plan.append(ShardCopy(self.local[0], i, shard.index, shard.data))
          continue
        host = self._device_hosts.get(shard.device_id)
        if host is None:
          raise errors.InvalidArgumentError(
              f"leaf {leaf.spec.param_name!r} has a shard on device {shard.device_id}, which "
              "no sidecar host declares (sidecar serve --device-ids)")
        plan.append(ShardCopy(host, i, shard.index, shard.data))
    return specs, plan

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

  def _start_finisher(self, handle: SaveHandle, target: Target, staging: Lots,
                      leaves: list, data_json: str, key: str, end: End) -> threading.Thread:
    finisher = threading.Thread(target=self._finish,
                                args=(handle, target, staging, leaves, data_json, key, end),
                                daemon=True, name=f"sidecar-save-{handle.step}")
    self.finishers = [t for t in self.finishers if t.is_alive()] + [finisher]
    finisher.start()
    return finisher

  def _finish(self, handle: SaveHandle, target: Target, staging: Lots, leaves,
              data_json: str, key: str, end: End) -> None:
    """Stages this process's parts, then commits with the others (or aborts)."""
    try:
      self._finish_staged(handle, target, staging.parts, leaves, data_json, key, end)
    finally:
      if staging.stager is not None:
        staging.stager.wait()  # done, or copying what nobody will stage

  def _finish_staged(self, handle: SaveHandle, target: Target, parts: queue.SimpleQueue,
                     leaves, data_json: str, key: str, end: End) -> None:
    step, error, sums, replication = handle.step, None, [], None
    try:
      target = self._begin(target, key)
      self._protocol.stage(target, parts, hosts=self.local, leaves=leaves)
      handle.staged.set_result(step)
      replication = (self._protocol.start_replication(
          target, {h: self._placement[h] for h in self.local},
          bandwidth=self._replica_bandwidth) if self._replicas else None)
      if replication is not None and self._peers.count == 1:  # resolved as soon as done
        replication.add_done_callback(
            lambda f: resolve(handle.replicated, f.exception(), handle.step))
      sums = self._protocol.prepared(target, self.local)
    except BaseException as e:  # every process must reach the commit's agreement
      error = e.with_traceback(None)  # its frames would hold the staged blocks
    try:
      self._commit(target, key, leaves, sums, data_json, error)
    except BaseException as e:  # the save failed: its futures say why
      if not handle.staged.done():
        handle.staged.set_exception(e)
      error = e
    else:
      error = None

    def replicated() -> BaseException | None:
      if replication is None:
        return errors.InvalidArgumentError(f"step {step} was not replicated")
      return replication.exception()  # waits for it
    if error is None and target.whole_step:  # a part of a step (save_to): its caller's
      self.mark_committed(target)
    end(error, replicated, whole=target.whole_step)

  def _begin(self, target: Target, key: str) -> Target:
    """Process 0's sidecar creates the step's tmp directory; the others wait until it has.
    Returns ``target`` in the tmp directory ``begin`` answered (never one worked out
    here); an Orbax manager's item (not ``whole_step``) is in the manager's already."""
    if not self._lead:
      begun = json.loads(self._peers.read(f"{key}/begun", 0, timeout=sync_timeout()))
      if "error" in begun:
        raise errors.InvalidArgumentError(
            f"process 0 could not begin step {target.step}: {begun['error']}")
      return target.begun(begun["tmp"]) if begun["tmp"] else target
    try:
      tmp = (self._protocol.begin(self.local[0], self.directory, target.step)
             if target.whole_step else "")
    except BaseException as e:
      self._peers.publish(f"{key}/begun", json.dumps({"error": describe(e)}))
      raise
    self._peers.publish(f"{key}/begun", json.dumps({"tmp": tmp}))
    return target.begun(tmp) if tmp else target

  def _commit(self, target: Target, key: str, leaves: list[spec_lib.LeafSpec],
              sums: list[ShardChecksum], data_json: str,
              error: BaseException | None) -> None:
    """Process 0 gathers every process's prepared, then commits once or aborts.

    Every process gets here once per save, failed or not, so nobody waits for one
    that gave up. The save fails in every process if it failed in any. The others tell
    process 0 only which hosts they staged into: it asks those hosts for their checksums
    itself (a host's prepared is the checksums it keeps), so no checksum crosses between
    the trainer processes.
    """
    mine = json.dumps({"error": protocol.error_dict(error)} if error is not None
                      else {"ok": list(self.local)})
    if not self._lead:
      self._peers.publish(f"{key}/prepared", mine)
      failed = self._peers.read(f"{key}/outcome", 0, timeout=LONG_S)
      if error is not None:
        raise error
      if failed:
        raise _gathered(json.loads(failed), 0, f"the save of step {target.step} failed")
      return
    try:
      gathered = [json.loads(v) for v in self._peers.all_gather(
          f"{key}/prepared", mine, timeout=LONG_S)]
      failures = [(p, g["error"]) for p, g in enumerate(gathered) if "error" in g]
      if error is not None:
        raise error
      if failures:  # the first as it was raised (its kind, its host); the others noted
        p, first = failures[0]
        raise _gathered(first, p, f"the save of step {target.step} failed in process {p}"
                        + "".join(f"; also in process {q}: {d.get('type')}: "
                                  f"{str(d.get('message'))[:500]}" for q, d in failures[1:]))
      # A host that several processes share: asked once.
      others = sorted({int(h) for g in gathered for h in g["ok"]} - set(self.local))
      checksums = [*sums, *self._protocol.prepared(target, others)]
      self._protocol.commit(self.local[0], target, num_hosts=len(self._hosts),
                            checksums=checksums, leaves=leaves, data_state_json=data_json,
                            replicas=self._placement)
    except BaseException as e:
      self._protocol.abort(target, self._hosts)  # before anyone fails: a retry must not race
      self._peers.publish(f"{key}/outcome", json.dumps(protocol.error_dict(e)))
      raise
    self._peers.publish(f"{key}/outcome", "")

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers the step is visible."""
    self._protocol.mark_committed(target, self.local)


def _gathered(d: dict, process: int, note: str) -> errors.SidecarError:
  """The error another process gathered at the commit (``protocol.error_dict``): its
  kind and host as raised there, with ``note`` saying where the save failed."""
  error = protocol.error_from_dict(d, host=f"trainer process {process}")
  error.add_note(note)
  return error
