"""``ctl.checkpointer``: saves that stall the trainer for one copy, restores from RAM or disk.

A save copies every addressable shard once into the arena of the host that owns
its device (replicated shards once), hands the blocks to the sidecars (``staged``)
and returns. The sidecars write their parts in stock Orbax's layout in their own
processes; the controller commits once every host is prepared (``durable``). A
step is listed only after its commit; a crash anywhere before leaves it invisible.

With ``replicas=R`` each sidecar also sends its shards to R peer sidecars once they
are staged (on other slices first, else the next hosts in host order), sidecar to
sidecar (``replicated``). A restore takes each shard from wherever a live copy is:
the arena of the host that staged it, a peer's replica, storage last; it checks
each crc32c and says where the shards came from (:meth:`Checkpointer.last_restore_stats`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.spec import KeyPath
from sidecar._src.controller import display, elastic as elastic_lib, progress as progress_lib
from sidecar._src.controller.checkpoint import ram_drop
from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.checkpoint.restore import Restorer, RestoreStats
from sidecar._src.controller.checkpoint.retention import Retention
from sidecar._src.controller.checkpoint.save import SaveCoordinator
from sidecar._src.controller.checkpoint.target import (
  SaveHandle,
  Target,
  done_handle,
  replica_hosts,
)
from sidecar._src.controller.framework import Framework, HostArrays
from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import errors, interrupts

__all__ = ["CheckpointOptions", "Checkpointer", "KeyPath", "RestoreStats", "SaveHandle", "Target",
           "replica_hosts"]

log = logging.getLogger(__name__)


class Checkpointer:
  """Made by ``Controller.checkpointer``; see there.

  It reaches the sidecars only through ``client``, a :class:`CheckpointTransport` (one
  typed method per phase of the ``Checkpoint`` service): the Controller's gRPC
  :class:`~sidecar._src.controller.checkpoint.client.CheckpointClient`, or an in-process
  fake in unit tests. Trees of a framework's arrays reach it through ``framework``
  (``controller/framework.py``): the shards to save, the blocks to restore.

  Under N trainer processes (one per host) every process makes the same calls. Each
  stages the shards it holds (``replica_id == 0``) into its own sidecar; process 0
  begins each step, gathers every process's prepared and commits once, sweeps and
  deletes old steps; the others learn the outcome through ``peers``.
  """

  def __init__(self, *, directory: str, client: CheckpointTransport,
               hosts: list[int], device_hosts: dict[int, int], max_to_keep: int | None,
               keep_period: int | None, ram_steps: int,
               ram_budget: int | None, if_busy: str, sweep: bool = True,
               local_hosts: Sequence[int] | None = None, peers: Peers | None = None,
               key: str = "ckpt", replicas: int = 0,
               sidecars: dict[int, dict[str, Any]] | None = None, mapped: Sequence[int] = (),
               replica_bandwidth: int | str | None = None, framework: Framework | None = None,
               writers: Mapping[int, Sequence[int]] | None = None):
    options = CheckpointOptions(max_to_keep=max_to_keep, keep_period=keep_period,
                                replicas=replicas, ram_steps=ram_steps, ram_budget=ram_budget,
                                replica_bandwidth=replica_bandwidth, if_busy=if_busy)
    replica_bandwidth = options.bandwidth
    if replicas > len(hosts) - 1:  # e.g. an elastic job down to fewer hosts than it planned
      log.warning("replicas=%d, but there are %d hosts: each shard gets %d peer copies",
                  replicas, len(hosts), max(len(hosts) - 1, 0))
      replicas = max(len(hosts) - 1, 0)
    sidecars = sidecars or {}
    if replicas and set(sidecars) != set(hosts):
      raise errors.InvalidArgumentError(
          f"replicas={replicas} needs every sidecar's address: sidecars names hosts "
          f"{sorted(sidecars)}, the hosts are {sorted(hosts)}")
    slices = {h: int(sidecars.get(h, {}).get("slice_id", 0)) for h in hosts}
    placement = {h: replica_hosts(slices, h, replicas) for h in hosts}
    self._last_restore: RestoreStats | None = None
    # Absolute here: the sidecars' working directory is not the trainer's.
    self.directory = os.path.abspath(directory)
    self._client = client  # the sidecars, one typed method per phase
    self._local = list(hosts if local_hosts is None else local_hosts)  # hosts we stage into
    self._peers = peers if peers is not None else LocalPeers()
    framework = framework if framework is not None else HostArrays()
    self._key, self._restores = key, 0
    self._lead = self._peers.index == 0  # begins, commits, sweeps and deletes, once
    self._if_busy = if_busy
    opened = [interrupts.wait(f) for f in [
        client.open(h, self.directory, ram_steps=ram_steps, ram_budget=ram_budget,
                    sweep=sweep and self._lead) for h in self._local]]
    # Nobody begins a step before process 0's sweep is over; all list what it lists.
    steps = self._peers.broadcast(f"{key}/open", json.dumps(opened[0]))
    self._retention = Retention(client=client, directory=self.directory, local=self._local,
                                lead=self._lead, max_to_keep=max_to_keep,
                                keep_period=keep_period, steps=list(json.loads(steps)))
    self._coordinator = SaveCoordinator(
        client=client, directory=self.directory, hosts=hosts, local=self._local,
        device_hosts=device_hosts, peers=self._peers, key=key, replicas=replicas,
        placement=placement, replica_bandwidth=replica_bandwidth,
        list_step=self._retention.add, collect_garbage=self._retention.collect,
        framework=framework, writers=writers)
    self._restorer = Restorer(client=client, directory=self.directory, hosts=hosts,
                              local=self._local, device_hosts=device_hosts, mapped=set(mapped),
                              ask_all=bool(replicas) or self._peers.count == 1,
                              steps=self.all_steps, framework=framework)
    self._in_flight: SaveHandle | None = None
    self._saving: set[int] = set()  # steps a save() of this process is copying now
    self._saving_lock = threading.Lock()
    self._closed = False

  # ---- save --------------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the save is aborted and swept, or left to finish
  def save(self, step: int, tree: Any, *, data_state: dict[str, Any] | None = None
           ) -> SaveHandle:
    """Copies ``tree`` into the arenas and returns; the sidecars persist it.

    At most one save is in flight: with ``if_busy="wait"`` this waits for the
    previous one to be durable, with ``"skip"`` it returns a handle whose futures
    hold None and saves nothing.
    """
    self._check_open()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise errors.InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
    with self._saving_lock:  # two threads saving one step: the second would break both
      if step in self._saving:
        raise errors.InvalidArgumentError(
            f"step {step} is being saved already (another save({step}) of this checkpointer "
            "runs now); save each step once, from one thread")
      self._saving.add(step)
    try:
      return self._save(step, tree, data_state)
    finally:
      with self._saving_lock:
        self._saving.discard(step)

  def _save(self, step: int, tree: Any, data_state: dict[str, Any] | None) -> SaveHandle:
    previous = self._in_flight
    busy = previous is not None and not previous.durable.done()
    if self._peers.count > 1:  # every process must take the same decision on the same step
      busy = self._coordinator.agree_on_save(step, busy)
    if busy:
      if self._if_busy == "skip":
        return done_handle(step, None)
      if previous is not None:  # busy may be another process's save
        interrupts.wait_done(previous.durable)
    if step in self.all_steps():
      raise errors.InvalidArgumentError(f"step {step} is already saved in {self.directory}")
    handle = self.save_to(Target.for_step(self.directory, step), tree, data_state=data_state)
    self._in_flight = handle
    elastic_lib.at_save(handle)  # under retry(grow=True): hosts back end the attempt here
    return handle

  def save_to(self, target: Target, tree: Any, *, data_state: dict[str, Any] | None = None
              ) -> SaveHandle:
    """Copies ``tree`` into the arenas; the sidecars write and commit ``target``."""
    return self._coordinator.save_to(target, tree, data_state=data_state)

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers the step is visible; lists it."""
    self._coordinator.mark_committed(target)

  # ---- restore -----------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the reads in flight are dropped, their blocks go back
  def restore(self, step: int | None = None, *, target: Any,
              progress: Callable[[str], None] | bool | None = None) -> Any:
    """Restores ``step`` (default: the latest) onto the shardings of ``target``.

    ``target`` is a pytree of ``jax.ShapeDtypeStruct``s with shardings, or of concrete
    arrays (their shardings are used). Takes each shard from a live copy: the arena
    of the host that staged it, else a peer's replica (``replicas=R``), else storage,
    checking its crc32c; a copy that fails its check or whose host is gone falls back
    to the next. Reshards when the target mesh differs from the one saved. Where the
    shards came from: :meth:`last_restore_stats`, and a line at INFO.
    With ``progress`` (``print``, say), a restore past a second reports its progress; by
    default (None) on a tqdm line where one is seen (a terminal, a notebook).

    Raises:
      ShardsLostError: some shard has no live copy and no valid stored one.
      ResourceExhaustedError: an arena had no room for a shard read from storage within
        the deadline (the data is intact: drop trees restored before, or a larger
        ``--shm-size``).
    """
    self._check_open()
    step = self._pick(step)
    if self._peers.count > 1:  # process 0 decides which step; every process restores it
      self._restores += 1
      step = int(self._peers.broadcast(f"{self._key}/restore/{self._restores}",
                                       str(step) if self._lead else None))
    with progress_lib.lines(progress, f"restoring step {step}") as report:
      return self.restore_from(Target.for_step(self.directory, step).final_dir, step, target,
                               progress=report)

  def last_restore_stats(self) -> RestoreStats | None:
    """Where the shards of this process's latest successful restore came from."""
    return self._last_restore
  def restore_from(self, final_dir: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    """Restores the committed item at ``final_dir`` onto ``target``'s shardings."""
    tree, self._last_restore = self._restorer.restore(final_dir, step, target,
                                                      progress=progress)
    log.info("%s of %s", self._last_restore.summary(), self.directory)
    return tree

  def data_state(self, step: int | None = None) -> dict[str, Any] | None:
    """The data position saved with ``step`` (default: the latest), or None."""
    step = self._pick(step)
    return interrupts.wait(self._client.info(
        self._local[0], Target.for_step(self.directory, step).final_dir)).data_state

  def _pick(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise errors.InvalidArgumentError(f"no committed step in {self.directory} to restore")
      return steps[-1]
    if step not in steps:
      raise errors.InvalidArgumentError(
          f"step {step} does not exist in {self.directory}; committed steps: {steps or 'none'}")
    return step

  # ---- listing and lifecycle ---------------------------------------------

  def all_steps(self) -> list[int]:
    return self._retention.all()

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  @interrupts.deferring  # Ctrl-C stops the wait; the save goes on
  def wait(self, *, progress: Callable[[str], None] | bool | None = None) -> None:
    """Waits until the save in flight (if any) is durable, and the older steps it
    makes ``max_to_keep`` drop are deleted (and, with replicas, until its replication
    has ended, done or failed: ``handle.replicated`` says which); raises its error.

    With ``progress`` (``print``, say), a wait longer than a second reports the bytes
    the sidecars have made durable, and the rate, once a second; by default (None) on
    a tqdm line where one is seen (a terminal, a notebook); ``False``: never.
    """
    handle = self._in_flight
    if handle is None:
      return
    with progress_lib.lines(progress, f"saving step {handle.step}") as report:
      while report is not None and not handle.durable.done():
        try:
          interrupts.wait_done(handle.durable, timeout=1.0)
        except concurrent.futures.TimeoutError:
          if line := self._progress_line(handle.step):
            report(line)
    interrupts.wait_done(handle.durable)
    self._join_finisher()  # and the older steps max_to_keep drops are gone
    handle.durable.result()

  def _join_finisher(self, *, every: bool = False) -> None:
    """Joins the latest save's finisher; ``every``: those of older saves too."""
    finishers = self._coordinator.finishers if every else [self._coordinator.finisher]
    for finisher in finishers:
      if finisher is not None and finisher is not threading.current_thread():
        while finisher.is_alive():  # a join Ctrl-C can stop
          finisher.join(interrupts.POLL_S)
          interrupts.check()

  def _progress_line(self, step: int) -> str | None:
    """How much of ``step`` is durable; None until a sidecar has begun writing it."""
    done = total = 0
    seconds = 0.0
    for s in self._client.status():
      for c in s.checkpoints:
        if c.directory == self.directory and step in c.writing:
          done, total = done + c.written_bytes, total + c.total_bytes
          seconds = max(seconds, c.writing_s)
    if not total:
      return None
    rate = done / seconds / 1e9 if seconds else 0.0
    return (f"saving step {step}: {shm.format_size(done)} of {shm.format_size(total)} "
            f"durable ({rate:.2f} GB/s)")

  def drop_ram_tier(self) -> ram_drop.RamTierDrop:
    """Drops this directory's durable RAM-tier copies on the sidecars this process
    drives, at once (they also give way by themselves to new work that needs the arena);
    steps not durable yet stay (``kept``). Restores then read from storage.

    Example::

      ckpt.wait()
      print(ckpt.drop_ram_tier().describe())
    """
    self._check_open()
    return ram_drop.merged([interrupts.wait(self._client.drop_ram_tier(h, self.directory))
                            for h in self._local])

  def _check_open(self) -> None:
    if self._closed:
      raise errors.ClosedError("this checkpointer is closed")

  @interrupts.deferring
  def close(self) -> None:
    """Waits for the save in flight (and what older saves still settle: replication,
    deleting old steps), then closes; idempotent."""
    if self._closed:
      return
    try:
      self._join_finisher(every=True)
    finally:
      self._closed = True
      self._client.close()  # its busy retries, if any

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return display.text_block("sidecar checkpointer", *self._display())

  def _repr_html_(self) -> str:
    facts, table = self._display(html=True)
    return display.html_block("sidecar checkpointer", facts, table)

  def _display(self, html: bool = False) -> tuple[list[tuple[str, str]], str]:
    """Facts (no call), and each host's tiers for this directory (one bounded Status)."""
    facts = display.checkpointer_facts(self.directory, self.all_steps(), self._in_flight,
                                       self._last_restore, self._closed)
    if self._closed:
      return facts, ""
    try:
      rows = display.tier_rows(self._client.status(timeout=display.STATUS_TIMEOUT_S),
                               self.directory)
    except Exception as e:  # a display never raises
      rows = [["-", display.error_text(e), "", "", ""]]
    make = display.html_table if html else display.text_table
    return facts, make(display.TIER_HEADER, rows)
