"""One job per checkpoint directory: the jobs that hold a directory, on the sidecars that
serve them.

Two jobs saving into one directory defeat each other's ``max_to_keep``, sweep each other's
uncommitted steps and merge their goodput ledgers. So a job holds each directory it
opens, and another job's open of it is refused while the holder lives.

**Who holds.** Every open names its job (``CheckpointOpenRequest.job``: ``SIDECAR_JOB``,
which ``sidecar launch`` sets once per launch, or a Slurm job, a JobSet, process 0's
random id: the same in every process of one job and in its restarts). Each sidecar on
which a process of the job opened the directory holds a shared ``flock`` on the job's
lock file, ``<directory>/.sidecar-jobs/<digest of the job>.lock`` (JSON: the job, who
opened it, which sidecar, since when), for as long as one of those openers lives: its
Worker attached (it detaches as its process dies), else its handshake session. So the
processes of one job, on one sidecar or many, never refuse each other; a trainer restarted
under ``sidecar launch --max-restarts`` is the same job and goes on at once.

**Who is refused.** An open by another job tries every other lock file in
``.sidecar-jobs/`` with an exclusive lock that does not wait: one it cannot lock is a live
job's, and the open is refused (``PermissionDeniedError`` naming that job, who opened it,
through which sidecar, and the directory); one it can lock is a job that is gone, and is
removed. The kernel lets go of a sidecar's locks when its process dies (``SIGKILL``
too), and a sidecar lets go of a job's once its last opener there is gone (at the next
open here, and every few seconds, ``release_gone``): a job whose owner died is taken over
with nothing to clean up. A refusal is answered at once; the Checkpointer retries it for
a few seconds (``holds.HELD_WAIT_S``), on its own time: a job that just ended may
still be held by one of its sidecars (each lets go on its own; a SIGKILLed process's
connections close only after its memory is unmapped). Two jobs that open in the same
instant may both be refused; neither is let in beside the other.

Every lock file is made, opened, tried and removed relative to ``.sidecar-jobs/`` opened
once, from the checkpoint root with no symlink followed (``Roots.open``): a directory
swapped for a symlink after the open was checked cannot plant this job's lock in another
tenant's directory, nor remove one of its own there (issue 76).

``flock`` holds between processes of one machine and, on NFS, between machines (Linux
maps it to NFS byte-range locks); on a file system whose locks are local to each machine
(gcsfuse, some FUSE mounts) it guards each machine alone.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.core import errors

log = logging.getLogger(__name__)

JOBS_DIR = ".sidecar-jobs"  # in a checkpoint directory: one lock file per job that opened it
RELEASE_S = 5.0  # a sidecar lets go of a gone job's directories within this (the reaper)
_MAX_CLAIM = 4096  # bytes of a lock file read for its message
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass
class _Held:
  """A job's shared lock on a directory's lock file, and who opened it through here."""

  job: str
  fd: int
  openers: list[Callable[[], bool]]


class Jobs:
  """The jobs each checkpoint directory is held by, on one sidecar (``host_id``), whose
  directories ``open_dir`` opens (``Roots.open``: a resolved path from its root, no
  symlink followed; ``make``: made where missing)."""

  def __init__(self, host_id: int, *, open_dir: Callable[..., DirFd]):
    self._host_id = host_id
    self._open_dir = open_dir
    self._lock = threading.Lock()
    self._held: dict[tuple[str, str], _Held] = {}  # (resolved directory, job) -> its lock

  def open(self, directory: str, job: str, *, holder: str, alive: Callable[[], bool]) -> None:
    """Holds ``directory`` (resolved) for ``job`` while ``alive()``; PermissionDeniedError
    naming the other job where another live job holds it. A job of "" (an older client)
    holds nothing; a directory that cannot be made or written is left to the open's own
    check (``StepWriter.open`` says why)."""
    if not job:
      return
    with self._lock:
      self._release_gone()
      held = self._held.get((directory, job))
      if held is not None:
        held.openers.append(alive)
        return
      try:
        jobs = self._jobs_dir(directory)
      except OSError as e:
        log.info("not holding %s for job %r: %s", directory, job, e.strerror or e)
        return
      with jobs:
        try:
          fd = self._hold(jobs, job, holder)
        except OSError as e:
          log.info("not holding %s for job %r: %s", directory, job, e.strerror or e)
          return
        try:
          self._refuse_others(jobs, directory, job)
        except BaseException:
          os.close(fd)
          raise
      self._held[(directory, job)] = _Held(job, fd, [alive])

  def release_gone(self) -> None:
    """Lets go of the directories whose every opener here is gone."""
    with self._lock:
      self._release_gone()

  def close(self) -> None:
    """Lets go of every directory (the sidecar stops); idempotent."""
    with self._lock:
      for held in self._held.values():
        os.close(held.fd)
      self._held.clear()

  def _release_gone(self) -> None:
    for key, held in list(self._held.items()):
      if not any(_alive(a) for a in held.openers):
        del self._held[key]
        os.close(held.fd)
        log.info("job %r no longer holds %s: its last opener on host %d is gone", held.job,
                 key[0], self._host_id)

  def _jobs_dir(self, directory: str) -> DirFd:
    """``directory``'s ``.sidecar-jobs/``, made where missing, opened from the root."""
    with self._open_dir(directory, make=True) as d:
      return d.child(JOBS_DIR, make=True)

  def _hold(self, jobs: DirFd, job: str, holder: str) -> int:
    """A descriptor of the job's lock file in ``jobs`` (a directory's ``.sidecar-jobs/``),
    made if missing, with a shared lock on it (the file it is at once the lock is taken:
    one removed as a gone job's meanwhile is made again)."""
    name = f"{hashlib.sha256(job.encode()).hexdigest()[:24]}.lock"
    claim = json.dumps({"job": job, "holder": holder, "since": time.strftime("%FT%T%z"),
                        "sidecar": f"host {self._host_id} (pid {os.getpid()} on "
                                   f"{socket.gethostname()})"})
    for _ in range(100):
      _make(jobs, name, claim)
      try:
        fd = os.open(name, _FLAGS, dir_fd=jobs.fd)
      except FileNotFoundError:
        continue  # removed as a gone job's between the two: make it again
      try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another open tries it
        if _same_file(fd, jobs, name):
          return fd
      except BaseException:
        os.close(fd)
        raise
      os.close(fd)
    raise OSError(errno.EAGAIN, f"{jobs.join(name)} is removed as fast as it is made")

  def _refuse_others(self, jobs: DirFd, directory: str, job: str) -> None:
    """PermissionDeniedError if another job's lock file in ``jobs`` (``directory``'s) is
    held; the lock files of jobs that are gone are removed."""
    mine = f"{hashlib.sha256(job.encode()).hexdigest()[:24]}.lock"
    for name in jobs.names():
      if name == mine or not name.endswith(".lock"):
        continue
      try:
        fd = os.open(name, _FLAGS, dir_fd=jobs.fd)
      except FileNotFoundError:
        continue  # removed meanwhile: gone
      except OSError:  # a symlink, say: nobody's lock; it stays, as nobody holds it
        continue
      try:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
          raise _refusal(directory, _claim_of(fd)) from None
        if _same_file(fd, jobs, name):  # gone: nobody holds it
          jobs.unlink(name)
      finally:
        os.close(fd)


def _make(jobs: DirFd, name: str, claim: str) -> None:
  """The lock file ``name`` in ``jobs``, written whole before it appears (a name of its
  own, then linked into place) unless one is there."""
  if jobs.lstat(name) is not None:
    return
  staged = f"{name}.{secrets.token_hex(6)}"
  fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o644, dir_fd=jobs.fd)
  try:
    os.write(fd, claim.encode())
  finally:
    os.close(fd)
  try:
    os.link(staged, name, src_dir_fd=jobs.fd, dst_dir_fd=jobs.fd)
  except FileExistsError:
    pass
  finally:
    jobs.unlink(staged)


def _same_file(fd: int, jobs: DirFd, name: str) -> bool:
  """Whether ``name`` in ``jobs`` is still the file open at ``fd``."""
  st = jobs.lstat(name)
  if st is None:
    return False
  own = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _claim_of(fd: int) -> dict:
  try:
    claim = json.loads(os.pread(fd, _MAX_CLAIM, 0) or b"{}")
  except (OSError, ValueError):
    claim = {}
  return claim if isinstance(claim, dict) else {}


def _alive(alive: Callable[[], bool]) -> bool:
  try:
    return bool(alive())
  except Exception:  # a liveness check that fails says nothing lives
    return False


def _refusal(directory: str, claim: dict) -> errors.PermissionDeniedError:
  job = claim.get("job") or "an unknown job"
  who = ", ".join(str(claim[k]) for k in ("holder",) if claim.get(k)) or "someone"
  sidecar = claim.get("sidecar") or "a sidecar"
  return errors.PermissionDeniedError(
      f"checkpoint directory {directory!r:.300} is held by another live job, {job!r:.200}: "
      f"opened by {who:.200} through the sidecar of {sidecar:.200} since "
      f"{claim.get('since', '?')}. One job saves into a directory: give this job another "
      "directory, or stop that job first (its sidecars let go of the directory as it ends, "
      f"within {RELEASE_S:g} s of its last process's exit; a sidecar killed lets go at once)")
