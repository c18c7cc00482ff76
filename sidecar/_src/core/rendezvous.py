"""Where the sidecars of a Slurm job say where they are: the rendezvous directory and the
cluster file. Standard library only: ``sidecar slurm`` (tools/slurm/) writes them, the
controller's discovery (controller/discovery.py) reads them.

The **rendezvous directory** of a job (``$SIDECAR_SLURM_DIR``, by default
``$SIDECAR_HOME/slurm/JOB_ID``, ``SIDECAR_HOME`` by default ``~/.sidecar``: a home directory
is shared by the nodes of most clusters) holds, all written atomically::

  job.json        the job: id, nodes, hosts per node, trainer tasks per node, token file
  token           the sidecars' bearer token, mode 0600
  hosts/H.json    sidecar host H, once it serves: node, address, ports, worker socket, pid
  hosts/H.exit    sidecar host H has exited: its exit code
  logs/H.log      what sidecar host H printed
  steps/R.json    trainer start R (0, then 1 after an --elastic restart, ...): the
                  coordinator and the host each process drives, by process id

The **cluster file** of a service (``$SIDECAR_HOME/NAME/cluster.env``) is ``KEY=VALUE``
lines a shell can source, and ``Controller.from_cluster_file`` reads::

  SIDECAR_SERVICE=NAME
  SIDECAR_SLURM_JOB=1234            the service's job; its array job of sidecars is 1235
  SIDECAR_HOSTS=node1:40001:40002,node2:40001:40002
  SIDECAR_TOKEN_FILE=/home/me/.sidecar/NAME/token
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Any

from sidecar._src.core import env as env_lib, errors

JOB_FILE = "job.json"
TOKEN_FILE = "token"
# The sidecars' own: the token they present to each other, so that only peers send replicas.
PEER_TOKEN_FILE = "peer-token"
# A pool's operator token (a service with --pool whose pool file names none): it reads every
# tenant's Status row and drops RAM-tier copies, nothing else (docs/pool.md).
OPERATOR_TOKEN_FILE = "operator-token"
HOSTS_DIR = "hosts"
LOGS_DIR = "logs"
STEPS_DIR = "steps"
CLUSTER_FILE = "cluster.env"
SERVICE_KEY = env_lib.SERVICE
JOB_KEY = env_lib.SLURM_JOB


def home(environ: Mapping[str, str] | None = None) -> str:
  """``$SIDECAR_HOME``, else ``~/.sidecar``."""
  return os.path.abspath(os.path.expanduser(
      env_lib.get(env_lib.HOME, "~/.sidecar", environ=environ) or "~/.sidecar"))


def job_dir(environ: Mapping[str, str] | None = None) -> str | None:
  """This Slurm job's rendezvous directory, or None outside a Slurm job."""
  environ = os.environ if environ is None else environ
  given = env_lib.get(env_lib.SLURM_DIR, environ=environ)
  if given:
    return os.path.abspath(given)
  job = environ.get("SLURM_JOB_ID", "").strip()
  return os.path.join(home(environ), "slurm", job) if job else None


@dataclasses.dataclass(frozen=True, slots=True)
class HostEntry:
  """One sidecar of a Slurm job, as its task wrote it once the sidecar served."""
  host_id: int
  slice_id: int  # the node's index in the job: replicas go to another node first
  node: str  # the Slurm node name
  address: str  # the host name or address other nodes reach it at
  port: int
  health_port: int
  socket: str  # the worker Unix socket, on the node's local disk
  pid: int
  job_id: str = ""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> HostEntry:
    try:
      return cls(int(d["host_id"]), int(d["slice_id"]), str(d["node"]), str(d["address"]),
                 int(d["port"]), int(d["health_port"]), str(d["socket"]), int(d["pid"]),
                 str(d.get("job_id", "")))
    except (KeyError, TypeError, ValueError) as e:
      raise errors.InvalidArgumentError(f"a sidecar's rendezvous entry is malformed ({e!r}): "
                                        f"{dict(d)!r:.300}") from None

  @property
  def hosts_entry(self) -> str:
    """``ADDRESS:PORT:HEALTH_PORT``, as ``SIDECAR_HOSTS`` lists it."""
    host = f"[{self.address}]" if ":" in self.address else self.address
    return f"{host}:{self.port}:{self.health_port}"


def write_json(path: str, data: Any, *, mode: int = 0o644) -> None:
  """Writes ``data`` to ``path`` atomically (a reader sees all of it or nothing)."""
  tmp = f"{path}.{os.getpid()}.tmp"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
  with os.fdopen(fd, "w") as f:
    json.dump(data, f)
  os.replace(tmp, path)


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def read_hosts(directory: str) -> list[HostEntry]:
  """The sidecars that wrote their entry in ``directory``, by host id."""
  d = os.path.join(directory, HOSTS_DIR)
  try:
    names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
  except FileNotFoundError:
    return []
  out = []
  for name in names:
    try:
      out.append(HostEntry.from_dict(read_json(os.path.join(d, name))))
    except (OSError, ValueError):
      continue  # removed meanwhile (a requeued task's), or another writer's temp file
  return sorted(out, key=lambda e: e.host_id)


def make_token_file(path: str) -> str:
  """Creates ``path`` (mode 0600, new) holding a fresh random token; returns the token."""
  token = secrets.token_urlsafe(32)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(token + "\n")
  return token


def read_token_file(path: str) -> str:
  """The token in ``path``, which only its owner may read.

  Raises:
    InvalidArgumentError: it is missing, unreadable, empty, or readable or writable by
      others than its owner (its group or everyone); the message names the file and the fix.
  """
  try:
    st = os.stat(path)
    with open(path) as f:
      token = f.read().strip()
  except OSError as e:
    raise errors.InvalidArgumentError(
        f"token file {path!r} cannot be read: {e.strerror or e}; it must be a file of yours "
        "that only you can read (chmod 600)") from None
  if stat.S_IMODE(st.st_mode) & 0o077:
    raise errors.InvalidArgumentError(
        f"token file {path!r} is readable or writable by others (mode "
        f"{stat.S_IMODE(st.st_mode):04o}): anyone who reads it can call the sidecars; "
        f"refusing it. Run: chmod 600 {path}")
  if not token:
    raise errors.InvalidArgumentError(f"token file {path!r} is empty; put the token in it")
  return token


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterFile:
  """What a service's ``cluster.env`` says: whose sidecars, where, with which token."""
  name: str
  job_id: str
  hosts: tuple[str, ...]  # HOST:PORT:HEALTH_PORT, by host id
  token_file: str

  def to_text(self) -> str:
    return (f"{SERVICE_KEY}={self.name}\n{JOB_KEY}={self.job_id}\n"
            f"{env_lib.HOSTS}={','.join(self.hosts)}\n{env_lib.TOKEN_FILE}={self.token_file}\n")

  def write(self, path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(self.to_text())
    os.replace(tmp, path)

  @classmethod
  def read(cls, path: str) -> ClusterFile:
    """Parses ``path``.

    Raises:
      InvalidArgumentError: it is missing or lacks a key; the message names the file.
    """
    try:
      with open(path) as f:
        text = f.read()
    except OSError as e:
      raise errors.InvalidArgumentError(
          f"cluster file {path!r} cannot be read: {e.strerror or e}; `sidecar slurm service "
          "--name NAME` writes it once its sidecars serve ($SIDECAR_HOME/NAME/cluster.env)"
      ) from None
    values = {}
    for line in text.splitlines():
      key, sep, value = line.strip().partition("=")
      if sep and not key.startswith("#"):
        values[key.strip()] = value.strip()
    missing = [k for k in (SERVICE_KEY, JOB_KEY, env_lib.HOSTS, env_lib.TOKEN_FILE)
               if not values.get(k)]
    if missing:
      raise errors.InvalidArgumentError(
          f"cluster file {path!r} lacks {', '.join(missing)}; it is not one `sidecar slurm "
          "service` wrote")
    return cls(values[SERVICE_KEY], values[JOB_KEY],
               tuple(h.strip() for h in values[env_lib.HOSTS].split(",")),
               values[env_lib.TOKEN_FILE])
