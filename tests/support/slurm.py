"""A real single-node Slurm for the tests: munged, slurmctld and slurmd from a temp dir.

Debian's ``slurm-wlm`` and ``munge`` are installed with apt-get when missing (about a
minute); the daemons run in the foreground as children of this process, with their
configuration, key, sockets, state, spool, logs and pid files in one temporary directory,
and stop by pid (SIGTERM, then SIGKILL) in :meth:`SlurmCluster.close`, which also cancels
what is still queued. Nothing is written outside that directory but the packages.

Where Slurm cannot start, :class:`SlurmUnavailable` says why, with the daemons' last log
lines: the tests fail with it (they are never skipped).

Example::

  with SlurmCluster() as slurm:
    out = slurm.run(["sbatch", "--wait", "job.sh"])
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

PACKAGES = ("slurm-wlm", "munge")
_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel")
_INSTALL_TIMEOUT_S = 600
_START_TIMEOUT_S = 60


class SlurmUnavailable(RuntimeError):
  """Slurm could not be installed or started here; the message says why."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def ensure_installed() -> None:
  """Installs Debian's slurm-wlm and munge with apt-get if a binary is missing."""
  if all(shutil.which(b) for b in _BINARIES):
    return
  if os.geteuid() != 0 or not shutil.which("apt-get"):
    raise SlurmUnavailable(
        f"Slurm is not installed ({', '.join(b for b in _BINARIES if not shutil.which(b))} "
        "missing) and cannot be installed here: apt-get as root is needed "
        f"(apt-get install {' '.join(PACKAGES)})")
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  for command in (["apt-get", "update", "-q"],
                  ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                   "-o", "DPkg::Lock::Timeout=300", *PACKAGES]):
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=_INSTALL_TIMEOUT_S)
    if done.returncode:
      raise SlurmUnavailable(f"{' '.join(command)} failed ({done.returncode}):\n"
                             + (done.stdout + done.stderr)[-3000:])
  missing = [b for b in _BINARIES if not shutil.which(b)]
  if missing:
    raise SlurmUnavailable(f"apt-get installed {PACKAGES} but {missing} are still missing")


def _first_job_id() -> int:
  """Where this process's clusters number their jobs from: apart from another suite's on
  the machine (its clusters start at 1 too, and a job's files are named by its id:
  /tmp/sidecar-slurm-ID-*). Within Slurm's MaxJobId (67,043,328)."""
  return 1000 + (os.getpid() % 600_000) * 100


class SlurmCluster:
  """munged, slurmctld and slurmd for one node (this machine), until :meth:`close`.

  ``env`` is what a client command needs (``SLURM_CONF``); :meth:`run` runs one with it.
  """

  def __init__(self, *, cpus: int = 2, oversubscribe: int = 4):
    self.cpus, self.oversubscribe = cpus, oversubscribe
    self.dir: str | None = None
    self.procs: dict[str, subprocess.Popen] = {}
    self.node = socket.gethostname()

  @property
  def conf(self) -> str:
    assert self.dir is not None
    return os.path.join(self.dir, "slurm.conf")

  @property
  def env(self) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": self.conf}

  def start(self) -> SlurmCluster:
    ensure_installed()
    self.dir = tempfile.mkdtemp(prefix="sidecar-slurm-")
    os.chmod(self.dir, 0o755)  # munged (the munge user) and job steps reach inside
    try:
      self._start_munge()
      self._write_conf()
      self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.conf])
      self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf])
      self._wait_idle()
    except BaseException:
      self.close()
      raise
    return self

  def _start_munge(self) -> None:
    import pwd
    munge = pwd.getpwnam("munge")
    d = os.path.join(self._dir(), "munge")
    os.mkdir(d, 0o711)  # munged requires execute for all on its socket's directory
    key = os.path.join(d, "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(128))
    for path in (d, key):
      os.chown(path, munge.pw_uid, munge.pw_gid)
    os.chmod(key, 0o600)
    self._spawn("munged", [
        "munged", "-F", f"--socket={d}/munge.socket", f"--key-file={key}",
        f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid",
        f"--seed-file={d}/munged.seed"], user=munge.pw_uid, group=munge.pw_gid)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not os.path.exists(f"{d}/munge.socket"):
      self._check_alive("munged")
      if time.monotonic() > deadline:
        raise SlurmUnavailable("munged did not create its socket in time" + self._logs())
      time.sleep(0.05)

  def _dir(self) -> str:
    assert self.dir is not None
    return self.dir

  def _write_conf(self) -> None:
    d = self._dir()
    for sub in ("state", "spool"):
      os.mkdir(os.path.join(d, sub))
    text = f"""\
ClusterName=sidecartest
SlurmctldHost={self.node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
FirstJobId={_first_job_id()}
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
SchedulerParameters=defer_batch=0
NodeName={self.node} CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=FORCE:{self.oversubscribe}
"""
    with open(self.conf, "w") as f:
      f.write(text)

  def _spawn(self, name: str, args: Sequence[str], **kwargs) -> None:
    log = open(os.path.join(self._dir(), f"{name}.out"), "wb")
    with log:
      self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          **kwargs)

  def _check_alive(self, name: str) -> None:
    code = self.procs[name].poll()
    if code is not None:
      raise SlurmUnavailable(f"{name} exited with code {code} at start" + self._logs())

  def _wait_idle(self) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
      for name in self.procs:
        self._check_alive(name)
      done = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env,
                            capture_output=True, text=True, timeout=30)
      last = (done.stdout + done.stderr).strip()
      if done.returncode == 0 and last in ("idle", "mix", "alloc"):
        return
      time.sleep(0.2)
    raise SlurmUnavailable(f"the node did not become idle in {_START_TIMEOUT_S} s (sinfo: "
                           f"{last!r})" + self._logs())

  def _logs(self) -> str:
    out = []
    for name in ("munged", "slurmctld", "slurmd"):
      for path in (os.path.join(self._dir(), f"{name}.out"),
                   os.path.join(self._dir(), f"{name}.log"),
                   os.path.join(self._dir(), "munge", f"{name}.log")):
        try:
          with open(path, errors="replace") as f:
            lines = f.read().splitlines()[-8:]
        except OSError:
          continue
        if lines:
          out.append(f"--- {path}:\n" + "\n".join(lines))
    return ("\n" + "\n".join(out)) if out else ""

  def run(self, args: Sequence[str], *, timeout: float = 120, check: bool = True,
          env: Mapping[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Runs a Slurm client command (``SLURM_CONF`` set); its output as text."""
    done = subprocess.run(list(args), env={**self.env, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, **kwargs)
    if check and done.returncode:
      raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}"
                           f"{done.stderr}")
    return done

  def jobs(self) -> list[str]:
    """The ids of the jobs still queued or running."""
    done = self.run(["squeue", "-h", "-o", "%i"], check=False)
    return done.stdout.split()

  def close(self) -> None:
    """Cancels every job, stops the daemons by pid, removes the directory; idempotent."""
    if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
      subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env,
                     capture_output=True, timeout=30)
      deadline = time.monotonic() + 20
      while self.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    for name in ("slurmd", "slurmctld", "munged"):
      proc = self.procs.pop(name, None)
      if proc is None or proc.poll() is not None:
        continue
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(15)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if self.dir is not None:
      shutil.rmtree(self.dir, ignore_errors=True)
      self.dir = None

  def __enter__(self) -> SlurmCluster:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()
