"""The one :class:`Checkpointer`, ``ctl.checkpointer``'s and ``sidecar.torch.Checkpointer``'s.

A save copies every shard this process saves once into the arena of the host that owns
its device (replicated shards once), hands the blocks to the sidecars (``staged``) and
returns. The sidecars write their parts in their own processes, in the format's layout
(stock Orbax's for ``ctl.checkpointer``, DCP's for ``sidecar.torch.Checkpointer``); the
step is committed once every host is prepared (``durable``). A step is listed only
after its commit; a crash anywhere before leaves it invisible.

With ``replicas=R`` each sidecar also sends its shards to R other sidecars once every
host's part is staged (on other slices first, else the next hosts in host order),
sidecar to sidecar (``replicated``; with R=0 it holds the step at once, as the other
futures do). A restore takes each shard from wherever a live copy is: the arena of the
host that staged it, a replica on another sidecar, storage last, each crc32c checked.

What differs between frameworks is in two plugs (``plugs.py``): the driver (who drives
a save's sequence and how the processes coordinate: JAX's key-value store, DCP's coordinator rank)
and the framework (how leaves are described, copied and rebuilt).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Self

from sidecar._src.ckptfmt.spec import KeyPath
from sidecar._src.controller import display, elastic as elastic_lib
from sidecar._src.controller.checkpoint import fallback as fallback_lib, holds, ram_drop
from sidecar._src.controller.checkpoint.coordination import same_step_any_busy
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.checkpoint.plugs import Driver, Setup, key_value_driver
from sidecar._src.controller.checkpoint.restore import RestoreStats
from sidecar._src.controller.checkpoint.retention import Retention
from sidecar._src.controller.checkpoint.save_failures import SaveFailures
from sidecar._src.controller.checkpoint.save_protocol import Target
from sidecar._src.controller.checkpoint.save_run import Durable, Ending, SaveHandle, done_handle
from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot, replica_hosts
from sidecar._src.controller.framework import Framework
from sidecar._src.controller.peers import Peers
from sidecar._src.core import (
  deprecation,
  errors,
  interrupts,
  progress as progress_lib,
)

__all__ = ["CheckpointOptions", "Checkpointer", "KeyPath", "RestoreStats", "SaveHandle", "Target",
           "replica_hosts"]

log = logging.getLogger(__name__)
# A save() that waited this long for the previous save (if_busy='wait') is logged.
BUSY_WARN_S = 0.5
# Where the Orbax manager's doors went (their old spellings warn until 0.4.0).
_ORBAX_MANAGER = deprecation.Moved(
    "sidecar.orbax.SidecarCheckpointHandler", note="an ocp.CheckpointManager's item; this "
    "checkpointer's own steps: save(step, tree) and restore(step, target)")


class Checkpointer:
  """Numbered steps of a training run under ``directory``, through the sidecars.

  Made by ``Controller.checkpointer`` (the key-value driver and the controller's
  framework: stock Orbax's layout) or ``sidecar.torch.Checkpointer`` (DCP's driver and
  layout); see there. Under N trainer processes every process makes the same calls.

  Args:
    directory: where the steps go, ``<directory>/<step>``.
    site: the sidecars (``Controller.checkpoint_sidecars()``): the checkpoint client,
      the hosts, which of them this process drives, where their replicas go.
    options: retention, RAM tier, replicas, ``if_busy``.
    peers: the trainer processes; process 0 decides what all do.
    driver: makes the driver (``plugs.Driver``) for this checkpointer, from what it is
      told (``plugs.Setup``).
    key: the prefix of this checkpointer's keys between the processes (the same in every
      process).
    sweep: whether process 0 removes uncommitted steps at open (False where an Orbax
      manager owns them).
  """

  def __init__(self, directory: str | os.PathLike, *, site: SidecarsSnapshot,
               options: CheckpointOptions, peers: Peers,
               driver: Callable[[Setup], Driver], key: str, sweep: bool = True):
    self.options = options
    # Absolute here: the sidecars' working directory is not the trainer's.
    self.directory = os.path.abspath(os.fspath(directory))
    self.site = site
    self._client = site.client  # the checkpoint calls on the sidecars
    self._local = list(site.local)  # the hosts this process stages into
    self._peers, self._key = peers, key
    self._lead = peers.index == 0  # begins, commits, sweeps and deletes, once
    # Replica placement, once for every framework (an elastic job down to fewer hosts
    # than it planned gets fewer replicas, with a warning).
    self.replicas = site.replicas(options.replicas)
    if self.replicas and set(site.handshakes) != set(site.hosts):
      raise errors.InvalidArgumentError(
          f"replicas={self.replicas} needs every sidecar's address: sidecars names hosts "
          f"{sorted(site.handshakes)}, the hosts are {sorted(site.hosts)}")
    self.placement = site.placement(self.replicas)
    # The job the sidecars hold the directory for (``_open``): every process's the same.
    self._job = holds.job_name(peers, key)
    opened = self._open(self._local, sweep=sweep and self._lead)
    # Nobody begins a step before process 0's sweep is over; all list what it lists.
    steps = self._peers.broadcast(f"{key}/open", json.dumps(opened[0]))
    self._retention = Retention(client=site.client, directory=self.directory,
                                local=self._local, lead=self._lead,
                                max_to_keep=options.max_to_keep,
                                keep_period=options.keep_period,
                                steps=list(json.loads(steps)))
    self._driver = driver(Setup(site=site, directory=self.directory, options=options,
                                replicas=self.replicas, placement=self.placement,
                                steps=self.all_steps))
    self._saves = self._asked = self._restores = self._asides = 0
    self.restored_step: int | None = None  # the step the latest restore() returned
    self._in_flight: SaveHandle | None = None
    # The saves that failed and are not settled yet (save_failures.py: the rule).
    self._failures = SaveFailures(self.directory, in_a_row=options.max_failed_saves,
                                  latest=self.latest_step)
    self._claims = holds.StepClaims(self.directory)  # the steps it is saving now
    self._closed = False
    self._goodput = site.goodput  # told how long save() and restore() block
    self._saved = site.saved  # the stall rule's (controller/startup.py)
    if self._goodput is not None:  # the first checkpointer's directory is the job's
      self._goodput.bind(self.directory)

  @classmethod
  def key_value(cls, directory: str | os.PathLike, *, site: SidecarsSnapshot,
                options: CheckpointOptions, peers: Peers, framework: Framework, key: str,
                sweep: bool = True) -> Checkpointer:
    """Deprecated: ``ctl.checkpointer(directory, ...)`` makes this Checkpointer (the
    key-value driver over the controller's framework)."""
    deprecation.warn("sidecar.jax.Checkpointer.key_value",
                     deprecation.Moved("ctl.checkpointer(directory)"))
    return cls(directory, site=site, options=options, peers=peers, key=key, sweep=sweep,
               driver=key_value_driver(options=options, peers=peers, framework=framework))

  def _open(self, hosts: list[int], *, sweep: bool) -> list[list[int]]:
    """Opens the directory on ``hosts`` for this job (another live job's open is refused);
    the committed steps each lists."""
    return holds.open_directory(self._client, hosts, self.directory, options=self.options,
                                  sweep=sweep, job=self._job, process=self._peers.index)

  def _follow(self) -> None:
    """Moves this checkpointer to the controller's live hosts where they changed since it
    last looked (a host lost, as under ``sidecar.elastic.retry``, or back): the next save
    and restore run there, with the replica placement of those hosts, and a host back
    (a new sidecar) has the directory opened. A save begun before a loss that fails is
    then told as a warning, never raised (:meth:`_failure`): the loss was handled (the
    retry's new attempt saves on the hosts left), and its older steps are still there."""
    live = self.site.live
    if live is None or self.site.now is None or live() == self.site.hosts:
      return
    site = self.site.now()
    if not site.local or site.hosts == self.site.hosts:  # none left here: calls say so
      return
    gone = sorted(set(self.site.hosts) - set(site.hosts))
    back = sorted(set(site.local) - set(self._local))
    if back:  # their sidecars are new: before any save reaches them
      self._open(back, sweep=False)
    replicas = site.replicas(self.options.replicas)
    placement = site.placement(replicas)
    self._driver = self._driver.follow(Setup(
        site=site, directory=self.directory, options=self.options, replicas=replicas,
        placement=placement, steps=self.all_steps))
    self._retention.rehost(site.local)
    if gone:
      self._failures.lost(gone)
    log.info("the checkpointer of %s saves on hosts %s now (lost: %s, back: %s), with %d "
             "replicas", self.directory, list(site.hosts), gone, back, replicas)
    self.site, self._local = site, list(site.local)
    self.replicas, self.placement = replicas, placement

  # ---- save --------------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the save is aborted and swept, or left to finish
  def save(self, step: int, tree: Any, *, data_state: dict[str, Any] | None = None
           ) -> SaveHandle:
    """Copies ``tree`` into the arenas and returns; the sidecars persist it as ``step``.

    At most one save is in flight: with ``if_busy="wait"`` this waits for the
    previous one to be durable, with ``"skip"`` it returns a handle whose futures
    hold None and saves nothing; every process takes the same decision.

    A save that failed in the background (its ``durable``: a full disk, an I/O error,
    a host lost) costs that save, not the run: it is logged at once, the next ``save``
    goes on, and the first that commits after it says so. ``max_failed_saves`` failed
    in a row (``CheckpointOptions``, default 3) end the run: the ``save`` after them
    raises the first one's error and saves nothing. ``wait`` and ``close`` raise a
    failure no later commit settled, once; one whose error its handle told
    (``durable.result()`` raised it, ``durable.exception()`` returned it) is not raised
    again (``save_failures.py``).

    Raises:
      InvalidArgumentError: ``step`` is committed already. A save never replaces a
        committed step, whatever the framework; a step not saved yet, lower than the
        latest, is saved.
      CheckpointWriteError (and the others ``durable`` holds): the last
        ``max_failed_saves`` saves of this checkpointer failed (its notes name their
        steps); this one was not begun.
    """
    self._check_open()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise errors.InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
    with self._claims.copying(step):
      t0 = time.perf_counter()
      release = self._claims.reserve(step, single_process=self._peers.count == 1)
      try:
        handle = self._save(step, tree, data_state)
      except BaseException:
        release(None)
        raise
      handle.durable.add_done_callback(release)
    skipped = handle.staged.done() and handle.staged.exception() is None \
        and handle.staged.result() is None
    if self._goodput is not None:
      self._goodput.saved(None if skipped else step, time.perf_counter() - t0)
    if self._saved is not None and not skipped:  # a step; its feeds' kept batches before it go
      self._saved(data_state)
    return handle

  def _save(self, step: int, tree: Any, data_state: dict[str, Any] | None) -> SaveHandle:
    self._follow()
    previous = self._in_flight
    busy = previous is not None and not previous.durable.done()
    # Every process must take the same decision on the same step: one exchange per
    # save() call, skipped or not (a skip reusing the next save's key read stale values).
    self._asked += 1
    busy = same_step_any_busy(self._peers, f"{self._key}/ask/{self._asked}", step, busy,
                              what=f"save {self._asked} in {self.directory}")
    if busy:
      if self.options.if_busy == "skip":
        return done_handle(step, None)
      if previous is not None:  # busy may be another process's save
        t0 = time.perf_counter()
        interrupts.wait_done(previous.durable)
        waited = time.perf_counter() - t0
        gone = self._failures.lost_with(previous)
        if gone is not None:  # not the storage: a save the loss of hosts cut short
          log.info("save(%d) in %s waited %.2f s for the save of step %d, begun before hosts "
                   "%s were lost, to end", step, self.directory, waited, previous.step, gone,
                   extra={"step": step})
        elif waited >= BUSY_WARN_S:  # the storage is slower than the saves come: say so
          log.warning(
              "save(%d) in %s waited %.2f s for step %d to be durable (if_busy='wait'): the "
              "training loop stood still meanwhile. The writes of one save take longer than "
              "the interval between saves (see the sidecar's log, 'step N: wrote ... in ... "
              "s'): save less often, or pass if_busy='skip'", step, self.directory, waited,
              previous.step, extra={"step": step})
    # Every process's earlier saves have ended here (busy is the processes' one decision):
    # all settle them alike, and all end the run alike (save_failures.py: the rule).
    self._failures.settle(hosts=self.site.hosts)
    if (error := self._failures.too_many(f"save({step})", step=step)) is not None:
      raise error
    if step in (steps := self.all_steps()):  # whatever the framework: never replaced
      raise errors.InvalidArgumentError(
          f"step {step} is already saved in {self.directory} (committed steps: {steps}); a "
          "save never replaces a committed step: to resume, restore the latest "
          f"(latest_step() is {steps[-1]}) and save the steps after it, or save this run "
          "in a new directory")
    handle = self._start(self._driver.target(self.directory, step), tree, data_state)
    self._in_flight = handle
    elastic_lib.at_save(handle)  # under retry(grow=True): hosts back end the attempt here
    return handle

  def _start(self, target: Target, tree: Any, data_state: dict[str, Any] | None
             ) -> SaveHandle:
    """Copies ``tree`` into the arenas; the sidecars write and commit ``target`` (a step of
    ``save``, or an Orbax manager's item: ``orbax_items.save_item``)."""
    if data_state is not None:
      try:
        data_json = json.dumps(data_state)
      except TypeError as e:
        raise errors.InvalidArgumentError(f"data_state must be JSON-serialisable: {e}") from None
    else:
      data_json = ""
    self._saves += 1
    key = f"{self._key}/save/{self._saves}"
    handle = SaveHandle(target.step, concurrent.futures.Future(), Durable())
    self._failures.begun(handle)
    if not self.replicas:  # the same for every framework: it holds the step at once
      handle.replicated.set_result(target.step)
    # The save's end (listed, durable, old steps deleted, replicated) runs on the save's
    # own thread (``SaveRun.end``); ``wait`` and ``close`` join it (``Driver.join``).
    try:
      self._driver.start(target, tree, data_state_json=data_json,
                            ending=Ending(handle, self._peers, key, self._retention))
    except BaseException:  # raised here: told, not to be raised again
      self._failures.not_begun(handle)
      raise
    return handle

  def save_to(self, target: Target, tree: Any, *, data_state: dict[str, Any] | None = None
              ) -> SaveHandle:
    """Deprecated: an Orbax manager's items are ``sidecar.orbax.SidecarCheckpointHandler``'s;
    a step of this checkpointer is ``save(step, tree)``. On the controller's live hosts,
    as ``save`` (:meth:`_follow`)."""
    deprecation.warn("sidecar.jax.Checkpointer.save_to", _ORBAX_MANAGER)
    self._follow()
    return self._start(target, tree, data_state)

  def mark_committed(self, target: Target) -> None:
    """Deprecated: ``sidecar.orbax.SidecarCheckpointHandler`` tells the sidecars of an
    Orbax manager's commit."""
    deprecation.warn("sidecar.jax.Checkpointer.mark_committed", _ORBAX_MANAGER)
    self._driver.mark_committed(target)  # orbax_items.item_committed's
    if target.whole_step:
      self._retention.add(target.step)

  # ---- restore -----------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the reads in flight are dropped, their blocks go back
  def restore(self, step: int | None = None, target: Any = None, *,
              progress: Callable[[str], None] | bool | None = None,
              fallback: bool = False) -> Any:
    """Restores ``step`` (default: the latest) onto ``target``.

    ``target``: under ``ctl.checkpointer``, a pytree of ``jax.ShapeDtypeStruct``s with
    shardings, or of concrete arrays (their shardings are used); under
    ``sidecar.torch.Checkpointer``, the state dict ``dcp.load`` fills in place. Takes
    each shard from a live copy: the arena of the host that staged it, else a
    replica on another sidecar (``replicas=R``), else storage, checking its crc32c; a
    copy that fails its check or whose host is gone falls back to the next. Reshards
    when the target mesh differs from the one saved. With ``progress`` (``print``, say),
    a restore past a second reports its progress; by default (None) on a tqdm line where
    one is seen.

    A step is restored as saved or not at all: its manifest (its own crc32c checked) and
    the metadata its reads use are checked against each other and the target, and a step
    a sidecar wrote whose manifest is gone is refused (one stock Orbax or DCP wrote, which
    never had one, is restored with a warning that nothing can be checked). A corrupt
    step's error names the older committed steps that check intact; with
    ``fallback=True`` the newest step at or below ``step`` that restores whole is
    restored instead, with a warning naming each step skipped and why
    (``restored_step`` says which; ``latest_step()`` stays the newest committed)::

      state = ckpt.restore(target=abstract_state, fallback=True)
      start = ckpt.restored_step
      data = ckpt.data_state(start)

    Raises:
      CorruptCheckpointError: the step is corrupt (without ``fallback``, or every older
        one is too): a file changed after its save, named relative to the step.
      ShardsLostError: some shard has no live copy and no valid stored one.
      ResourceExhaustedError: an arena had no room for a shard read from storage within
        the deadline (the data is intact: drop trees restored before, or a larger
        ``--shm-size``).
    """
    self._check_open()
    self._follow()
    if target is None:
      raise errors.InvalidArgumentError(
          "restore needs a target: the tree (or state dict) to restore onto, with the "
          "saved leaves' shapes and dtypes. Under ctl.checkpointer: the state as your init "
          "makes it (its arrays' shardings are used), or without computing it, "
          "jax.eval_shape(init) with a jax.ShapeDtypeStruct(shape, dtype, "
          "sharding=NamedSharding(mesh, spec)) for each leaf; under "
          "sidecar.torch.Checkpointer: model.state_dict(), filled in place")
    t0 = time.perf_counter()
    step = fallback_lib.pick(step, self.all_steps(), self.directory)
    self._restores += 1
    key = f"{self._key}/restore/{self._restores}"
    steps = fallback_lib.steps_to_try(step, self.all_steps(), peers=self._peers, key=key)

    def attempt(s: int) -> Any:
      with progress_lib.lines(progress, f"restoring step {s}") as report:
        return self._driver.restore(s, target, progress=report)

    restored = fallback_lib.restore(steps, attempt, fallback=fallback, intact=self._intact,
                                    peers=self._peers, key=f"{key}/try",
                                    directory=self.directory)
    self.restored_step = restored.step
    self._log_restore()
    if self._goodput is not None:
      self._goodput.restored(restored.step, time.perf_counter() - t0)
    return restored.tree

  def _intact(self, step: int) -> bool:
    """Whether ``step``'s manifest and stored metadata check (the sidecar's Info, which
    raises where they do not); none of its shards is read."""
    final_dir = self._driver.target(self.directory, step).final_dir
    interrupts.wait(self._client.info(self._local[0], final_dir))
    return True

  def last_restore_stats(self) -> RestoreStats | None:
    """Where the shards of this process's latest successful restore came from."""
    return self._driver.last_restore_stats()

  def _log_restore(self) -> None:
    """Logs where the latest restore's shards came from."""
    if (stats := self.last_restore_stats()) is not None:
      log.info("%s of %s", stats.summary(), self.directory)

  def restore_from(self, final_dir: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    """Deprecated: ``sidecar.orbax.SidecarCheckpointHandler`` restores an Orbax manager's
    items; a step of this checkpointer is ``restore(step, target)``."""
    deprecation.warn("sidecar.jax.Checkpointer.restore_from", _ORBAX_MANAGER)
    tree = self._driver.restore_from(final_dir, step, target, progress=progress)
    self._log_restore()  # orbax_items.restore_item's
    return tree

  def data_state(self, step: int | None = None) -> dict[str, Any] | None:
    """The data position saved with ``step`` (default: the latest), or None."""
    self._follow()
    return self._driver.data_state(fallback_lib.pick(step, self.all_steps(), self.directory))

  # ---- listing and lifecycle ---------------------------------------------

  def all_steps(self) -> list[int]:
    return self._retention.all()

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  @interrupts.deferring  # Ctrl-C: after the move, which is one rename
  def set_aside(self, step: int) -> str:
    """Moves committed ``step`` out of this directory's steps, kept on storage whole as
    ``<directory>/set-aside-<step>`` (``-2``, ``-3``, ... where that is taken), which no
    listing, restore or retention takes for a step; its RAM-tier copies are dropped.
    Returns that path (in every process).

    For training that goes on from an older step than the latest: a save never replaces
    a committed step, so the steps after the one restored are set aside first, a
    damaged one above all (``restore(fallback=True)`` skipped it: ``restored_step`` is
    older than ``latest_step()``), and their numbers are then saved anew::

      state = ckpt.restore(target=abstract_state, fallback=True)
      for step in [s for s in ckpt.all_steps() if s > ckpt.restored_step]:
        print(f"step {step} set aside as {ckpt.set_aside(step)}")

    Nothing is deleted: remove the directory once you are done with it. Waits for a save
    in flight first. Every process makes the same calls.

    Raises:
      InvalidArgumentError: ``step`` is not a committed step.
    """
    self._check_open()
    self._follow()
    self._join()  # a save in flight lists its step (and may delete old ones) first
    self._asides += 1
    moved = self._retention.set_aside(step)
    if self._peers.count > 1:  # process 0 moved it; all say where
      moved = self._peers.broadcast(f"{self._key}/aside/{self._asides}",
                                    moved if self._lead else None)
    return moved

  def save_in_flight(self) -> SaveHandle | None:
    """The handle of this checkpointer's latest save while it is not durable yet; None
    once it is (or failed), or before the first save."""
    handle = self._in_flight
    return None if handle is None or handle.durable.done() else handle

  @interrupts.deferring  # Ctrl-C stops the wait; the save goes on
  def wait(self, *, progress: Callable[[str], None] | bool | None = None) -> None:
    """Waits until the save in flight (if any) is durable, and the older steps it
    makes ``max_to_keep`` drop are deleted (and, with replicas, until its replication
    has ended, done or failed: ``handle.replicated`` says which); raises the error of
    a save that failed, unless a later save committed, ``save`` or ``close`` raised it
    or its handle told it.

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
          if line := display.save_progress(self._client.status(), self.directory,
                                           handle.step):
            report(line)
    interrupts.wait_done(handle.durable)
    self._join()  # and the older steps max_to_keep drops are gone
    self._raise_failures("wait()")

  def _raise_failures(self, where: str) -> None:
    """Raises the first failed save of this checkpointer that no later commit settled
    and that no save(), wait() or close() raised yet (later ones named in its notes);
    each is raised once. ``where``: the call that raises it. The failures of saves begun
    before a loss are logged instead (:meth:`_follow`)."""
    if (error := self._failures.unsettled(where, hosts=self.site.hosts)) is not None:
      raise error

  def _join(self) -> None:
    """Waits until every save this process began has ended (its ``end`` ran: durable or
    failed, old steps deleted, replication settled)."""
    self._driver.join()  # every save's thread, which ends it

  def drop_ram_tier(self) -> ram_drop.RamTierDrop:
    """Drops this directory's durable RAM-tier copies on the sidecars this process
    drives, at once (they also give way by themselves to new work that needs the arena);
    steps not durable yet stay (``kept``). Restores then read from storage.

    Example::

      ckpt.wait()
      print(ckpt.drop_ram_tier().describe())
    """
    self._check_open()
    self._follow()
    return ram_drop.merged([interrupts.wait(self._client.drop_ram_tier(h, self.directory))
                            for h in self._local])

  def _check_open(self) -> None:
    if self._closed:
      raise errors.ClosedError("this checkpointer is closed")

  @interrupts.deferring
  def close(self) -> None:
    """Waits for the save in flight (and what older saves still settle: replication,
    deleting old steps), then closes; idempotent. Raises the error of a save that
    failed, unless a later save committed or ``save`` or ``wait`` raised it already
    (closed all the same)."""
    if self._closed:
      return
    self._close()
    self._raise_failures("close()")

  def _close(self) -> None:
    t0 = time.perf_counter()
    try:
      self._join()
      if self._goodput is not None:  # the trainer waits here for the saves to end
        self._goodput.checkpoint_wait(time.perf_counter() - t0)
    finally:
      self._closed = True
      self._client.close()  # its busy retries, if any

  def __enter__(self) -> Self:  # sidecar.torch.Checkpointer's too
    return self

  @interrupts.deferring
  def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
    if exc is None:
      self.close()
      return
    if self._closed:
      return
    self._close()  # the block's own error goes on; a failed save is said beside it
    self._failures.note_on(exc, "the checkpointer's with block, which raised",
                           hosts=self.site.hosts)

  def __repr__(self) -> str:
    return display.text_block("sidecar checkpointer", *self._display())

  def _repr_html_(self) -> str:
    facts, table = self._display(html=True)
    return display.html_block("sidecar checkpointer", facts, table)

  def _display(self, html: bool = False) -> tuple[list[tuple[str, str]], str]:
    """Facts (no call), and each host's tiers for this directory (one bounded Status)."""
    facts = display.checkpointer_facts(self.directory, self.all_steps(), self._in_flight,
                                       self.last_restore_stats(), self._closed)
    if self._closed:
      return facts, ""
    return facts, display.tier_table(
        lambda: self._client.status(timeout=display.STATUS_TIMEOUT_S), self.directory,
        as_html=html)
