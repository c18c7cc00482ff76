"""What runs inside each Slurm task: the sidecars' wrapper and the trainers' wrapper.

``sidecar slurm _sidecars`` (one task per node, or per array task of a service) starts
this node's share of sidecars as ``sidecar serve`` child processes, each with its worker
socket in a private temporary directory on the node's local disk, and writes each one's
entry in the rendezvous directory once it serves (core/rendezvous.py). When one exits it
writes ``hosts/H.exit`` (the others serve on); on SIGTERM (``scancel``, the end of the job)
it stops them all. Its temporary directory goes with it.

``sidecar slurm _trainer --step R -- CMD`` (one task per trainer process) reads the step's
plan, sets the environment ``sidecar launch --torch`` sets (env.py lists it, and torchrun's
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) from the entry of its sidecar, and runs CMD
while its sidecar's step signal says it is not stalled (``tools/watchdog.watch_one``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from sidecar._src.core import env as env_lib, errors, platform, rendezvous, stacks
from sidecar._src.tools import watchdog
from sidecar._src.tools.torchrun import torchrun_env
from sidecar._src.wire import ipc

_START_TIMEOUT_S = 120.0
_GRACE_S = 10.0


def paths(directory: str, host_id: int) -> tuple[str, str, str]:
  """The entry, exit marker and log of sidecar ``host_id`` in ``directory``."""
  return (os.path.join(directory, rendezvous.HOSTS_DIR, f"{host_id}.json"),
          os.path.join(directory, rendezvous.HOSTS_DIR, f"{host_id}.exit"),
          os.path.join(directory, rendezvous.LOGS_DIR, f"{host_id}.log"))


def serve_args(host_id: int, slice_id: int, *, sock: str, ready: str, shm_size: str,
               imports: Sequence[str], checkpoint_roots: Sequence[str], token_file: str,
               port: int = 0, health_port: int = 0,
               device_ids: Sequence[int] = (), session_quota: str | None = None,
               pool: str = "", operator_token_file: str = "") -> list[str]:
  """The ``sidecar serve`` command of one host of a Slurm job; with ``pool`` (a pool
  file's absolute path) its tenants' tokens instead of the job's ``token_file``, and
  ``operator_token_file`` the pool's operator token where the pool file names none."""
  args = [sys.executable, "-m", "sidecar", "serve", "--host-id", str(host_id),
          "--slice-id", str(slice_id), "--port", str(port), "--health-port", str(health_port),
          "--socket", sock, "--shm-size", shm_size,
          *(["--pool", pool] if pool else ["--token-file", token_file]),
          *(["--operator-token-file", operator_token_file] if operator_token_file else []),
          # beside the token file, in the job's (or service's) 0700 directory
          "--peer-token-file",
          os.path.join(os.path.dirname(token_file), rendezvous.PEER_TOKEN_FILE),
          # The job's sidecars, the only replica targets: their entries in its directory.
          "--replica-hosts-file", os.path.dirname(token_file),
          "--ready-file", ready, "--exit-with-parent", str(os.getpid())]
  args += [f"--checkpoint-root={r}" for r in checkpoint_roots]
  if device_ids:
    args += ["--device-ids", ",".join(map(str, device_ids))]
  if session_quota:
    args += ["--session-quota", session_quota]
  for module in imports:
    args += ["--import", module]
  return args


class NodeSidecars:
  """This node's sidecars (hosts ``first .. first+count-1``), children of this process."""

  def __init__(self, directory: str, *, first: int, count: int, slice_id: int,
               shm_size: str, imports: Sequence[str], checkpoint_roots: Sequence[str],
               ports: dict[int, tuple[int, int]] | None = None,
               device_ids: dict[int, list[int]] | None = None, session_quota: str | None = None,
               pool: str = "", operator_token_file: str = ""):
    self.directory, self.first, self.count, self.slice_id = directory, first, count, slice_id
    self.pool = pool  # a pool file: its tenants, not the job's token (sidecar serve --pool)
    self.operator_token_file = operator_token_file  # the pool's, where its file names none
    self.session_quota = session_quota  # each session's share of the arena (several ranks)
    self.shm_size, self.imports, self.checkpoint_roots = shm_size, imports, checkpoint_roots
    self.ports = ports or {}
    self.device_ids = device_ids or {}
    self.token_file = os.path.join(directory, rendezvous.TOKEN_FILE)
    self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    self.job = os.environ.get("SLURM_JOB_ID", "")
    self.tmp = ipc.socket_dir(f"sidecar-slurm-{self.job}-")  # the sidecars' sockets
    self.procs: dict[int, subprocess.Popen] = {}
    self.exited: dict[int, int] = {}  # host -> exit code, of those that exited

  @property
  def hosts(self) -> range:
    return range(self.first, self.first + self.count)

  def start(self) -> None:
    """Starts every sidecar, then writes each one's entry once it serves.

    Raises:
      HostLostError: one exited or was not ready in time (its exit marker is written).
    """
    rendezvous.read_token_file(self.token_file)  # refused here, naming it, if not 0600
    for h in self.hosts:
      entry, marker, log = paths(self.directory, h)
      for stale in (entry, marker):
        with contextlib.suppress(FileNotFoundError):
          os.remove(stale)
      port, health = self.ports.get(h, (0, 0))
      args = serve_args(h, self.slice_id, sock=os.path.join(self.tmp, f"{h}.sock"),
                        ready=os.path.join(self.tmp, f"{h}.ready"), shm_size=self.shm_size,
                        imports=self.imports, checkpoint_roots=self.checkpoint_roots,
                        token_file=self.token_file, port=port, health_port=health,
                        device_ids=self.device_ids.get(h, ()), session_quota=self.session_quota,
                        pool=self.pool, operator_token_file=self.operator_token_file)
      env = {**platform.sidecar_env(os.environ), "PYTHONUNBUFFERED": "1"}  # never the chip
      env.pop(env_lib.TOKEN, None)
      env.pop(env_lib.REPLICA_HOSTS, None)  # the job's directory names them
      with open(log, "ab") as out:
        self.procs[h] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + _START_TIMEOUT_S
    for h in self.hosts:
      self._publish(h, deadline)

  def _publish(self, h: int, deadline: float) -> None:
    ready = os.path.join(self.tmp, f"{h}.ready")
    while not os.path.exists(ready):
      code = self.procs[h].poll()
      if code is not None or time.monotonic() > deadline:
        self.mark_exit(h, code if code is not None else -1)
        raise errors.HostLostError(
            f"sidecar host {h} on node {self.node} " + (
                f"exited with code {code} at start" if code is not None
                else f"was not ready after {_START_TIMEOUT_S:g} s"), host_id=h)
      time.sleep(0.05)
    with open(ready) as f:
      got = json.load(f)
    entry = rendezvous.HostEntry(
        host_id=h, slice_id=self.slice_id, node=self.node, address=socket.gethostname(),
        port=int(got["port"]), health_port=int(got["health_port"]), socket=got["socket"],
        pid=int(got["pid"]), job_id=self.job)
    rendezvous.write_json(paths(self.directory, h)[0], entry.to_dict())

  def mark_exit(self, h: int, code: int) -> None:
    """Says in the rendezvous directory that sidecar ``h`` is gone, and why."""
    with contextlib.suppress(FileNotFoundError):
      os.remove(paths(self.directory, h)[0])
    rendezvous.write_json(paths(self.directory, h)[1], {
        "host_id": h, "code": code, "node": self.node, "job_id": self.job,
        "task": os.environ.get("SLURM_PROCID", os.environ.get("SLURM_ARRAY_TASK_ID", ""))})

  def wait_any(self, stop: list[bool]) -> tuple[int, int] | None:
    """Waits until a sidecar exits (``(host, code)``) or ``stop[0]`` is set (None)."""
    while not stop[0]:
      for h, p in self.procs.items():
        code = p.poll()
        if code is not None and h not in self.exited:
          self.exited[h] = code
          self.mark_exit(h, code)
          return h, code
      time.sleep(0.1)
    return None

  def wait_all(self, stop: list[bool]) -> tuple[int, int] | None:
    """Waits until every sidecar exited or ``stop[0]`` is set; returns the first exit.

    A batch job's other sidecars on the node serve on when one exits: with
    ``--elastic`` the trainers start again beside them.
    """
    first = None
    while len(self.exited) < len(self.procs):
      lost = self.wait_any(stop)
      if lost is None:
        break
      first = first or lost
    return first

  def close(self) -> None:
    """Stops every sidecar (SIGTERM, SIGKILL after the grace), removes its entries and
    the temporary directory; idempotent."""
    for p in self.procs.values():
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for h, p in self.procs.items():
      try:
        p.wait(max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
      with contextlib.suppress(FileNotFoundError):
        os.remove(paths(self.directory, h)[0])
    self.procs = {}
    shutil.rmtree(self.tmp, ignore_errors=True)


def _stop_on_signals(stop: list[bool]) -> None:
  def handler(signum, frame):
    del signum, frame
    stop[0] = True
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, handler)


def run_sidecars(directory: str, *, hosts_per_node: int, shm_size: str,
                 imports: Sequence[str], checkpoint_roots: Sequence[str],
                 session_quota: str | None = None) -> int:
  """``sidecar slurm _sidecars``: this task's sidecars until all exit or a signal comes.

  Host ids are ``SLURM_NODEID * hosts_per_node + i``; the node's index is their slice.
  """
  node_index = int(os.environ.get("SLURM_NODEID", "0"))
  stop = [False]
  _stop_on_signals(stop)
  sidecars = NodeSidecars(directory, first=node_index * hosts_per_node, count=hosts_per_node,
                          slice_id=node_index, shm_size=shm_size, imports=imports,
                          checkpoint_roots=checkpoint_roots, session_quota=session_quota)
  try:
    sidecars.start()
    lost = sidecars.wait_all(stop)
  except errors.SidecarError as e:
    print(f"sidecar slurm: {e}", file=sys.stderr, flush=True)
    return 1
  finally:
    sidecars.close()
  if lost is None:
    return 0
  return 128 - lost[1] if lost[1] < 0 else (lost[1] or 1)


def trainer_env(directory: str, step: int, process: int) -> dict[str, str]:
  """The environment of trainer ``process`` of start ``step``: what ``sidecar launch
  --torch`` gives its trainers, from the step's plan and the sidecars' entries.

  Raises:
    InvalidArgumentError: the plan or an entry is missing, or the token file is not 0600.
  """
  plan = rendezvous.read_json(os.path.join(directory, rendezvous.STEPS_DIR, f"{step}.json"))
  hosts = [int(h) for h in plan["processes"]]
  if not 0 <= process < len(hosts):
    raise errors.InvalidArgumentError(
        f"SLURM_PROCID {process} is not a process of start {step} ({len(hosts)} processes)")
  entries = {e.host_id: e for e in rendezvous.read_hosts(directory)}
  order = list(dict.fromkeys(hosts))
  missing = [h for h in order if h not in entries]
  if missing:
    raise errors.InvalidArgumentError(
        f"the sidecars of hosts {missing} have no entry in {directory} (they are gone)")
  token_file = os.path.join(directory, rendezvous.TOKEN_FILE)
  rendezvous.read_token_file(token_file)
  mine = entries[hosts[process]]
  out = {
      env_lib.COORDINATOR_ADDRESS: plan["coordinator"],
      env_lib.NUM_PROCESSES: str(len(hosts)),
      env_lib.PROCESS_ID: str(process),
      env_lib.HOST_ID: str(mine.host_id),
      env_lib.SLICE_ID: str(mine.slice_id),
      env_lib.ADDRESS: f"unix://{mine.socket}",
      env_lib.HOSTS: ",".join(entries[h].hosts_entry for h in order),
      env_lib.RESTART: str(step),
      env_lib.TOKEN_FILE: token_file,
      env_lib.SLURM_DIR: directory,
      "PYTHONUNBUFFERED": "1",
  }
  if plan.get("local_devices"):
    out[env_lib.LOCAL_DEVICES] = str(plan["local_devices"])
  # The platform JAX would pick on this node: CPU devices only where no accelerator is.
  out.update(platform.for_trainers(os.environ, devices=plan.get("local_devices")).env)
  # torchrun's variables too: ranks by the plan's order, a node's ranks in a row.
  nodes = list(dict.fromkeys(entries[h].node for h in hosts))
  node = entries[hosts[process]].node
  on_node = [p for p, h in enumerate(hosts) if entries[h].node == node]
  out.update(torchrun_env(
      rank=process, local_rank=on_node.index(process), world_size=len(hosts),
      local_world_size=len(on_node), group_rank=nodes.index(node),
      group_world_size=len(nodes), master_addr=entries[hosts[0]].address,
      master_port=int(plan["torch_master_port"]), restart=step))
  return out


def run_trainer(directory: str, step: int, command: Sequence[str]) -> int:
  """``sidecar slurm _trainer``: sets this task's environment and runs ``command``, its
  node's sidecar watching it for a stall (``tools/watchdog.py``, as ``sidecar launch``):
  a stalled trainer's stacks are printed, it is killed, and the task fails with
  ``core/stall.EXIT_CODE``. Returns the trainer's exit code."""
  process = int(os.environ.get("SLURM_PROCID", "0"))
  try:
    extra = trainer_env(directory, step, process)
  except errors.SidecarError as e:
    print(f"sidecar slurm: trainer process {process}: {e}", file=sys.stderr, flush=True)
    return 2
  env = {**os.environ, **extra}
  env.pop(env_lib.TOKEN, None)
  env.setdefault(env_lib.STACKS_SIGNAL, stacks.DEFAULT)  # a stall's stacks
  try:
    # Its own process group: a stall kills the trainer and what it started, not this.
    proc = subprocess.Popen(list(command), env=env, start_new_session=True)
  except OSError as e:
    print(f"sidecar slurm: cannot run {command[0]!r}: {e}", file=sys.stderr, flush=True)
    return 127 if isinstance(e, FileNotFoundError) else 126
  with _forward_signals(proc):
    host = int(extra[env_lib.HOST_ID])
    if host not in _addresses(directory):  # gone meanwhile: nothing to watch with
      code = proc.wait()
    else:
      say = lambda text: print(f"sidecar slurm: {text}", file=sys.stderr, flush=True)
      # Its own sidecar watches it; every sidecar of the job hears of its stall (process
      # 0's keeps the goodput ledger, on this node or another).
      code = watchdog.watch_one(proc, host, lambda: _addresses(directory),
                                token=rendezvous.read_token_file(extra[env_lib.TOKEN_FILE]),
                                rank=process, restart=step, say=say)
  if code < 0:  # as it died: the job's driver tells a signal from an exit code
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  return 128 - code if code < 0 else code


def _addresses(directory: str) -> dict[int, str]:
  """Each sidecar of the job with an entry in ``directory`` now: host -> its gRPC address
  (``HOST:PORT`` of its ``SIDECAR_HOSTS`` entry)."""
  return {e.host_id: e.hosts_entry.rsplit(":", 1)[0] for e in rendezvous.read_hosts(directory)}


@contextlib.contextmanager
def _forward_signals(proc: subprocess.Popen):
  """While the block runs, SIGTERM, SIGINT and SIGHUP to this task go on to ``proc``'s
  process group (its own session), as they would have reached it before it had one."""
  def forward(signum, frame):
    del frame
    with contextlib.suppress(OSError):
      os.killpg(proc.pid, signum)
  sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
  previous = {sig: signal.signal(sig, forward) for sig in sigs}
  try:
    yield
  finally:
    for sig, old in previous.items():
      signal.signal(sig, old)
