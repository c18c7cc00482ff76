"""One tenant's process, as the sidecar sees it: started, handed its arenas and jobs,
watched, stopped (ARCHITECTURE.md, "Tenant processes": who starts and stops what).

``TenantProcess.start`` spawns a fresh interpreter (``child.py``; never a fork), which
holds itself to its limits and becomes the tenant's ``uid`` and ``gid`` (where it has
them) before anything of the user's runs, in a process group of its own (its feed
workers' too), with an environment that holds none of the sidecar's secrets, its
temporary directory its ``TMPDIR`` and ``HOME``, and its output a pipe read into the
sidecar's log (prefixed with the tenant, at most ``LOG_LINES_S`` lines a second). It
waits for the child's ``Ready``: limits applied, modules imported. The child's jobs each
get a socketpair of their own (``open_job``); the child exits when its control socket ends
(``stop``, or the sidecar's death).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from sidecar._src.arena import shm
from sidecar._src.core import errors, platform
from sidecar._src.server.feeds import processes as feed_processes
from sidecar._src.server.tenant_procs import limits as limits_lib, messages as m, tmp as tmp_lib
from sidecar._src.wire import protocol

log = logging.getLogger(__name__)

# How long a new process may take to apply its limits and import its modules (JAX, Grain:
# seconds on a loaded machine).
START_S = 120.0
# How long a stopped process gets to exit on its own before its group is killed.
STOP_GRACE = 2.0
# The lines of its output the sidecar logs a second (a burst of BURST at once); the rest is
# counted and said once a second. Its last LAST_LINES go in the error of its death.
LOG_LINES_S = 20
BURST = 100
LAST_LINES = 8
# Environment variables a tenant's process does not get: the sidecar's secrets (its peer
# token, the operator's credentials), by name.
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)


class State(enum.Enum):
  NEW = "new"
  RUNNING = "running"
  STOPPED = "stopped"


def environment(base: dict[str, str], tmp: str) -> dict[str, str]:
  """What a tenant's process is started with: ``base`` (the sidecar's) without its secrets,
  JAX on the CPU (``platform.sidecar_env``), and its temporary directory for every name a
  library looks for one under."""
  env = {k: v for k, v in platform.sidecar_env(base).items() if not SECRET.search(k)}
  env.update(TMPDIR=tmp, TMP=tmp, TEMP=tmp, HOME=tmp)
  return env


class TenantProcess:
  """One tenant's process on this sidecar; ``start`` it, then open its jobs.

  Args:
    limits: what the kernel holds it to (and its user).
    imports: the modules it imports (the sidecar's own ``--import``, and those its
      registry's entries live in).
    tmp_base: where its temporary directory is made.
  """

  def __init__(self, limits: limits_lib.ProcessLimits, *, imports: tuple[str, ...],
               tmp_base: tmp_lib.TmpBase):
    self.limits = limits
    self.tenant = limits.tenant
    self._imports = imports
    self._tmp_base = tmp_base
    self.tmp = ""
    self.state = State.NEW
    self.pid = 0
    self._lock = threading.Lock()  # the control socket's sends, and the state
    self._proc: subprocess.Popen | None = None
    self._control: socket.socket | None = None
    self._arenas: set[int] = set()
    self._stopped_for: errors.SidecarError | None = None
    self._last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
    self._relay: threading.Thread | None = None
    self._jobs = 0  # jobs open now (``TenantProcesses`` retires an idle process)

  # ---- start ------------------------------------------------------------------------------

  def start(self) -> TenantProcess:
    """Starts the process and waits until it is ready.

    Raises:
      ResourceExhaustedError: it met a limit while it started (named); RemoteError: it
        failed or died before it was ready (its error, or its exit and last lines).
    """
    try:
      self._spawn()
      self._hello()
    except BaseException:
      self.stop()
      raise
    self.state = State.RUNNING
    log.info("tenant %r's process started (pid %d, uid %s)", self.tenant, self.pid,
             self.limits.uid if self.limits.uid is not None else os.geteuid())
    return self

  def _spawn(self) -> None:
    limits = self.limits
    self.tmp = self._tmp_base.make(self.tenant, limits.uid, limits.gid)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    self._control = ours
    # Started as the sidecar's user: it becomes its tenant's itself, first thing
    # (limits.apply). Its process group is its own, its feed workers' too: one signal ends
    # them all.
    with theirs:
      self._proc = subprocess.Popen(
          [sys.executable, "-m", "sidecar._src.server.tenant_procs.child",
           str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0,
          cwd=self.tmp, env=environment(dict(os.environ), self.tmp))
    self.pid = self._proc.pid
    self._relay = threading.Thread(target=self._relay_output, name="sidecar-tenant-log",
                                   daemon=True)
    self._relay.start()

  def _hello(self) -> None:
    assert self._control is not None
    # Where the sidecar found its modules, its working directory too (its own is ``tmp``).
    hello = m.Hello(self.tenant, self.limits.to_dict(), self._imports, self.tmp,
                    tuple(p or os.getcwd() for p in sys.path))
    control = self._control
    try:
      m.send(control, hello)
      control.settimeout(START_S)
      reply, _, _ = m.recv(control, (m.Ready, m.Error), what=self._who())
    except (ConnectionError, OSError) as e:
      raise self._death(wait=True, when="before it was ready") from (
          None if isinstance(e, ConnectionError) else e)
    finally:
      control.settimeout(None)
    if isinstance(reply, m.Error):
      raise protocol.error_from_dict(reply.error, host=self._who())

  def _who(self) -> str:
    return f"tenant {self.tenant!r}'s process (pid {self.pid})"

  def _relay_output(self) -> None:
    """Logs the process's output, each line prefixed with its tenant, at most
    ``LOG_LINES_S`` a second (``BURST`` at once); lines past it are counted."""
    assert self._proc is not None and self._proc.stdout is not None
    tokens, last, dropped = float(BURST), time.monotonic(), 0
    output = self._proc.stdout
    for raw in iter(lambda: output.readline(4096), b""):
      line = raw.decode(errors="replace").rstrip("\n")
      self._last.append(line)
      now = time.monotonic()
      tokens, last = min(float(BURST), tokens + (now - last) * LOG_LINES_S), now
      if tokens < 1:
        dropped += 1
        continue
      tokens -= 1
      if dropped:
        log.warning("tenant %r's process: %d lines not logged (more than %d a second)",
                    self.tenant, dropped, LOG_LINES_S)
        dropped = 0
      log.warning("tenant %r's process: %s", self.tenant, protocol.for_log(line))
    with contextlib.suppress(OSError):
      output.close()

  # ---- jobs -------------------------------------------------------------------------------

  def launch(self) -> feed_processes.Launch:
    """How its feed worker processes start: as it started (its limits and user applied
    first, ``feed_worker.py``), with its environment and directory, in its process group.
    Its directory is the tenant's temporary one, so where the sidecar found its modules
    (its own working directory too) is its ``PYTHONPATH``, as the hello tells the process."""
    env = environment(dict(os.environ), self.tmp)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return feed_processes.Launch(
        argv=(sys.executable, "-m", "sidecar._src.server.tenant_procs.feed_worker",
              json.dumps(self.limits.to_dict())),
        env=env, cwd=self.tmp, process_group=self.pid)

  def hand_arena(self, space: int, arena: shm.Arena) -> None:
    """Hands the process the tenant's arena ``space`` (its memfd), once."""
    with self._lock:
      if space in self._arenas:
        return
      self._send(m.ArenaFd(space, arena.size), (arena.fd,))
      self._arenas.add(space)

  def open_job(self) -> socket.socket:
    """A new job's socket: its other end handed to the process. The job is counted open
    until :meth:`job_closed`.

    Raises:
      SidecarError: the process is gone (the error its death says).
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      with theirs, self._lock:
        self._send(m.JobFd(), (theirs.fileno(),))
        self._jobs += 1
    except BaseException:
      ours.close()
      raise
    return ours

  def job_closed(self) -> None:
    with self._lock:
      self._jobs -= 1

  @property
  def jobs(self) -> int:
    """Its jobs open now."""
    with self._lock:
      return self._jobs

  def _send(self, message: m.Message, fds: tuple[int, ...]) -> None:
    if self.state is not State.RUNNING or self._control is None:
      raise self.death()
    try:
      m.send(self._control, message, fds=fds)
    except OSError:
      raise self.death() from None

  # ---- death and stop ---------------------------------------------------------------------

  def alive(self) -> bool:
    """Whether the process still runs (not reaped: a zombie is dead)."""
    if self._proc is None or self.state is State.STOPPED:
      return False
    try:
      found = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
      return False
    return found is None

  def death(self, *, wait: bool = True) -> errors.SidecarError:
    """The error that the process's end stands for, for its jobs: the limit it was stopped
    for, the signal that killed it, or its exit (``wait``: a moment for it to end)."""
    return self._death(wait=wait, when="while it served its tenant's requests")

  def _death(self, *, wait: bool, when: str) -> errors.SidecarError:
    if self._stopped_for is not None:
      return self._stopped_for
    code = self._exit_code(2.0 if wait else 0.0)
    if code is None:
      return errors.RemoteError("TenantProcessGone", f"{self._who()} ended a job without an "
                                "answer; the sidecar serves on")
    how = f"exit code {code}"
    if code < 0:
      with contextlib.suppress(ValueError):
        how = f"killed by {signal.Signals(-code).name}"
    last = "; its last lines: " + " | ".join(self._last) if self._last else ""
    fix = ("its requests in flight failed; the next starts a new process, and other "
           "tenants' work, in their processes, went on")
    if code == -signal.SIGKILL or code in (-signal.SIGXCPU, -signal.SIGXFSZ):
      return errors.ResourceExhaustedError(
          f"{self._who()} was {how} {when}: the kernel's OOM killer ends a process past the "
          f"memory it may have ({self.limits.why('memory')} for each of its processes), "
          f"or an operator did; {fix}{last}")
    return errors.RemoteError(
        "TenantProcessDied", f"{self._who()} died ({how}) {when}: a crash in native code of "
        f"its pipelines or functions, or an import that failed; {fix}{last}")

  def _exit_code(self, wait_s: float) -> int | None:
    """The process's exit status once it ended (within ``wait_s``), without reaping it;
    None while it runs."""
    if self._proc is None:
      return None
    if self._proc.returncode is not None:
      return self._proc.returncode
    deadline = time.monotonic() + wait_s
    while True:
      try:
        found = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
      except ChildProcessError:
        return self._proc.returncode
      if found is not None:
        return -found.si_status if found.si_code in (os.CLD_KILLED, os.CLD_DUMPED) \
            else found.si_status
      if time.monotonic() >= deadline:
        return None
      time.sleep(0.02)

  def stop(self, why: errors.SidecarError | None = None) -> None:
    """Stops the process (``why``: the error its jobs in flight get, a limit it passed):
    its control socket closed (it kills its group and exits), its group killed after
    ``STOP_GRACE`` seconds if it is still there, reaped; its temporary directory removed.
    Idempotent."""
    with self._lock:
      if self.state is State.STOPPED:
        return
      self.state = State.STOPPED
      if why is not None:
        self._stopped_for = why
      control, self._control = self._control, None
    if control is not None:
      control.close()
    if self._proc is not None:
      self._reap()
    if self._relay is not None:
      self._relay.join(5.0)
    if self.tmp:
      self._tmp_base.remove(self.tmp, self.limits.uid)

  def _reap(self) -> None:
    """Waits for the process (``STOP_GRACE``), kills its group (its feed workers too,
    whatever they do), then reaps it: its pid is held until then, so the group killed is
    its own."""
    assert self._proc is not None
    if self._exit_code(STOP_GRACE) is None:
      log.warning("%s still ran %g s after it was stopped; killing it", self._who(), STOP_GRACE)
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(self.pid, signal.SIGKILL)
    self._proc.wait()

  def kill(self) -> None:
    """Kills the process's group at once (its jobs then fail with the error its death
    says); ``stop`` reaps it."""
    if self._proc is not None and self._proc.returncode is None:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(self.pid, signal.SIGKILL)
