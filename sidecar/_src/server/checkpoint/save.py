"""A save's calls on the sidecar: open, begin, stage, prepared, commit, abort, delete.

``stage`` takes shards the worker copied into the arena into the step's ``step.Step``
(``Step.take``); from then on the trainer's arrays are free: this host's RAM tier holds
the only copy it needs, and one writer thread per step (``write.write_step``, started
through ``spawn``, so the owner joins it) writes them as they arrive. ``begin`` records
the save as in flight (``begins.Begins``). ``commit`` (of a written step) builds the
manifest (``records.Manifest.of_save``), and the step's format writes it, finalizes and
renames. What differs between formats (tmp
directories, how parts are numbered, the write engine, the commit) is the step's
``ckptfmt.format.Format``, found by name in the ``formats`` registry: nothing here
branches on a format. ``delete`` and ``abort`` remove only step directories a
checkpoint wrote.

**One operation, one resolution.** Each call resolves the paths it is given once, to
check them (``roots.py``); what it then makes, renames or removes it reaches through the
directory it acts in, opened once from its checkpoint root with no symlink followed
(``Roots.open``, ``ckptfmt/dir_fd.DirFd``), and it checks and acts relative to that
descriptor: a Delete, an Abort, an open's sweep, a Begin's leftover, a commit's rename.
A directory swapped for a symlink meanwhile is refused, never followed into another
tenant's (issue 76, attack 1).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from sidecar._src.ckptfmt import direct_io, records, registry as formats_lib
from sidecar._src.ckptfmt.direct_io import Turn
from sidecar._src.ckptfmt.format import Format, Uncommitted
from sidecar._src.ckptfmt.records import Manifest, ShardRecord, Staged, Standing
from sidecar._src.ckptfmt.save_values import Abort, Begin, Commit, Prepared, Stage
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import (
  begins as begins_lib,
  faults,
  ram_tier,
  roots as roots_lib,
  step as step_lib,
  step_dirs,
  write as write_lib,
)
from sidecar._src.server.checkpoint.caller import Caller

log = logging.getLogger(__name__)


class StepWriter:
  """A save's calls on one sidecar (``host_id``) over its RAM ``tier``.

  Args:
    host_id: this sidecar's host.
    tier: its RAM tier, where the staged steps go.
    roots: its checkpoint roots; every path a call names is checked against them.
    spawn: starts a thread the owner joins (``spawn(target, *args, name=...)``).
    metrics: where the bytes staged and written and the write's time are recorded.
    formats: the formats by name (a unit test gives one whose write records, waits or fails).
    write_turn: the turns at the storage's write bandwidth of the session ``owner``'s saves
      (a pool tenant's, shared by weight: ``server/shares.py``), or None: no sharing.
    take_over: called with a step whose part here is whole with its plans (``CommitPlan``),
      before the Stage that made it whole answers: the sidecars commit it from then on
      (``agreement.Agreements.take_over``); what it raises refuses that Stage.
  """

  def __init__(self, host_id: int, *, tier: ram_tier.RamTier, roots: roots_lib.Roots,
               spawn: Callable[..., None], metrics: metrics_lib.Recorder,
               formats: formats_lib.Registry = formats_lib.DEFAULT,
               write_turn: Callable[[str], Turn | None] = lambda owner: None,
               take_over: Callable[[step_lib.Step], None] = lambda own: None):
    self._host_id = host_id
    self._tier = tier
    self._roots = roots
    self._path = roots.resolve
    self._spawn = spawn
    self._metrics = metrics
    self._formats = formats
    self._write_turn = write_turn
    self._take_over = take_over
    self._begins = begins_lib.Begins(host_id, tier=tier)  # the saves begun here
    self._writers = write_lib.Writers(host_id, tier=tier)  # when each step's writer starts
    # Its directories on disk, through descriptors opened from the roots.
    self.dirs = step_dirs.StepDirs(host_id, roots=roots, formats=formats)

  def open(self, directory: str, ram_steps: int = 1, ram_budget: int | None = None,
           sweep: bool = True, wait_s: float | None = None) -> list[int]:
    """Checks ``directory`` is writable, sweeps uncommitted steps; returns committed steps.

    ``sweep=False`` where an Orbax CheckpointManager owns the directory's tmp steps. The
    steps this host took over (the sidecars commit them, their trainers there or not:
    ``agreement.py``) are waited for first, at most ``wait_s`` (None: ``LONG_WRITE_S``),
    so that a restarted trainer's restore finds the step its predecessor saved last.
    """
    self._path(directory, "directory")
    self._wait_for_commits(directory, write_lib.LONG_WRITE_S if wait_s is None else wait_s)
    steps = self.dirs.open(directory, sweep=sweep, in_flight=lambda tmp: bool(
        self._tier.in_flight(directory)) or self._begins.in_flight_at(tmp))
    self._tier.configure(directory, ram_steps, ram_budget)
    return steps

  def _wait_for_commits(self, directory: str, wait_s: float) -> None:
    """Waits for the end (committed or abandoned) of ``directory``'s steps taken over here."""
    pending = self._tier.pending_commits(directory)
    deadline = time.monotonic() + wait_s
    for s in pending:
      log.info("open: waiting for step %d to be written and committed first (its trainers "
               "staged it whole: the sidecars commit it)", s.step, extra={"step": s.step})
      if not s.wait_agreed(max(0.0, deadline - time.monotonic())):
        raise errors.DeadlineExceededError(
            f"open: step {s.step} of {directory!r:.200} is still being written or committed "
            f"on host {self._host_id} after {wait_s:g} s; open the directory again once it "
            "is (its write goes on)")

  def begin(self, begin: Begin, caller: Caller) -> str:
    """Creates the step's uncommitted directory (anew), as ``begin``'s format (the wire's
    Begin always names one) names it: "orbax": ``<directory>/<step>.orbax-checkpoint-tmp``;
    "dcp": ``<directory>.dcp-checkpoint-tmp`` (a committed checkpoint at ``directory`` is
    replaced at the commit, as DCP overwrites). ``begin`` is the trainer's, as it sent it
    (``ckptfmt/save_values``); ``caller`` is what this sidecar knows of who sent it.
    Refused while another save of the step is in flight (it would remove that save's
    files): another session's from its Begin on (``Begun``), until it is committed or
    aborted or its trainer is gone (``caller.alive``: whether the worker of the session
    ``caller.owner`` is attached; None: not known); another checkpointer's of this
    session once it staged."""
    made, finish = self._begin(begin, caller, None)
    try:
      finish()
    except BaseException:
      self._begins.unreserve(
          pathlib.Path(self.tmp_of(begin.directory, begin.step, begin.format)), caller.owner)
      raise
    return made

  def begin_staged(self, stage: Stage, caller: Caller) -> tuple[str, Callable[[], None]]:
    """:meth:`begin` of ``stage.begin`` by ``stage`` (its first part, which carries it: one
    round trip less), which writes into ``stage.tmp_dir``: that must be where a save
    writes in the directory made (refused before anything is made if not). Returns the
    step's uncommitted directory, made, and what finishes it (``Format.begin_tmp``):
    :meth:`stage` hands that to the step's writer thread (``finish_tmp``), which runs it
    before it writes, off the trainer's wait."""
    assert stage.begin is not None
    return self._begin(stage.begin, caller, stage.tmp_dir)

  def _begin(self, begin: Begin, caller: Caller, tmp_dir: str | None
             ) -> tuple[str, Callable[[], None]]:
    """:meth:`begin`'s checks, its record and the directory's making; returns the
    directory and what finishes it."""
    directory = begin.directory
    step = roots_lib.as_int(begin.step, "step")
    fmt = self._formats.get(begin.format)
    fmt.load()  # (loaded at the sidecar's start where installed: else it says what is missing)
    tmp = pathlib.Path(self.tmp_of(directory, step, begin.format))
    if tmp_dir is not None and fmt.staged_dirs(fmt.tmp_of(directory, step))[0] != tmp_dir:
      raise errors.InvalidArgumentError(
          f"stage: tmp_dir {tmp_dir!r:.200} is not where a save of step {step} of "
          f"{directory!r:.200} in format {fmt.name!r} writes "
          f"({fmt.staged_dirs(fmt.tmp_of(directory, step))[0]!r:.200}); a Stage that begins "
          "its step stages into the directory that Begin would answer")
    self._begins.reserve(directory, step, fmt.name, tmp, caller.owner, caller.alive)
    try:
      # Made in the directory it lies in, opened from the root (a leftover removed there):
      # the format names it in that directory (a symlink there is in the way, not followed).
      resolved = self._path(directory, "directory")
      with self._roots.open(os.path.dirname(fmt.tmp_of(resolved, step)), make=True) as at:
        made, finish = fmt.begin_tmp(resolved, step, at=at)
      return str(made), finish
    except BaseException as e:
      self._begins.unreserve(tmp, caller.owner)
      if isinstance(e, FileExistsError):  # a race lost to a checkpointer that began or
        raise errors.PermissionDeniedError(  # committed the step meanwhile (another job's)
            f"begin: step {step} of {directory!r:.200} is being saved by another "
            f"checkpointer, or was: {e.strerror or e}"
            f"{f' ({e.filename})' if e.filename else ''}; a save never replaces a committed "
            "step: save each step of a directory from one checkpointer (one job per "
            "directory)") from None
      raise

  def forget_ended(self) -> None:
    """The reaper's: forgets the begun saves that are no longer in flight (their trainers
    gone), and fails the steps begun with nothing staged whose next part never came
    (``Writers.expire``)."""
    self._begins.forget_ended()
    self._writers.expire()

  def close(self, why: BaseException) -> None:
    """The sidecar stops: each step begun with nothing to write yet ends with ``why``."""
    self._writers.end_all(why)

  def begun(self, directory: str, step: int, format: str) -> begins_lib.Begun | None:  # noqa: A002
    """The Begin of step ``step`` of ``directory`` here in flight, if any."""
    try:
      tmp = pathlib.Path(self.tmp_of(directory, step, format))
    except errors.SidecarError:
      return None
    return self._begins.begun(tmp)

  def tmp_of(self, directory: str, step: int, format: str = formats_lib.ORBAX) -> str:  # noqa: A002
    """Where :meth:`begin` makes the step's uncommitted directory (resolved), if it lies
    under a checkpoint root (DCP's lies beside ``directory``: never outside the roots)."""
    fmt = self._formats.get(format)
    tmp = fmt.tmp_of(self._path(directory, "directory"), roots_lib.as_int(step, "step"))
    return self._path(tmp, "the step's uncommitted directory")

  def _uncommitted_at(self, tmp_dir: str, name: str
                      ) -> tuple[Format, str, str, pathlib.Path]:
    """The format of ``tmp_dir``, ``tmp_dir`` (resolved), where it will be once committed
    and the uncommitted step directory it lies in, if ``tmp_dir`` lies in (or is) an
    uncommitted step directory of a format (``*.orbax-checkpoint-tmp``,
    ``*.dcp-checkpoint-tmp``) whose step is not committed, or whose format overwrites
    (DCP's commit replaces a committed one at its path).

    What keeps a save from writing into, or a commit from rewriting, a committed step.
    """
    path = pathlib.Path(self._path(tmp_dir, name))
    root = pathlib.Path(self._roots.root_of(str(path)) or "/")
    found = self._formats.of_tmp(path)
    # Not in a committed step or item either (Orbax's markers, our manifest, above it).
    inside = next((p for p in (found[1].tmp.parents if found is not None else ())
                   if p.is_relative_to(root) and roots_lib.has_markers(p)), None)
    if found is None or inside is not None:
      suffixes = ", or ".join(f"*{f.tmp_suffix}" for f in self._formats.formats.values())
      raise errors.PermissionDeniedError(
          f"{name} {tmp_dir!r:.200} is not inside an uncommitted step directory "
          f"({suffixes}) outside any committed one; a save "
          "writes only into the step it began, never into a committed one")
    fmt, where = found
    if not fmt.overwrites and where.committed.exists():
      raise errors.PermissionDeniedError(
          f"{name} {tmp_dir!r:.200}: step {where.committed.name} is committed already "
          f"({where.committed}); nothing writes into or over a committed step")
    return fmt, str(path), str(where.final), where.tmp

  def stage(self, stage: Stage, caller: Caller, *,
            finish_tmp: Callable[[], None] | None = None) -> int:
    """Takes the shards of this host a ``stage`` carries (arena views it now holds) and
    starts writing them. ``stage`` is the trainer's, as it sent it (``ckptfmt/save_values``);
    ``caller`` and ``finish_tmp`` are what this sidecar knows of the call itself.

    A save stages in parts, as the trainer copies (``last`` on the final one): the
    first part starts the writer, each part's shards are written as they arrive.
    Where ``writers`` trainer processes share this host, the step is whole once each
    has sent its ``last`` part.
    ``tmp_dir`` is the uncommitted item directory to write; ``final_dir`` where it will
    be once committed (the RAM tier's key). Returns the bytes staged so far.

    ``tmp_dir`` must lie in an uncommitted step directory, and ``final_dir`` be where it
    goes; the save belongs to the sessions that staged its parts (``caller.owner``), at
    most ``writers`` of them: a part of another session is refused while it is being
    written. ``extra``: the typed extra of ``tmp_dir``'s format, if it has one (a DCP
    step's ``DcpPart``: its rank and item count, its shards' ``leaf`` numbering them); the
    format numbers the shards (``Format.numbering``). Each record names this host (or no
    host: it is this one's then).

    ``plan`` (with ``last``): the sidecars commit the step themselves; once every writer's
    last part came with one, this host takes the step over before this call returns
    (``take_over``, which may refuse it: then this call raises). ``caller.alive``: whether
    the trainer whose worker session ``caller.worker`` staged this part is still there.
    ``finish_tmp`` (a part that begins its step: :meth:`begin_staged`): what finishes the
    step's uncommitted directory, which its writer thread runs before it writes. The
    writer starts with the first part that has something to write; a part that begins a
    step is refused (ResourceExhaustedError) where ``caller.tenant`` (``caller.owner``,
    with no tenant) holds ``write.BEGUN_STEPS`` steps being staged here
    (``write.Writers``).
    """
    step = roots_lib.as_int(stage.step, "step")
    fmt, stage = self._stage_paths(stage)
    faults.fault("stage", step)
    faults.fault("slowstage", step)
    with self._tier.slot(stage.final_dir) as slot:
      own = self._held(slot, stage, caller, fmt, finish_tmp)
      before = own.nbytes
      whole = self._take(own, stage, caller)
      staged = own.nbytes
    self._writers.staged(own, something=bool(stage.shards) or stage.last)
    self._metrics.checkpoint_bytes("staged", staged - before)
    if whole and own.plans:
      self._take_over(own)  # before this Stage answers: the sidecars commit it now
    return staged

  def _stage_paths(self, stage: Stage) -> tuple[Format, Stage]:
    """The format of ``stage``'s step and ``stage`` with its ``tmp_dir`` resolved, each
    path resolved once and checked: ``tmp_dir`` in an uncommitted step of ``directory``,
    going to ``final_dir`` once committed (which stays the client's spelling: the RAM
    tier's key); its extra the format's."""
    directory, tmp_dir, final_dir = stage.directory, stage.tmp_dir, stage.final_dir
    resolved = self._path(directory, "directory")
    resolved_final = self._path(final_dir, "final_dir")
    fmt, tmp_dir, final, tmp_step = self._uncommitted_at(tmp_dir, "tmp_dir")
    if resolved != str(tmp_step.parent):
      raise errors.InvalidArgumentError(
          f"stage: directory {directory!r:.200} is not the directory of tmp_dir's step "
          f"({str(tmp_step.parent)!r:.200}); a Stage names the checkpoint directory it "
          "opened, the one its step lies in")
    _check_extra(stage.extra, fmt.stage_extra, f"stage: a Stage of a step in {fmt.name}'s "
                 "layout carries")
    if final != resolved_final:
      raise errors.InvalidArgumentError(
          f"stage: final_dir {final_dir!r:.200} is not where tmp_dir {tmp_dir!r:.200} goes once "
          f"committed ({final!r:.200})")
    return fmt, dataclasses.replace(stage, tmp_dir=tmp_dir)

  def _held(self, slot: ram_tier.Slot, stage: Stage, caller: Caller, fmt: Format,
            finish_tmp: Callable[[], None] | None) -> step_lib.Step:
    """The step ``stage`` is a part of, in ``slot``: the save's own, being staged, or a
    new one held there, whose writer thread starts once it has something to write
    (``Writers.staged``). Refused where another session stages the step, where it is a
    later part of a save whose write failed, or where the step is staged whole already."""
    step, tmp_dir, final_dir, owner = stage.step, stage.tmp_dir, stage.final_dir, caller.owner
    own = slot.step
    state = own.state if own is not None else None
    writing = own is not None and own.view().writing
    if own is not None and writing and (
        own.tmp_dir != tmp_dir
        or (owner not in own.owners and len(own.owners) >= own.writers)):
      raise errors.PermissionDeniedError(
          f"stage: step {own.step} at {final_dir!r:.200} is being saved by another "
          f"session on host {self._host_id}; only the session that began a save stages "
          "its parts")
    if (own is not None and state is step_lib.State.FAILED and finish_tmp is None
        and _same_save(own, tmp_dir, owner)):  # a later part of a failed save
      assert own.error is not None
      raise write_lib.write_failure(self._host_id, step, final_dir, own.error,
                                    tmp_dir=tmp_dir)
    if own is None or not writing:
      own = step_lib.Step(stage.directory, step, final_dir, tmp_dir=tmp_dir,
                          writers=stage.writers, format=fmt.name,
                          numbering=fmt.numbering(stage.leaves))
      self._writers.admit(own, tenant=caller.tenant, session=owner)  # (refused: nothing held)
      slot.hold(own)
      state = step_lib.State.STAGING
      # Its writer thread starts once it has something to write (Writers.staged).
      self._writers.waiting(own, functools.partial(self._spawn, functools.partial(
          write_lib.write_step, own, fmt, host_id=self._host_id, tier=self._tier,
          metrics=self._metrics, turn=self._write_turn(owner) or direct_io.no_turn,
          finish_tmp=finish_tmp), name=f"sidecar-ckpt-{step}"))
    # (else its writer ran it: a part that begins a step in flight is refused first)
    if state is step_lib.State.STAGED:
      raise errors.InvalidArgumentError(
          f"stage: step {step} of {stage.directory!r:.200} is staged already on host "
          f"{self._host_id}: another save of step {step} into this directory is in flight "
          "(another checkpointer or process); wait for that save to end, or save each step "
          "from one checkpointer")
    return own

  def _take(self, own: step_lib.Step, stage: Stage, caller: Caller) -> bool:
    """``own`` takes ``stage``'s shards (``Step.take``); returns whether its part here is
    whole. Refused where the part does not fit the step, or its write failed or it was
    aborted meanwhile."""
    try:
      return own.take(caller.owner, stage.extra, self._here(stage.shards), last=stage.last,
                      writers=stage.writers, plan=stage.plan, leaves=stage.leaves,
                      worker=caller.worker, alive=caller.alive)
    except errors.InvalidArgumentError as e:
      raise errors.InvalidArgumentError(f"step {stage.step} on host {self._host_id}: {e}") from None
    except step_lib.StateError:  # its write failed, or it was aborted, since the check above
      if own.state is step_lib.State.FAILED:
        assert own.error is not None
        raise write_lib.write_failure(self._host_id, stage.step, stage.final_dir, own.error,
                                      tmp_dir=stage.tmp_dir) from None
      raise errors.ClosedError(f"stage: the save of step {stage.step} was aborted on host "
                               f"{self._host_id} meanwhile") from None

  def _here(self, shards: Sequence[Staged]) -> list[Staged]:
    """``shards``, each record naming this host; InvalidArgumentError for another's."""
    out = []
    for s in shards:
      host = s.record.host
      if host is None:
        s = Staged(dataclasses.replace(s.record, host=self._host_id), s.data, s.ref)
      elif host != self._host_id:
        raise errors.InvalidArgumentError(
            f"shard {list(s.record.id.key_path)} at {[list(i) for i in s.record.id.index]} "
            f"names host {host}, staged on host {self._host_id}; stage each shard on the host "
            "its record names")
      out.append(s)
    return out

  def prepared(self, prepared: Prepared, caller: Caller) -> list[ShardRecord]:
    """This host's shards of the step at ``prepared.final_dir``, written (their crc32c
    set), once its write ended, waited for at most ``caller.wait_s`` (the servicer folds
    the value's ``timeout_s`` into it)."""
    final_dir, timeout = prepared.final_dir, caller.wait_s
    self._path(final_dir, "final_dir")
    own = self._tier.step_at(final_dir)
    if not own.wait_written(timeout):
      raise errors.DeadlineExceededError(
          f"step {own.step} is still being written after {timeout} s")
    if own.view().agree is Standing.FAILED:  # (a step dropped since: as its write ended)
      assert own.error is not None
      raise write_lib.write_failure(self._host_id, own.step, final_dir, own.error,
                                    tmp_dir=own.tmp_dir)
    faults.fault("prepared", own.step)
    return own.written_records

  def commit(self, commit: Commit, caller: Caller) -> str:
    """On host 0: the manifest, then the checks; with ``commit.whole_step`` also the
    step's rename. ``commit`` is the trainer's, as it sent it (``ckptfmt/save_values``).

    Without ``whole_step`` (an Orbax handler's item) the CheckpointManager commits.
    ``replicas``: which hosts hold each host's replicas (``{host: [hosts]}``), recorded
    so that a restore that finds shards lost can say which hosts are gone. Only the
    session that staged ``tmp_dir`` here (``caller.owner``) commits it, once it is
    written, and only into an uncommitted step, and not one the sidecars took over (they
    commit it). ``extra``: the typed commit extra of ``tmp_dir``'s format, if it has one
    (a DCP step's ``DcpCommit``: its metadata, file sizes and plan).
    """
    step = roots_lib.as_int(commit.step, "step")
    found = self._uncommitted_at(commit.tmp_dir, "tmp_dir")
    own = self._tier.find_tmp(found[1])
    if (own is None or caller.owner not in own.owners or own.step != step
        or own.committed or own.takeover is not step_lib.Takeover.NONE):
      raise errors.PermissionDeniedError(
          f"commit: tmp_dir {found[1]!r:.200} is not a step {step} this session staged on "
          f"host {self._host_id}, or is being committed already; a session commits only "
          "the save it began, once")
    return self._commit(own, commit, found)

  def commit_agreed(self, own: step_lib.Step, shards: Sequence[ShardRecord], *,
                    plan: records.CommitPlan) -> str:
    """Commits the step ``own`` (this host's part of it, taken over) with every host's
    written ``shards``, as ``plan`` says (the sidecars agreed: ``agreement.py``), and
    marks it committed in this RAM tier."""
    commit = Commit(tmp_dir=own.tmp_dir, step=own.step, num_hosts=len(plan.hosts),
                    shards=shards, leaves=own.leaves, data_state_json=plan.data_state_json,
                    replicas=plan.replicas or None)
    committed = self._commit(own, commit, self._uncommitted_at(own.tmp_dir, "tmp_dir"))
    self._tier.mark_committed(own.final_dir)
    return committed

  def _commit(self, own: step_lib.Step, commit: Commit,
              found: tuple[Format, str, str, pathlib.Path]) -> str:
    """:meth:`commit` of ``own``, written here, once checked to be the caller's: one at a
    time with its abort (``Step.commit_gate``: refused once it was aborted; an abort waits
    for its end). Its renames are relative to the directory ``tmp_step`` (the step's
    uncommitted directory) lies in, opened from the root. ``found``: what
    :meth:`_uncommitted_at` found of ``commit.tmp_dir``, which the format is given
    resolved."""
    fmt, tmp_dir, _, tmp_step = found
    commit = dataclasses.replace(commit, tmp_dir=tmp_dir)
    step, extra = own.step, commit.extra
    faults.fault("slowcommit", step)
    own.commit_gate.begin()
    committed = ""
    try:
      part = own.view().agree
      if part is Standing.FAILED:  # the write's own error, as its prepared and Stages say
        assert own.error is not None
        raise write_lib.write_failure(self._host_id, step, own.final_dir, own.error,
                                      tmp_dir=own.tmp_dir)
      if part is Standing.TAKEN_OVER:  # a save commits after its prepared: another's
        raise errors.InvalidArgumentError(
            f"commit: step {step} at {tmp_dir!r:.200} is still being written on host "
            f"{self._host_id}: another save of step {step} into this directory is in flight "
            "(another checkpointer or process); wait for that save to end, or save each "
            "step from one checkpointer")
      _check_extra(extra, fmt.commit_extra,
                   f"commit: a step in {fmt.name}'s layout commits with")
      manifest = Manifest.of_save(fmt.name, step=step, leaves=commit.leaves,
                                  shards=commit.shards, data_state_json=commit.data_state_json,
                                  replicas=commit.replicas, extras=fmt.manifest_extras(extra))
      faults.fault("commit", step)
      try:
        with self._roots.open(str(tmp_step.parent)) as at:
          committed = fmt.commit(commit, manifest, swapping=lambda: faults.mid_commit(step),
                                 at=at)
      except errors.SidecarError:
        raise
      except OSError as e:  # typed wherever the decision goes (a disk's EIO, ENOSPC too)
        raise (write_lib.made_meanwhile("commit", e) if isinstance(e, FileExistsError)
               else write_lib.write_failure(self._host_id, step, own.final_dir, e)) from None
    finally:
      own.commit_gate.end(committed if commit.whole_step else "")  # an item: its manager commits it
    if fmt.commit_extra is not None:  # kept in host memory (a DCP step's): info() answers it,
      own.keep_manifest(manifest)    # the trainer tells the other RAM tiers (built once)
    self._begins.ended(pathlib.Path(tmp_dir))
    return committed

  def abort(self, abort: Abort, caller: Caller) -> str:
    """Forgets a step whose save failed; removes ``tmp_dir`` (its uncommitted files) once
    written. The controller calls it again with the whole uncommitted step directory
    once every host is done. ``tmp_dir`` must be an uncommitted step directory
    (``*.orbax-checkpoint-tmp``) or lie in one: nothing else is removed.

    A step whose commit began here is aborted only once that commit ended (``Step.commit_gate``),
    and only if it did not commit it: one committed here (and still held in the RAM tier)
    is left whole, its RAM-tier copy too. Returns where it was committed then ("": it was
    not, and is aborted).

    Raises:
      DeadlineExceededError: its commit still runs after ``caller.wait_s`` s (nothing
        removed).
    """
    tmp_dir, final_dir = abort.tmp_dir, abort.final_dir
    path = self._path(tmp_dir, "tmp_dir")
    self._path(final_dir, "final_dir")
    root = self._roots.root_of(path)
    assert root is not None
    suffixes = tuple(f.tmp_suffix for f in self._formats.formats.values())
    if not any(part.endswith(suffixes) for part in pathlib.Path(path).relative_to(root).parts):
      raise errors.InvalidArgumentError(
          f"abort: tmp_dir {tmp_dir!r:.200} is not an uncommitted step directory "
          f"(*{', *'.join(suffixes)}) nor inside one; abort removes only a save's uncommitted "
          "files")
    found = self._formats.of_tmp(pathlib.Path(path))
    with self.dirs.parent(path) as at:
      if found is not None and not self.dirs.made_here(found[0], found[1].tmp, at):
        raise errors.PermissionDeniedError(
            f"abort: {str(found[1].tmp)!r:.200} was not made by a save (no mark of one in "
            "it); abort removes only what a save made: move it away yourself")
      committed = self._abort(path, final_dir, found, caller.wait_s)
      if not committed and at is not None:
        at.remove(os.path.basename(path))  # (a file or a symlink there is left as it is)
      return committed

  def _abort(self, path: str, final_dir: str,
             found: tuple[Format, Uncommitted] | None, wait_s: float) -> str:
    """:meth:`abort`'s decision, its checks passed: where its step was committed here
    before the abort came (nothing then goes), or "" once the step is forgotten here (its
    directory is the caller's to remove)."""
    held = self._tier.find(final_dir)
    newer = self._begins.begun(found[1].tmp) if found is not None else None
    if held is not None and newer is not None and newer.at > held.started:
      held = None  # an older save's step (DCP's, committed at the path): this abort's is newer
    committed = held.commit_gate.abort(wait_s) if held is not None else ""
    if held is not None and committed:
      log.info("abort: step %d was committed at %s before its abort came; nothing removed",
               held.step, committed, extra={"step": held.step})
      return committed
    own = self._tier.remove_item(final_dir)
    if own is not None:  # its writer stops before its directory goes
      self._writers.end(own, errors.ClosedError(f"the save of step {own.step} was aborted"))
      own.wait_written(60)
    self._begins.ended(pathlib.Path(path))
    return ""

  def delete(self, directory: str, step: int, *, set_aside: bool = False) -> str:
    """Removes a committed step (max_to_keep), or with ``set_aside`` moves it out of the
    directory's steps (returns where it went): ``StepDirs.delete``."""
    return self.dirs.delete(directory, step, set_aside=set_aside)


def _same_save(own: step_lib.Step, tmp_dir: str, owner: str) -> bool:
  """Whether a Stage of the session ``owner`` into ``tmp_dir`` that does not begin its step
  is a part of the save of ``own``, whose write failed: a later part of a session that
  staged it, or the first of another of its writers (fewer staged it than it has: it
  failed mid-stage) while that save's parts still come (within ``STAGE_TIMEOUT_S`` of
  the failure, as its writer waits for them; later, a part is another save's)."""
  if own.tmp_dir != tmp_dir:
    return False
  if owner in own.owners:
    return True
  failed = own.finished
  return (len(own.owners) < own.writers and failed is not None
          and time.monotonic() - failed < write_lib.STAGE_TIMEOUT_S)


def _check_extra(extra: Any, expected: type | None, what: str) -> None:
  """InvalidArgumentError, ``what`` the format's extra ``expected`` (its ``stage_extra``
  or ``commit_extra``; None: it has none), unless ``extra`` is one (or is None where the
  format has none)."""
  if extra is None if expected is None else isinstance(extra, expected):
    return
  raise errors.InvalidArgumentError(
      f"{what} {expected.__name__ if expected else 'no format extra'}, got "
      f"{type(extra).__name__ if extra is not None else 'none'}")
