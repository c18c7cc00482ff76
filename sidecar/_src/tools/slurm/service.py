"""``sidecar slurm service|status|stop`` and the service's two drivers.

A service ``NAME`` lives in ``$SIDECAR_HOME/NAME`` (mode 0700): its token file (0600),
``service.json`` (what it was started with), ``state.json`` (its job ids), the
rendezvous entries of its sidecars (``hosts/``, as a batch job's), their logs, and, once
``--min-nodes`` array tasks serve, ``cluster.env`` (core/rendezvous.py). Its marker file
(owned.py) says the directory is the service's: the tool takes only a new or empty
directory, and ``stop`` removes only what the service wrote there. ``slurm`` is no name
for a service: ``$SIDECAR_HOME/slurm`` holds the batch jobs' rendezvous directories.

- The **service job** (one task, ``_service``) submits the **array job** (``_array``: task i
  runs the sidecars of hosts ``i*H .. i*H+H-1`` on its node), then watches it: a task
  whose sidecar exits is requeued (``scontrol requeue``, started again a second later
  rather than after Slurm's requeue delay), and ``cluster.env`` is rewritten whenever a
  sidecar's address changes. A requeued task on the node it ran on reuses its sidecars'
  ports, so clients reconnect to the same addresses; a port someone else took meanwhile is
  not reused (a fresh one, which ``cluster.env`` then names). On ``scancel`` (``sidecar slurm
  stop``) it cancels the array job and removes ``cluster.env``.
- Clients read ``cluster.env``: ``Controller.from_cluster_file(PATH)``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

from sidecar._src.core import errors, rendezvous
from sidecar._src.server.pool import pool_file
from sidecar._src.tools.slurm import owned, script, tasks

_POLL_S = 0.5
# What a service writes in its directory, all that ``stop`` removes there (owned.py).
ENTRIES = (rendezvous.TOKEN_FILE, rendezvous.PEER_TOKEN_FILE, rendezvous.OPERATOR_TOKEN_FILE,
           rendezvous.HOSTS_DIR,
           rendezvous.LOGS_DIR, "ports", "service.json", "state.json", "service.log",
           rendezvous.CLUSTER_FILE)
# $SIDECAR_HOME's own entries, which no service may be named after.
RESERVED = ("slurm",)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSpec:
  """What ``sidecar slurm service`` was given; checked when made."""
  name: str
  nodes: int = 1
  min_nodes: int = 1
  hosts_per_node: int = 1
  devices_per_host: int = 1
  shm_size: str = "1GiB"
  imports: tuple[str, ...] = ()
  checkpoint_root: str = ""
  sbatch_args: tuple[str, ...] = ()
  # A pool file (--pool): every sidecar of the service serves its tenants (docs/pool.md);
  # "": the service's own token, one tenant.
  pool: str = ""

  def __post_init__(self):
    if not self.name or not all(c.isalnum() or c in "-_." for c in self.name) \
        or self.name.startswith("."):
      raise errors.InvalidArgumentError(
          f"--name must be letters, digits, '-', '_' or '.', got {self.name!r}")
    if self.name in RESERVED:
      raise errors.InvalidArgumentError(
          f"--name {self.name!r} is taken: $SIDECAR_HOME/{self.name} holds the batch jobs' "
          "rendezvous directories; pick another name")
    for field in ("nodes", "min_nodes", "hosts_per_node", "devices_per_host"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(
            f"--{field.replace('_', '-')} must be an int >= 1, got {value!r}")
    if self.min_nodes > self.nodes:
      raise errors.InvalidArgumentError(
          f"--min-nodes {self.min_nodes} is more than --nodes {self.nodes}")
    if self.pool:
      if not os.path.isabs(self.pool):
        raise errors.InvalidArgumentError(
            f"--pool must be an absolute path (the tasks run elsewhere), got {self.pool!r}")
      try:  # a bad pool file is said now, not by every task's sidecar on its node
        pool_file.load(self.pool)
      except OSError as e:
        raise errors.InvalidArgumentError(f"--pool {self.pool}: {e}") from None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def service_dir(name: str) -> str:
  return os.path.join(rendezvous.home(), name)


def _state(directory: str) -> dict:
  try:
    return rendezvous.read_json(os.path.join(directory, "state.json"))
  except (OSError, ValueError):
    return {}


def _alive(job: str) -> bool:
  done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                        text=True, timeout=30)
  return done.returncode == 0 and bool(done.stdout.split())


def _holder(name: str) -> str:
  return f"service {name}"


def submit(spec: ServiceSpec) -> int:
  """Submits the service job; prints its id and where the cluster file will be."""
  directory = service_dir(spec.name)
  mark = owned.holder(directory)
  job = _state(directory).get("service_job") if mark else None
  if mark and mark["holder"] == _holder(spec.name) and job and _alive(str(job)):
    print(f"sidecar slurm service: service {spec.name!r} runs already (job {job}); stop it "
          f"first: sidecar slurm stop {spec.name}", file=sys.stderr)
    return 1
  try:
    owned.claim(directory, _holder(spec.name), ENTRIES, what=f"--name {spec.name}")
  except errors.InvalidArgumentError as e:
    print(f"sidecar slurm service: {e}", file=sys.stderr)
    return 2
  for sub in (rendezvous.HOSTS_DIR, rendezvous.LOGS_DIR, "ports"):
    os.mkdir(os.path.join(directory, sub), 0o700)
  rendezvous.make_token_file(os.path.join(directory, rendezvous.TOKEN_FILE))
  rendezvous.make_token_file(os.path.join(directory, rendezvous.PEER_TOKEN_FILE))
  operator = operator_token_file(spec, directory)
  if _own_operator_token(spec, directory):  # the pool file names none: the service's own
    rendezvous.make_token_file(operator)
  rendezvous.write_json(os.path.join(directory, "service.json"), spec.to_dict())
  text = script.service_script(spec.name, spec.sbatch_args,
                               os.path.join(directory, "service.log"))
  done = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True,
                        timeout=120)
  if done.returncode:
    print(f"sidecar slurm service: sbatch refused the service job: {done.stderr.strip()}",
          file=sys.stderr)
    return done.returncode
  job = done.stdout.strip().split(";")[0]
  rendezvous.write_json(os.path.join(directory, "state.json"), {"service_job": job})
  print(f"service {spec.name!r}: job {job}; once {spec.min_nodes} of {spec.nodes} nodes "
        f"serve, connect with SIDECAR_CLUSTER_FILE="
        f"{os.path.join(directory, rendezvous.CLUSTER_FILE)}", flush=True)
  if spec.pool:
    print(f"the pool's operator token (every tenant's Status row; sidecar slurm status "
          f"{spec.name} uses it): {operator}", flush=True)
  return 0


def _own_operator_token(spec: ServiceSpec, directory: str) -> str:
  """The operator token file the service made, for --operator-token-file ("" where the
  pool file names its own: a sidecar takes one or the other, not both)."""
  own = os.path.join(directory, rendezvous.OPERATOR_TOKEN_FILE)
  return own if operator_token_file(spec, directory) == own else ""


def operator_token_file(spec: ServiceSpec, directory: str) -> str:
  """The pool's operator token file: the one its pool file names, else the service's own
  (0600 in its directory, beside its token and peer token); "" without a pool."""
  if not spec.pool:
    return ""
  return (pool_file.operator_token_file(spec.pool)
          or os.path.join(directory, rendezvous.OPERATOR_TOKEN_FILE))


class _Service:
  """The service job's watch over its array job."""

  def __init__(self, name: str):
    self.name, self.directory = name, service_dir(name)
    self.spec = ServiceSpec(**rendezvous.read_json(os.path.join(self.directory,
                                                                "service.json")))
    self.array = ""
    self.written: tuple[str, ...] = ()
    self.stop = False

  def say(self, text: str) -> None:
    print(f"sidecar slurm service {self.name}: {text}", flush=True)

  def submit_array(self) -> None:
    text = script.array_script(self.name, nodes=self.spec.nodes,
                               sbatch_args=self.spec.sbatch_args,
                               log=os.path.join(self.directory, rendezvous.LOGS_DIR,
                                                "task-%a.log"))
    done = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True,
                          text=True, timeout=120)
    if done.returncode:
      raise errors.InvalidArgumentError(f"sbatch refused the array job: {done.stderr.strip()}")
    self.array = done.stdout.strip().split(";")[0]
    state = _state(self.directory)
    rendezvous.write_json(os.path.join(self.directory, "state.json"),
                          {**state, "array_job": self.array})
    self.say(f"array job {self.array}: {self.spec.nodes} tasks of "
             f"{self.spec.hosts_per_node} sidecars")

  def requeue_failed(self) -> None:
    """Requeues the array task of every sidecar that exited, and starts it again now."""
    h = self.spec.hosts_per_node
    failed = set()
    for name in os.listdir(os.path.join(self.directory, rendezvous.HOSTS_DIR)):
      if name.endswith(".exit"):
        host = int(name.split(".")[0])
        info = rendezvous.read_json(os.path.join(self.directory, rendezvous.HOSTS_DIR, name))
        failed.add(host // h)
        os.remove(os.path.join(self.directory, rendezvous.HOSTS_DIR, name))
        self.say(f"sidecar host {host} (node {info.get('node')}) exited with code "
                 f"{info.get('code')}; requeueing array task {host // h}")
    for task in sorted(failed):
      self._requeue(f"{self.array}_{task}")
    # Tasks Slurm requeued itself (preempted, node lost) wait for its requeue delay.
    listed = subprocess.run(["squeue", "-h", "-j", self.array, "-t", "PD", "-o", "%i %r"],
                            capture_output=True, text=True, timeout=30)
    for line in listed.stdout.splitlines():
      pending, _, reason = line.partition(" ")
      if reason.strip() == "BeginTime":
        subprocess.run(["scontrol", "update", f"JobId={pending}", "StartTime=now"],
                       capture_output=True, timeout=30)

  def _requeue(self, task: str) -> None:
    for _ in range(20):  # a task still ending (COMPLETING) cannot be requeued yet
      done = subprocess.run(["scontrol", "requeue", task], capture_output=True, text=True,
                            timeout=30)
      if done.returncode == 0:
        break
      time.sleep(0.5)
    else:
      self.say(f"could not requeue {task}: {done.stderr.strip()}")
      return
    # A second from now, not now: slurmd refuses to launch a job again within the second its
    # last run was killed in ("Job N already killed, do not launch batch job": it compares
    # the new credential's time, in whole seconds, with the revocation's), and the task
    # would then end without a sidecar, never requeued again.
    subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now+1"],
                   capture_output=True, timeout=30)

  def write_cluster_file(self) -> None:
    """Writes ``cluster.env`` once enough tasks serve, and again when an address moves."""
    entries = {e.host_id: e for e in rendezvous.read_hosts(self.directory)}
    if not self.written:
      per = self.spec.hosts_per_node
      serving = {t for t in range(self.spec.nodes)
                 if all(t * per + i in entries for i in range(per))}
      if len(serving) < self.spec.min_nodes:
        return
    known = dict(zip(range(len(self.written)), self.written))
    known.update({h: e.hosts_entry for h, e in entries.items()})
    hosts = tuple(known[h] for h in sorted(known))
    if hosts == self.written:
      return
    cluster = rendezvous.ClusterFile(self.name, os.environ.get("SLURM_JOB_ID", ""), hosts,
                                     os.path.join(self.directory, rendezvous.TOKEN_FILE))
    cluster.write(os.path.join(self.directory, rendezvous.CLUSTER_FILE))
    self.say(f"{'wrote' if not self.written else 'rewrote'} "
             f"{os.path.join(self.directory, rendezvous.CLUSTER_FILE)}: {', '.join(hosts)}")
    self.written = hosts

  def run(self) -> int:
    def handler(signum, frame):
      del signum, frame
      self.stop = True
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, handler)
    try:
      self.submit_array()
      while not self.stop:
        self.requeue_failed()
        self.write_cluster_file()
        if not _alive(self.array):
          self.say(f"array job {self.array} is gone; ending")
          return 1
        time.sleep(_POLL_S)
      return 0
    finally:
      if self.array:
        subprocess.run(["scancel", self.array], capture_output=True, timeout=30)
      for name in (rendezvous.CLUSTER_FILE,):
        try:
          os.remove(os.path.join(self.directory, name))
        except FileNotFoundError:
          pass


def run_service(name: str) -> int:
  """``sidecar slurm _service``: the service job's body."""
  return _Service(name).run()


def run_array(name: str) -> int:
  """``sidecar slurm _array``: one array task's sidecars, until one exits or a signal."""
  directory = service_dir(name)
  spec = ServiceSpec(**rendezvous.read_json(os.path.join(directory, "service.json")))
  task = int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
  per, node = spec.hosts_per_node, os.environ.get("SLURMD_NODENAME") or socket.gethostname()
  first = task * per
  ports: dict[int, tuple[int, int]] = {}
  for h in range(first, first + per):  # a requeued task on its old node: the same ports
    try:
      old = rendezvous.read_json(os.path.join(directory, "ports", f"{h}.json"))
    except (OSError, ValueError):
      continue
    if old.get("node") == node:
      ports[h] = (_if_free(int(old["port"]), h, node), _if_free(int(old["health_port"]), h,
                                                                 node))
  stop = [False]
  tasks._stop_on_signals(stop)
  d = spec.devices_per_host
  sidecars = tasks.NodeSidecars(
      directory, first=first, count=per, slice_id=task, shm_size=spec.shm_size,
      imports=spec.imports, checkpoint_roots=(spec.checkpoint_root,), ports=ports,
      device_ids={h: list(range(h * d, (h + 1) * d)) for h in range(first, first + per)},
      pool=spec.pool, operator_token_file=_own_operator_token(spec, directory))
  try:
    sidecars.start()
    for e in rendezvous.read_hosts(directory):
      if first <= e.host_id < first + per:
        rendezvous.write_json(os.path.join(directory, "ports", f"{e.host_id}.json"),
                              {"node": e.node, "port": e.port, "health_port": e.health_port})
    lost = sidecars.wait_any(stop)
  except errors.SidecarError as e:
    print(f"sidecar slurm: {e}", file=sys.stderr, flush=True)
    return 1
  finally:
    sidecars.close()
  return 0 if lost is None else 1


def _if_free(port: int, host: int, node: str) -> int:
  """``port`` if no one holds it on this node now, else 0 (a fresh one): a port someone
  took while the task was away would fail its sidecar at every requeue."""
  try:
    s, where = socket.socket(socket.AF_INET6), "::"  # as the sidecar binds: [::], IPv4 too
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
  except OSError:
    s, where = socket.socket(socket.AF_INET), "0.0.0.0"  # no IPv6 here
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT holds none
    try:
      s.bind((where, port))
      return port
    except OSError:
      pass
  print(f"sidecar slurm: host {host}'s port {port} on node {node} is taken; the sidecar "
        "takes a fresh one (the service rewrites cluster.env)", file=sys.stderr, flush=True)
  return 0


def _jobs(directory: str) -> tuple[str, str]:
  state = _state(directory)
  return str(state.get("service_job", "")), str(state.get("array_job", ""))


def status(name: str, *, timeout: float = 5.0) -> int:
  """``sidecar slurm status NAME``: its jobs and tasks, then each sidecar's status."""
  directory = service_dir(name)
  service_job, array = _jobs(directory)
  if not service_job:
    raise errors.InvalidArgumentError(
        f"no service {name!r} in {rendezvous.home()} (start it with sidecar slurm service "
        f"--name {name})")
  print(f"service {name!r} ({directory})")
  for what, job in (("service job", service_job), ("array job", array)):
    if not job:
      continue
    listed = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%i %T %N %R"],
                            capture_output=True, text=True, timeout=30)
    lines = listed.stdout.strip().splitlines() or ["(gone)"]
    print(f"  {what} {job}:")
    for line in lines:
      print(f"    {line}")
  path = os.path.join(directory, rendezvous.CLUSTER_FILE)
  if not os.path.exists(path):
    print("  cluster file: not written yet (fewer than --min-nodes tasks serve)")
    return 1
  cluster = rendezvous.ClusterFile.read(path)
  print(f"  cluster file: {path}\n  hosts: {', '.join(cluster.hosts)}", flush=True)
  from sidecar._src.controller import status as status_lib
  spec = ServiceSpec(**rendezvous.read_json(os.path.join(directory, "service.json")))
  # A pool's sidecars take their tenants' tokens and the pool's operator token (every
  # tenant's row), not the service's.
  token = rendezvous.read_token_file(operator_token_file(spec, directory) if spec.pool
                                     else cluster.token_file)
  addresses = [h.rsplit(":", 1)[0] for h in cluster.hosts]
  return status_lib.print_status(addresses, timeout=timeout, token=token, as_json_=False)


def stop(name: str, *, timeout: float = 60.0) -> int:
  """``sidecar slurm stop NAME``: cancels its jobs, waits for them, removes its directory."""
  directory = service_dir(name)
  mark = owned.holder(directory)
  if mark is None or mark["holder"] != _holder(name):
    raise errors.InvalidArgumentError(
        f"no service {name!r} in {rendezvous.home()}" + (
            f" ({directory} was not made by sidecar slurm service: left as it is)"
            if os.path.exists(directory) else ""))
  service_job, array = _jobs(directory)
  if not service_job:
    raise errors.InvalidArgumentError(f"no service {name!r} in {rendezvous.home()}")
  for job in (service_job, array):
    if job:
      subprocess.run(["scancel", job], capture_output=True, timeout=30)
  deadline = time.monotonic() + timeout
  while any(j and _alive(j) for j in (service_job, array)):
    if time.monotonic() > deadline:
      raise errors.DeadlineExceededError(
          f"the jobs of service {name!r} ({service_job}, {array}) still run after "
          f"{timeout:g} s")
    time.sleep(0.5)
  gone = owned.release(directory, _holder(name), ENTRIES)
  print(f"service {name!r} stopped (jobs {service_job} and {array} ended); removed "
        + (directory if gone else f"its files from {directory} (left: not made by it, or "
           "holding files of someone else's)"))
  return 0
