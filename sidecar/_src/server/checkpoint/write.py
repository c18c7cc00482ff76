"""The write of one host's share of a step: its writer thread, when it starts, and what a
failed write says.

One thread per step (``save.StepWriter.stage`` starts it through ``spawn``, so the owner
joins it) takes the shards as they are staged (``step.Step.arrivals``) and hands them to
the step's format (``Format.write``), which writes and checksums them on idle-class
threads; it ends the step's write (``Step.end_write``: WRITTEN with the records as
written, or FAILED). It starts once its step has something to write (:class:`Writers`):
a step begun with nothing staged holds no thread of its own, and the steps a tenant has
begun and not staged whole are bounded (:data:`BEGUN_STEPS`): a session that begins steps
by the hundred gets a refusal, not a thread each (issue 76, attack 9).
:func:`write_failure` is the error a trainer (or the step's committer) gets for a write
that failed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.direct_io import Turn
from sidecar._src.ckptfmt.format import Format
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import faults, ram_tier, step as step_lib

log = logging.getLogger(__name__)
# A save's parts come as the trainer copies them (512 MiB in ~0.06 s); a writer that
# waits longer than this for the next one gives up and lets the staged blocks go (the
# trainer died or hung mid-save).
STAGE_TIMEOUT_S = 60.0
# The longest a commit "when written" waits for the step's write, and an open for those
# commits (a restarted trainer's, while its predecessor's last step is written).
LONG_WRITE_S = 3600.0
# The steps one tenant (one session, where the sidecar has no tenants) may have begun and
# not yet staged whole on a sidecar at once: each may hold a writer thread waiting for its
# next part. A trainer stages one step at a time (a few checkpointers: a few).
BEGUN_STEPS = 16


@dataclasses.dataclass
class _Waiting:
  """A step begun with nothing to write yet: what starts its writer, and when its last
  part came."""
  start: Callable[[], None]
  since: float = dataclasses.field(default_factory=time.monotonic)


class Writers:
  """When each step's writer thread starts, on one sidecar (``host_id``) over its RAM
  ``tier``, and how many steps each tenant holds begun.

  A step's writer (:func:`write_step`, started by the ``start`` :meth:`waiting` was given)
  starts at the first Stage that gives it something to write: shards, or its last part
  (:meth:`staged`). Until then the step waits here with no thread; the owner's reaper
  (``Checkpoints._reap``) calls :meth:`expire`, which fails one whose next part has not
  come for ``STAGE_TIMEOUT_S`` as its writer would have (and ends one dropped meanwhile),
  so that whoever waits for its write's end is told. A step of a save aborted, or of a
  sidecar that stops, ends at once (:meth:`end`).
  """

  def __init__(self, host_id: int, *, tier: ram_tier.RamTier):
    self._host_id = host_id
    self._tier = tier
    self._lock = threading.Lock()
    self._waiting: dict[step_lib.Step, _Waiting] = {}
    # Each step begun here and whose: ("tenant", name) or ("session", its id).
    self._holders: dict[step_lib.Step, tuple[str, str]] = {}

  def admit(self, own: step_lib.Step, *, tenant: str | None, session: str) -> None:
    """Records the new step ``own``, begun by ``session`` (of ``tenant``), unless that
    tenant (the session, with no tenant) holds :data:`BEGUN_STEPS` steps being staged
    here already: ResourceExhaustedError naming the bound and the tenant then."""
    holder = ("tenant", tenant) if tenant is not None else ("session", session)
    with self._lock:
      for gone in [s for s in self._holders if s.state is not step_lib.State.STAGING]:
        del self._holders[gone]
      held = sum(1 for h in self._holders.values() if h == holder)
      if held >= BEGUN_STEPS:
        who = f"tenant {tenant!r}" if tenant is not None else "this session"
        raise errors.ResourceExhaustedError(
            f"stage: {who} holds {held} steps begun and not staged whole on host "
            f"{self._host_id}, the most one may (BEGUN_STEPS = {BEGUN_STEPS}); stage each "
            "step whole (or abort it) before beginning another")
      self._holders[own] = holder

  def waiting(self, own: step_lib.Step, start: Callable[[], None]) -> None:
    """``own`` was just begun: ``start`` starts its writer once it has something to write."""
    with self._lock:
      self._waiting[own] = _Waiting(start)

  def staged(self, own: step_lib.Step, *, something: bool) -> None:
    """A Stage of ``own`` was taken: with ``something`` (shards, or its last part) its
    writer starts now, if it waits; else its wait starts again."""
    with self._lock:
      found = self._waiting.get(own)
      if found is None:
        return
      if not something:
        found.since = time.monotonic()
        return
      del self._waiting[own]
    found.start()

  def expire(self) -> None:
    """The reaper's: fails each waiting step whose next part has not come for
    ``STAGE_TIMEOUT_S`` (as its writer would have), and ends each dropped meanwhile."""
    now = time.monotonic()
    with self._lock:
      due = [s for s, w in self._waiting.items()
             if s.state is not step_lib.State.STAGING or now - w.since >= STAGE_TIMEOUT_S]
      for own in due:
        del self._waiting[own]
    for own in due:
      if own.state is step_lib.State.STAGING:
        log.warning("step %d: no part staged for %g s after it was begun; its save is "
                    "dropped here", own.step, STAGE_TIMEOUT_S, extra={"step": own.step})
      _failed(own, self._tier, errors.DeadlineExceededError(
          f"step {own.step}: no part staged for {STAGE_TIMEOUT_S:g} s; the trainer stopped "
          "mid-save"))

  def end(self, own: step_lib.Step, why: BaseException) -> None:
    """``own`` (aborted, dropped) ends now if it waits with no writer: ``why`` is its
    write's end, and whoever waits for that end is told."""
    with self._lock:
      found = self._waiting.pop(own, None)
    if found is not None:
      _failed(own, self._tier, why)

  def end_all(self, why: BaseException) -> None:
    """The sidecar stops: every step waiting with no writer ends with ``why``."""
    with self._lock:
      waiting, self._waiting = list(self._waiting), {}
    for own in waiting:
      _failed(own, self._tier, why)


def write_step(own: step_lib.Step, fmt: Format, *, host_id: int, tier: ram_tier.RamTier,
               metrics: metrics_lib.Recorder, turn: Turn,
               finish_tmp: Callable[[], None] | None = None) -> None:
  """The writer thread of ``own`` (this host's share of a step, in ``tier``), in ``fmt``.

  The bytes are written and checksummed on idle-class threads (the format's write
  engine, e.g. ckptfmt/orbax/write.py): a save yields the CPU to the training step and
  feeds wherever they compete. A pool tenant's are written in its ``turn`` at the
  storage, which the tenants writing share. A write that fails before the step is whole
  drops it from the tier where its trainers are known gone mid-save (nobody will commit
  or abort it); else (there, or not known: a trainer with no worker session, which
  stages inline) it stays there, failed, its bytes let go, until its trainer aborts the
  save or, at most ``RamTier.uncommitted_s`` after the failure, it expires.
  ``finish_tmp``: finishes the step's uncommitted directory first (``Format.begin_tmp``:
  a step begun by its first Stage, which answered without waiting for it); what it
  raises fails the write.
  """
  t0 = time.perf_counter()
  try:
    if finish_tmp is not None:
      finish_tmp()
    faults.fault("write", own.step)
    faults.fault("slow", own.step)
    last_log = [time.monotonic()]

    def progress(nbytes: int) -> None:
      faults.fault("enospc", own.step)
      faults.fault("eio", own.step)
      own.count_written(nbytes)
      metrics.checkpoint_bytes("written", nbytes)
      now = time.monotonic()
      if now - last_log[0] >= 1.0:  # rate-limited: one line a second at most
        last_log[0] = now
        log.info("step %d: %s of %s written (%.2f GB/s)", own.step,
                 shm.format_size(own.written), shm.format_size(own.nbytes),
                 own.written / (now - own.started) / 1e9, extra={"step": own.step})

    assert own.numbering is not None
    written = fmt.write(own.tmp_dir, host_id, own.numbering, own.arrivals(STAGE_TIMEOUT_S),
                        progress=progress, turn=turn)
    seconds = time.perf_counter() - t0
    metrics.background("write", seconds)
    log.info("step %d: wrote %s in %.2f s (%.2f GB/s)", own.step,
             shm.format_size(own.nbytes), seconds, own.nbytes / max(seconds, 1e-9) / 1e9,
             extra={"step": own.step})
  except BaseException as e:
    error = e.with_traceback(None)  # its frames would hold the staged blocks,
    e.__context__ = e.__cause__ = None  # and so would those of the exceptions it chains
    log.error("step %d: writing this host's part failed: %s", own.step, e,
              extra={"step": own.step})
    _failed(own, tier, error)
    return
  own.end_write(written)


def _failed(own: step_lib.Step, tier: ram_tier.RamTier, error: BaseException) -> None:
  """Ends the write of ``own`` with ``error`` (a dropped step's: recorded only).

  Not whole, and its trainers known gone (mid-save: nobody will commit or abort it): it
  goes. A trainer there, or one whose liveness is not known (no worker session: it stages
  inline), learns the failure from its next Stage (as one that races this end does), its
  prepared or its commit, and aborts the save; meanwhile the step keeps its error, not its
  bytes, and expires as an uncommitted step does (a trainer that never comes back leaves
  its record, no shard in it, for uncommitted_s: its error, owners and leaf specs)."""
  if own.end_write(error=error) is step_lib.State.STAGING:
    if own.trainers_alive() is False:
      tier.remove(own)
    else:
      own.let_go()


def made_meanwhile(rpc: str, e: FileExistsError) -> errors.PermissionDeniedError:
  """The error of ``rpc`` whose step directory another checkpointer made or committed
  meanwhile (``e``, told as :func:`os_error_text` says it)."""
  what, where = os_error_text(e)
  return errors.PermissionDeniedError(
      f"{rpc}: {what}{where}: another checkpointer made or committed it meanwhile (two "
      "jobs saving into one directory?); save each step of a directory from one "
      "checkpointer")


def os_error_text(e: OSError) -> tuple[str, str]:
  """What ``e`` says, and where (" (FILE)", or ""): one raised with a message only
  (FileExistsError("step 3 was committed meanwhile at ...")) has no strerror, and its
  message crosses, never its class's name."""
  what = (e.strerror or (os.strerror(e.errno) if e.errno else "") or str(e)
          or "an error the system did not describe")
  return what, f" ({e.filename})" if e.filename else ""


def write_failure(host_id: int, step: int, final_dir: str, e: BaseException, *,
                  tmp_dir: str = "") -> errors.SidecarError:
  """The error of a host's part of ``step`` that could not be written: an OSError (a full
  disk, an I/O error), or TensorStore's error of one (its ``os_error_code``), is
  CheckpointWriteError with its errno, file and host (a file TensorStore wrote through the
  descriptor of the part's directory ``tmp_dir`` named by its path); our own errors keep
  their kind."""
  if isinstance(e, errors.SidecarError):
    return e
  code, path = getattr(e, "errno", None), getattr(e, "filename", None)
  text = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
  if tmp_dir:
    text = re.sub(r"/proc/self/fd/\d+", lambda _: tmp_dir, text)
  if not isinstance(e, OSError) and (found := _OS_ERROR.search(text)):
    code = int(found.group(1))
    file = _FILE.search(text)
    path = file.group(1) if file else None
  if not isinstance(e, OSError) and code is None:
    return errors.InvalidArgumentError(f"host {host_id} could not write step {step}: {text}")
  path = os.fsdecode(path) if path is not None else final_dir
  name = errno.errorcode.get(code, "") if code is not None else ""
  return errors.CheckpointWriteError(
      f"host {host_id} could not write step {step}: "
      + (text if isinstance(e, OSError) or code is None else f"{os.strerror(code)} ({text})")
      + (f" ({name})" if name else "") + f" writing {path}; make room there (or save to "
      "another directory), then save again", errno=code, path=path, host_id=host_id)


# TensorStore's words for an OS error and its file (in a write's error).
_OS_ERROR = re.compile(r"os_error_code='?(\d+)")
_FILE = re.compile(r'(?:writing|Failed writing:) (?:local file )?"([^"]+)"')
