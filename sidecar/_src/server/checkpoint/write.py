"""The write of one host's share of a step: its writer thread, and what a failed write says.

One thread per step (``save.StepWriter.stage`` starts it with the step's first part,
through ``spawn``, so the owner joins it) takes the shards as they are staged
(``step.Step.arrivals``) and hands them to the step's format (``Format.write``), which
writes and checksums them on idle-class threads; it ends the step's write
(``Step.end_write``: WRITTEN with the records as written, or FAILED).
:func:`write_failure` is the error a trainer (or the step's committer) gets for a write
that failed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
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
    metrics.phase("write", seconds)
    log.info("step %d: wrote %s in %.2f s (%.2f GB/s)", own.step,
             shm.format_size(own.nbytes), seconds, own.nbytes / max(seconds, 1e-9) / 1e9,
             extra={"step": own.step})
  except BaseException as e:
    error = e.with_traceback(None)  # its frames would hold the staged blocks,
    e.__context__ = e.__cause__ = None  # and so would those of the exceptions it chains
    log.error("step %d: writing this host's part failed: %s", own.step, e,
              extra={"step": own.step})
    # Not whole, and its trainers known gone (mid-save: nobody will commit or abort it):
    # it goes. A trainer there, or one whose liveness is not known (no worker session: it
    # stages inline), learns the failure from its next Stage (as one that races this end
    # does), its prepared or its commit, and aborts the save; meanwhile the step keeps its
    # error, not its bytes, and expires as an uncommitted step does (a trainer that never
    # comes back leaves its record, no shard in it, for uncommitted_s: its error, owners
    # and leaf specs).
    if own.end_write(error=error) is step_lib.Phase.STAGING:
      if own.trainers_alive() is False:
        tier.remove(own)
      else:
        own.let_go()
    return
  own.end_write(written)


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
