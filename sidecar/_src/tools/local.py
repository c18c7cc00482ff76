"""LocalCluster: real ``sidecar serve`` processes on this machine, one per simulated host."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sidecar._src.arena import shm
from sidecar._src.core import env as env_lib, errors, platform
from sidecar._src.server.pool import pool_file
from sidecar._src.wire import ipc

if TYPE_CHECKING:  # JAX and the controller load on first use: `sidecar launch` needs neither
  from sidecar._src.jax.controller import Controller
  from sidecar._src.jax.worker import Worker

TRANSPORTS = ("unix", "tcp")
PREFIX = "sidecar-local-"
# In each cluster's directory: which process made it (pid, boot id, pid namespace), so a
# later start removes a directory whose owner was SIGKILLed (its close() never ran).
OWNER_FILE = "owner.json"
# Seconds a sidecar may take to stop after SIGTERM (a write in flight ends first) before SIGKILL.
STOP_GRACE_S = 10.0
# The LocalClusters running in this process: several may (each has its own sidecars,
# ports, sockets and temp directory); error messages name them.
_running: weakref.WeakSet = weakref.WeakSet()


def running() -> list[LocalCluster]:
  """The LocalClusters started in this process and not closed yet."""
  return [c for c in list(_running) if c._dir is not None]


def _write_secret(path: str, text: str) -> None:
  """``text`` in a new file at ``path`` that only this user may read."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with open(fd, "w") as f:
    f.write(text + "\n")


def configure_jax_devices(count: int) -> None:
  """Makes the JAX CPU backend of this process show at least ``count`` devices."""
  import jax
  flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  try:  # Never fewer than XLA_FLAGS asks for: other code in the process may count on them.
    jax.config.update("jax_num_cpu_devices", max(count, int(flag.group(1)) if flag else 0))
  except RuntimeError:
    pass  # Backends already started: check below whether they fit.
  have = len(jax.devices("cpu"))
  if have < count:
    others = running()
    raise errors.InvalidArgumentError(
        f"LocalCluster needs {count} CPU devices but JAX already started with {have}"
        + (f" (for {', '.join(map(repr, others))}, still running)" if others else "")
        + "; create the LocalCluster before the first JAX computation (in a notebook: "
        f"restart the kernel), or set XLA_FLAGS=--xla_force_host_platform_device_count={count}")


class LocalCluster:
  """Real sidecars, real gRPC, real shared memory, on one machine.

  Example::

    with sidecar.testing.LocalCluster(num_hosts=4, devices_per_host=2,
                                      imports=["my_pkg.sidecar_fns"]) as cluster:
      with cluster.controller() as ctl:
        ctl.call("my_fn", args=(1, 2))

  Host ``h`` owns JAX CPU devices ``[h * devices_per_host, (h + 1) * devices_per_host)``
  of this process. ``host_env`` adds environment variables to one host's sidecar.
  With ``assign_device_ids=False`` the sidecars get no device ids at start: each learns its
  devices from the trainer process that attaches to it (as under ``sidecar launch``).
  ``checkpoint_roots``: the directories the sidecars may checkpoint in (and below), by
  default the system temp directory and the working directory (``--checkpoint-root``).
  ``metrics=True``: each sidecar serves Prometheus metrics on a free port (``metrics_urls``).
  ``log_dir``: where each sidecar writes its output, ``host<i>.log`` (made if missing, kept
  at close: ``sidecar launch --log-dir``); by default the cluster's temp directory, gone
  with it.
  ``transport``: ``"unix"`` (the default) serves each sidecar's gRPC and health on a Unix
  socket of the cluster's temp directory, ``unix:PATH``: no ports, nothing on the network,
  so it runs where TCP is refused; ``"tcp"`` on free ports of 127.0.0.1.
  Everything started is stopped on exit, also when the body raises, and on SIGTERM to this
  process where nothing else handles it (the process then dies of it, as it would have).
  After a SIGKILL its sidecars stop by themselves (they watch their parent), and the next
  LocalCluster start (or ``sidecar local``) removes the temp directory (``remove_orphans``).
  """

  def __init__(self, num_hosts: int = 4, devices_per_host: int = 2, *,
               shm_size: int | str = "128MiB", imports: Sequence[str] = (),
               token: str | None = None, start_timeout: float = 60.0,
               configure_jax: bool = True, extra_args: Sequence[str] = (),
               host_env: Mapping[int, Mapping[str, str]] | None = None,
               assign_device_ids: bool = True,
               checkpoint_roots: Sequence[str] | None = None, metrics: bool = False,
               transport: str = "unix", pool: str | None = None,
               log_dir: str | None = None):
    if not isinstance(num_hosts, int) or num_hosts < 1:
      raise errors.InvalidArgumentError(f"num_hosts must be a positive int, got {num_hosts!r}")
    if not isinstance(devices_per_host, int) or devices_per_host < 1:
      raise errors.InvalidArgumentError(
          f"devices_per_host must be a positive int, got {devices_per_host!r}")
    if isinstance(imports, str):
      raise errors.InvalidArgumentError(f"imports must be a list of module names, got {imports!r}")
    if transport not in TRANSPORTS:
      raise errors.InvalidArgumentError(
          f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    self.transport = transport
    self.num_hosts = num_hosts
    self.devices_per_host = devices_per_host
    self.shm_size = shm.parse_size(shm_size)
    self.imports = tuple(imports)
    if pool is not None and token is not None:
      raise errors.InvalidArgumentError(
          "pool= and token= exclude each other: a pool file holds its tenants' tokens; give "
          "each tenant's Controller its own token= instead")
    # A pool file (sidecar serve --pool): its tenants' tokens and quotas; reload() rereads it.
    self.pool = None if pool is None else os.path.abspath(pool)
    # The pool's operator token file where the pool file names one; else the cluster makes
    # one in its directory at start (operator_token_file) and gives it to the sidecars.
    self._operator_token_file = None if pool is None else pool_file.operator_token_file(pool)
    self.token = token
    # The sidecars' own secret: only sessions that present it may send replicas.
    self._replica_token = secrets.token_hex(16)
    self.start_timeout = start_timeout
    self._configure_jax = configure_jax
    self._extra_args = tuple(extra_args)
    self._host_env = {h: dict(e) for h, e in (host_env or {}).items()}
    self._assign_device_ids = assign_device_ids
    self._metrics = metrics
    if isinstance(checkpoint_roots, str):
      raise errors.InvalidArgumentError(
          f"checkpoint_roots must be a list of directories, got {checkpoint_roots!r}")
    # Where the sidecars may checkpoint: by default the temp directory and the working one.
    self.checkpoint_roots = tuple(os.path.abspath(r) for r in (
        (tempfile.gettempdir(), os.getcwd()) if checkpoint_roots is None else checkpoint_roots))
    self._log_dir = None if log_dir is None else os.path.abspath(log_dir)
    self._procs: list[subprocess.Popen] = []
    self._ready: list[dict[str, Any]] = []
    self._dir: str | None = None
    self._finalizer: weakref.finalize | None = None

  # ---- lifecycle ---------------------------------------------------------

  def start(self) -> LocalCluster:
    if self._dir is not None:
      return self
    if self._configure_jax:
      configure_jax_devices(self.num_hosts * self.devices_per_host)
    remove_orphans()
    self._dir = ipc.socket_dir(PREFIX)  # the sidecars' sockets and files
    _write_owner(self._dir)
    # A cluster dropped without close() (a notebook cell that makes one again, rebinding
    # its name) stops its sidecars when it is collected; close() is the main path.
    self._finalizer = weakref.finalize(self, _stop, self._procs, self._dir)
    _running.add(self)
    _catch_sigterm()
    try:
      if self._log_dir is not None:
        os.makedirs(self._log_dir, mode=0o700, exist_ok=True)
      if self.pool and self._operator_token_file is None:  # the pool file names none
        _write_secret(self.operator_token_file, secrets.token_hex(16))
      for h in range(self.num_hosts):
        self._procs.append(self._spawn(h))
      self._ready = [self._wait_ready(h) for h in range(self.num_hosts)]
      self._write_replica_hosts()
    except BaseException:
      self.close()
      raise
    return self

  def _write_replica_hosts(self) -> None:
    """The sidecars' --replica-hosts-file: every sidecar's address by host id, once each
    serves (over TCP their ports are known only then). Written whole, then renamed."""
    path = self._replica_hosts()
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.write("\n".join(self.addresses) + "\n")
    os.replace(path + ".tmp", path)

  def _spawn(self, h: int, *, port: int = 0, health_port: int = 0) -> subprocess.Popen:
    d = self.devices_per_host
    ids = (["--device-ids", ",".join(str(i) for i in range(h * d, (h + 1) * d))]
           if self._assign_device_ids else [])
    listen = (["--listen", f"unix:{self._path(h, 'grpc')}"] if self.transport == "unix" else
              ["--listen", "127.0.0.1", "--port", str(port), "--health-port", str(health_port)])
    args = [sys.executable, "-m", "sidecar", "serve", "--host-id", str(h), "--slice-id", "0",
            *ids, *listen, "--socket", self.socket(h), "--shm-size", str(self.shm_size),
            "--ready-file", self._path(h, "json"), "--exit-with-parent", str(os.getpid()),
            # The job's sidecars, the only replica targets: written once all serve.
            "--replica-hosts-file", self._replica_hosts(),
            *(f"--checkpoint-root={r}" for r in self.checkpoint_roots),
            *(["--metrics-port", "0"] if self._metrics else []),
            *(["--pool", self.pool] if self.pool else []),
            *(["--operator-token-file", self.operator_token_file]
              if self.pool and self._operator_token_file is None else []),
            *self._extra_args]
    for module in self.imports:
      args += ["--import", module]
    # JAX on the CPU, no accelerator in sight (core/platform.py); `sidecar serve` sets it
    # again itself, whatever host_env says.
    env = dict(platform.sidecar_env(os.environ), PYTHONUNBUFFERED="1", **self._host_env.get(h, {}))
    if self.token:
      env[env_lib.TOKEN] = self.token
    elif self.pool:  # the pool file holds every token: none from this environment
      env.pop(env_lib.TOKEN, None)
    env.pop(env_lib.TOKEN_FILE, None)
    if self.pool:
      env.pop(env_lib.CLIENT_TOKENS_FILE, None)
    env[env_lib.PEER_TOKEN] = self._replica_token
    env.pop(env_lib.PEER_TOKEN_FILE, None)
    env.pop(env_lib.REPLICA_HOSTS, None)  # the file above names them
    env.pop(env_lib.REPLICA_HOSTS_FILE, None)
    if not self._assign_device_ids:
      env.pop(env_lib.DEVICE_IDS, None)  # `sidecar serve` would read it as --device-ids
    log = open(self.log_path(h), "ab")  # a restarted host appends
    with log:  # The child keeps its own copy of the descriptor.
      return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                              stdin=subprocess.DEVNULL, start_new_session=True)

  def _path(self, h: int, ext: str) -> str:
    if self._dir is None:
      raise errors.ClosedError("this LocalCluster is not running; use it in a with block")
    return os.path.join(self._dir, f"host{h}.{ext}")

  def _replica_hosts(self) -> str:
    return os.path.join(os.path.dirname(self._path(0, "json")), "replica-hosts")

  def socket(self, host_id: int) -> str:
    """The worker Unix socket of host ``host_id``."""
    return self._path(host_id, "sock")

  def _wait_ready(self, h: int) -> dict[str, Any]:
    deadline = time.monotonic() + self.start_timeout
    path = self._path(h, "json")
    while time.monotonic() < deadline:
      if os.path.exists(path):
        with open(path) as f:
          return json.load(f)
      if self._procs[h].poll() is not None:
        raise errors.HostLostError(
            f"sidecar host {h} exited with code {self._procs[h].returncode} at start:\n"
            + self.log(h)[-3000:], host_id=h)
      time.sleep(0.02)
    raise errors.HostLostError(
        f"sidecar host {h} was not ready after {self.start_timeout:.3g} s:\n"
        + self.log(h)[-3000:], host_id=h)

  @property
  def operator_token_file(self) -> str:
    """With a pool file, the file that holds the pool's operator token, which reads every
    tenant's row (``sidecar pool status --token-file FILE``) and drops RAM-tier copies: the
    pool file's ``operator_token_file``, else one the cluster made (mode 0600, in its
    directory, gone at close)."""
    if self._operator_token_file is not None:
      return self._operator_token_file
    if self._dir is None:
      raise errors.ClosedError("this LocalCluster is not running; use it in a with block")
    return os.path.join(self._dir, "operator.token")

  def scratch(self, name: str) -> str:
    """Directory ``name`` in the cluster's own directory, made if missing; it goes with the
    cluster (at close, or when a later cluster finds its owner dead)."""
    if self._dir is None:
      raise errors.ClosedError("this LocalCluster is not running; use it in a with block")
    path = os.path.join(self._dir, name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path

  def log_path(self, host_id: int) -> str:
    """The file host ``host_id``'s sidecar writes its output to (a reload's result too):
    in ``log_dir`` where given (kept), else in the cluster's directory."""
    if self._log_dir is None:
      return self._path(host_id, "log")
    return os.path.join(self._log_dir, f"host{host_id}.log")

  def log(self, host_id: int) -> str:
    """What host ``host_id``'s sidecar printed so far."""
    try:
      with open(self.log_path(host_id), errors="replace") as f:
        return f.read()
    except (OSError, errors.ClosedError):
      return ""

  def poll(self, host_id: int) -> int | None:
    """Host ``host_id``'s sidecar's exit code (negative: killed by that signal), None if alive."""
    return self._procs[host_id].poll()

  def kill(self, host_id: int) -> None:
    """SIGKILLs host ``host_id``'s sidecar (fault injection) and reaps it."""
    proc = self._procs[host_id]
    if proc is not None and proc.poll() is None:
      proc.kill()
      proc.wait()

  def restart(self, host_id: int) -> None:
    """Starts host ``host_id``'s sidecar again, at its old address, after it exited.

    It comes back as a new process with an empty arena, as a replaced host's sidecar
    does; a Controller sees it again when its watch probes lost hosts (``rejoin=True``).
    """
    if self._procs[host_id].poll() is None:
      raise errors.InvalidArgumentError(
          f"host {host_id}'s sidecar is still running (pid {self.pid(host_id)}); kill it "
          "first (cluster.kill) or stop it")
    old = self._ready[host_id]
    with contextlib.suppress(FileNotFoundError):
      os.remove(self._path(host_id, "json"))
    self._procs[host_id] = self._spawn(host_id, port=int(old.get("port") or 0),
                                       health_port=int(old.get("health_port") or 0))
    self._ready[host_id] = self._wait_ready(host_id)

  def close(self, grace: float = STOP_GRACE_S) -> None:
    """Stops every sidecar (SIGTERM, then SIGKILL after ``grace`` seconds) and removes the
    temp dir; idempotent."""
    if self._finalizer is not None:
      self._finalizer.detach()
      self._finalizer = None
    _stop(self._procs, self._dir, grace)
    self._procs = []
    self._dir = None
    _running.discard(self)
    _release_sigterm()

  def __repr__(self) -> str:
    state = "running" if self._dir is not None else "closed"
    where = f", sidecars at {self.addresses}" if self._dir is not None and self._ready else ""
    return (f"LocalCluster({self.num_hosts} hosts x {self.devices_per_host} devices, {state}"
            f"{where})")

  def __enter__(self) -> LocalCluster:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- access ------------------------------------------------------------

  @property
  def addresses(self) -> list[str]:
    """Each host's gRPC address, by host id: ``unix:PATH``, or ``127.0.0.1:PORT`` (tcp)."""
    return [str(r["address"]) for r in self._ready]

  @property
  def health_addresses(self) -> list[str]:
    """Each host's grpc.health.v1 address: its gRPC address itself on a Unix socket."""
    return [str(r["address"]) if self.transport == "unix" else f"127.0.0.1:{r['health_port']}"
            for r in self._ready]

  def host_entry(self, host_id: int) -> str:
    """Host ``host_id``'s entry of ``SIDECAR_HOSTS``: ``unix:PATH`` or ``HOST:PORT:HEALTH``."""
    r = self._ready[host_id]
    if self.transport == "unix":
      return str(r["address"])
    return f"{r['address']}:{r['health_port']}"

  @property
  def metrics_urls(self) -> list[str]:
    """Each sidecar's Prometheus endpoint (``metrics=True``), e.g.
    ``http://127.0.0.1:41234/metrics``."""
    if not self._metrics:
      raise errors.InvalidArgumentError(
          "this LocalCluster serves no metrics; make it with LocalCluster(..., metrics=True)")
    return [f"http://127.0.0.1:{r['metrics_port']}/metrics" for r in self._ready]

  def pid(self, host_id: int) -> int:
    return self._procs[host_id].pid

  def reload(self) -> None:
    """Makes every sidecar read its pool file again (SIGHUP), as an operator would after
    editing it; a bad file is logged by each sidecar and changes nothing."""
    if self.pool is None:
      raise errors.InvalidArgumentError(
          "this LocalCluster has no pool file; make it with LocalCluster(..., pool=FILE)")
    for proc in self._procs:
      if proc.poll() is None:
        proc.send_signal(signal.SIGHUP)

  def devices(self, host_id: int) -> list[Any]:
    """The JAX devices of this process that host ``host_id`` owns."""
    import jax
    d = self.devices_per_host
    return jax.devices("cpu")[host_id * d:(host_id + 1) * d]

  def controller(self, **kwargs: Any) -> Controller:
    """A Controller of every host, attached to their arenas."""
    from sidecar._src.jax.controller import Controller
    kwargs.setdefault("token", self.token)
    return Controller(self.addresses, **kwargs)

  def worker(self, host_id: int) -> Worker:
    """A new Worker attached to host ``host_id``'s sidecar."""
    from sidecar._src.jax.worker import Worker
    return Worker(self.socket(host_id))


def _on_sigterm(signum: int, frame: Any) -> None:
  """SIGTERM to a process whose LocalClusters run: stops them (sidecars, temp directory),
  then dies of SIGTERM as it would have (its default action left the directory behind)."""
  del frame
  for cluster in running():
    cluster.close()
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)


def _catch_sigterm() -> None:
  """Installs ``_on_sigterm`` where SIGTERM has its default action (a program that
  handles SIGTERM itself, as ``sidecar launch`` does, closes its clusters itself)."""
  if (threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
    signal.signal(signal.SIGTERM, _on_sigterm)


def _release_sigterm() -> None:
  """Gives SIGTERM its default action back once no LocalCluster of this process runs."""
  if (not running() and threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGTERM) is _on_sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop(procs: list[subprocess.Popen], directory: str | None,
          grace: float = STOP_GRACE_S) -> None:
  """Stops sidecars (SIGTERM, then SIGKILL after ``grace`` seconds) and removes their
  directory."""
  for proc in procs:
    if proc is not None and proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace
  for proc in procs:
    if proc is None:
      continue
    try:
      proc.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  if directory is not None:
    shutil.rmtree(directory, ignore_errors=True)


def _owner() -> dict[str, Any]:
  """This process as a directory's owner: a pid means something only on the same kernel
  boot and in the same pid namespace."""
  try:
    pid_ns = os.readlink("/proc/self/ns/pid")
  except OSError:
    pid_ns = ""
  return {"pid": os.getpid(), "boot_id": shm.boot_id(), "pid_ns": pid_ns}


def _write_owner(directory: str) -> None:
  tmp = os.path.join(directory, OWNER_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(_owner(), f)
  os.replace(tmp, os.path.join(directory, OWNER_FILE))  # whole or absent, never half


def _orphaned(directory: str, here: dict[str, Any]) -> bool:
  """Whether ``directory`` is a LocalCluster's of ours whose owner process is dead."""
  try:
    if os.lstat(directory).st_uid != os.getuid():
      return False
    with open(os.path.join(directory, OWNER_FILE)) as f:
      owner = json.load(f)
    pid = owner["pid"]
    if (not isinstance(pid, int) or pid <= 0 or not here["boot_id"]
        or owner.get("boot_id") != here["boot_id"] or owner.get("pid_ns") != here["pid_ns"]):
      return False  # another kernel's or namespace's pid: can't tell, so keep it
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except (OSError, ValueError, KeyError, TypeError):
    return False  # not ours, not written yet, or its owner runs (EPERM: someone's else)
  return False


def remove_orphans() -> list[str]:
  """Removes the directories of LocalClusters whose process died without closing them
  (SIGKILL, a crash), in the temp directory and /tmp; returns them. A directory is
  removed only where it is ours (our uid, our prefix, an owner file) and its owner's pid,
  on this boot and in this pid namespace, is gone: never a live process's."""
  here = _owner()
  removed = []
  for parent in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
    for directory in glob.glob(os.path.join(glob.escape(parent), PREFIX + "*")):
      if _orphaned(directory, here):
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
  return removed
