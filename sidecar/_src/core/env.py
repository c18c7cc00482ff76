"""Every ``SIDECAR_*`` environment variable, in one table: name, meaning, default, reader.

A leaf module: the standard library and ``errors`` only. Modules name a variable by its
constant here (``env.TOKEN``) and read it with :func:`get` (or :func:`int_var`,
:func:`float_var`, :func:`token`), which refuse a name missing from the table, so the
table stays the whole list. ``tests/unit/core/test_env.py`` checks that every ``SIDECAR_`` name in
``sidecar/`` is in it. ``sidecar launch --help`` prints the rows it sets for each trainer
(``launcher=True``).

The table, by who reads it (``python -c "from sidecar._src import env; print(env.table())"``):

- ``sidecar serve`` (cli.py): the default of each flag (a flag given wins).
- ``Worker``, ``Controller``, ``sidecar.jax.initialize``: the trainer's view of
  its job, which ``sidecar launch`` or the k8s manifests set.
- ``Controller.from_env`` (controller/discovery.py): where the sidecars are.
- The checkpoint host (server/checkpoint*.py, server/replicas.py): tuning and fault injection.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pwd
import stat
from collections.abc import Mapping

from sidecar._src.core import errors


@dataclasses.dataclass(frozen=True, slots=True)
class Var:
  """One environment variable: what it means, what holds when it is unset, who reads it."""
  name: str
  meaning: str
  default: str
  readers: str
  launcher: bool = False  # set by ``sidecar launch`` in every trainer's environment


VARS: dict[str, Var] = {}


def _var(name: str, meaning: str, *, default: str, readers: str, launcher: bool = False) -> str:
  if name in VARS or not name.startswith("SIDECAR_"):
    raise ValueError(f"{name!r} is listed twice or is not a SIDECAR_ name")
  VARS[name] = Var(name, meaning, default, readers, launcher)
  return name


_SERVE = "sidecar serve (cli.py)"
_TRAINER = "sidecar.jax.initialize (distributed.py)"
_DISCOVERY = "Controller.from_env (controller/discovery.py)"
_CKPT = "the checkpoint host (server/checkpoint.py)"

# ---- set by `sidecar launch` for each trainer (and by the k8s manifests) ----------------
COORDINATOR_ADDRESS = _var(
    "SIDECAR_COORDINATOR_ADDRESS", "the jax.distributed coordinator (process 0 runs it), host:port",
    default="in a JobSet, host 0 of slice 0 at SIDECAR_COORDINATOR_PORT; else no job",
    readers=_TRAINER, launcher=True)
NUM_PROCESSES = _var(
    "SIDECAR_NUM_PROCESSES", "how many trainer processes the job has",
    default="in a JobSet, SIDECAR_NUM_SLICES * SIDECAR_HOSTS_PER_SLICE", readers=_TRAINER,
    launcher=True)
PROCESS_ID = _var(
    "SIDECAR_PROCESS_ID", "this trainer's process index, 0..NUM_PROCESSES-1",
    default="in a JobSet, SIDECAR_SLICE_ID * SIDECAR_HOSTS_PER_SLICE + SIDECAR_HOST_ID",
    readers=_TRAINER, launcher=True)
LOCAL_DEVICES = _var(
    "SIDECAR_LOCAL_DEVICES", "how many CPU devices this process owns",
    default="JAX's own count", readers=_TRAINER + " (CPU runs only)", launcher=True)
HOST_ID = _var(
    "SIDECAR_HOST_ID", "the host id of this process's sidecar",
    default="0", readers=f"{_SERVE} --host-id; {_TRAINER} in a JobSet", launcher=True)
SLICE_ID = _var(
    "SIDECAR_SLICE_ID", "the slice id of this process's sidecar",
    default="0", readers=f"{_SERVE} --slice-id; {_TRAINER} in a JobSet", launcher=True)
ADDRESS = _var(
    "SIDECAR_ADDRESS", "unix://PATH of this host's sidecar worker socket",
    default="none: Worker() needs an address", readers="Worker (worker.py), Controller",
    launcher=True)
HOSTS = _var(
    "SIDECAR_HOSTS", "every sidecar, in host order: HOST:PORT:HEALTH_PORT or unix:PATH,...",
    default="the JobSet's pods, from SIDECAR_JOBSET_NAME and the rest", readers=_DISCOVERY,
    launcher=True)
RESTART = _var(
    "SIDECAR_RESTART", "how often --elastic restarted the job: 0 on the first start",
    default="0", readers="the trainer's own code (sidecar launch sets it)", launcher=True)
STACKS_SIGNAL = _var(
    "SIDECAR_STACKS_SIGNAL", "a signal (e.g. SIGUSR2) on which a trainer writes every "
    "thread's Python stack to its stderr (faulthandler, registered when its Worker "
    "attaches); sidecar launch sends it to a stalled trainer before it kills it",
    default="none: no stacks (sidecar launch sets SIGUSR2)",
    readers="Worker (core/stacks.py), sidecar launch, sidecar stalls", launcher=True)
JOB = _var(
    "SIDECAR_JOB", "the job's name: the same in every process of one job and in its restarts, "
    "another in every other job; a checkpoint directory is held by one job at a time",
    default="a Slurm job's id, a JobSet's name, else process 0's random one (core/job.py)",
    readers="Controller's checkpointers (controller/checkpoint/checkpointer.py)", launcher=True)
STARTED = _var(
    "SIDECAR_STARTED", "when this trainer process was told to run, Unix seconds: set by "
    "sidecar launch --standby's waiting process (tools/standby.py), whose imports came before",
    default="the process's start (/proc)",
    readers="the goodput ledger (controller/goodput.process_start)")
TOKEN = _var(
    "SIDECAR_TOKEN", "the sidecars' bearer token, when they have one",
    default="SIDECAR_TOKEN_FILE's content, else no token",
    readers=f"{_SERVE}, Controller, sidecar status, sidecar launch", launcher=True)
TOKEN_FILE = _var(
    "SIDECAR_TOKEN_FILE", "a file holding the bearer token (read if no TOKEN)",
    default="no token", readers=f"{_SERVE} --token-file, Controller, sidecar launch",
    launcher=True)
CLIENT_TOKENS_FILE = _var(
    "SIDECAR_CLIENT_TOKENS_FILE", "--client-tokens: a file of per-client tokens, one "
    "'NAME TOKEN' a line, instead of the shared SIDECAR_TOKEN", default="none: the shared token",
    readers=_SERVE)
PEER_TOKEN = _var(
    "SIDECAR_PEER_TOKEN", "the token sidecars present to their peers; only a session that "
    "presented it may send replicas", default="SIDECAR_PEER_TOKEN_FILE's content, else none: "
    "no replicas are accepted", readers=f"{_SERVE}, sidecar launch, LocalCluster (which make one)")
REPLICA_HOSTS = _var(
    "SIDECAR_REPLICA_HOSTS", "--replica-hosts: the job's sidecars by host id (HOST:PORT or "
    "unix:PATH, comma-separated), the only places a sidecar sends replicas to",
    default="SIDECAR_REPLICA_HOSTS_FILE's list, else SIDECAR_HOSTS' or the JobSet's sidecars "
    "where the sidecar's environment names them, else none: no replicas are sent",
    readers=f"{_SERVE}, LocalCluster and the launchers (which set it)")
REPLICA_HOSTS_FILE = _var(
    "SIDECAR_REPLICA_HOSTS_FILE", "--replica-hosts-file: a file listing the job's sidecars "
    "as SIDECAR_REPLICA_HOSTS does, read when a replica link is made",
    default="none", readers=_SERVE)
PEER_TOKEN_FILE = _var(
    "SIDECAR_PEER_TOKEN_FILE", "a file holding the peer token (read if no PEER_TOKEN)",
    default="no peer token", readers=f"{_SERVE} --peer-token-file")

# ---- `sidecar serve`: the defaults of its flags (k8s/render.py sets them in the pod) ----
DEVICE_IDS = _var("SIDECAR_DEVICE_IDS", "--device-ids: the devices of this host, 0,1,...",
                  default="none", readers=_SERVE)
LISTEN = _var("SIDECAR_LISTEN", "--listen: unix:PATH (gRPC and health on that Unix socket), "
              "or the TCP address of the control and health ports",
              default="127.0.0.1, or [::] with a token", readers=_SERVE)
SOCKET_GROUP = _var("SIDECAR_SOCKET_GROUP", "--socket-group: the group that may connect to a "
                    "unix: --listen socket too (mode 0660)", default="none: mode 0600",
                    readers=_SERVE)
PORT = _var("SIDECAR_PORT", "--port: the gRPC control port; every sidecar's, to discovery",
            default="8490", readers=f"{_SERVE}, {_DISCOVERY}")
HEALTH_PORT = _var("SIDECAR_HEALTH_PORT", "--health-port: the plaintext grpc.health.v1 port",
                   default="8491", readers=f"{_SERVE}, {_DISCOVERY}")
SOCKET = _var("SIDECAR_SOCKET", "--socket: the worker Unix socket's path",
              default="/run/sidecar/sidecar.sock", readers=_SERVE)
SHARED_SOCKET_DIR = _var(
    "SIDECAR_SHARED_SOCKET_DIR", "a directory others may write that the operator vouches for "
    "(a pod's emptyDir, which only the pod's containers see): sockets may be made there as in "
    "the sticky /tmp, if their name is unclaimed", default="none: a socket directory others "
    "may write is refused at start", readers=f"{_SERVE} (server/preflight.py)")
SHM_SIZE = _var("SIDECAR_SHM_SIZE", "--shm-size: the arena's size, e.g. 4GiB",
                default="1GiB", readers=_SERVE)
IMPORTS = _var("SIDECAR_IMPORTS", "modules to import, comma-separated, after the --import ones",
               default="none", readers=_SERVE)
STALL_TIMEOUT = _var("SIDECAR_STALL_TIMEOUT", "--stall-timeout: seconds without a step "
                     "after which a trainer is stalled (core/stall.py); 0: never",
                     default="120", readers=_SERVE)
SESSION_QUOTA = _var("SIDECAR_SESSION_QUOTA", "--session-quota: one worker session's share of "
                     "the arena, a fraction or a size", default="0.9", readers=_SERVE)
INSECURE = _var("SIDECAR_INSECURE", "1: --insecure, serve a non-loopback --listen without a token",
                default="0", readers=_SERVE)
CHECKPOINT_ROOTS = _var(
    "SIDECAR_CHECKPOINT_ROOTS", "--checkpoint-root: directories checkpoints may use, "
    "os.pathsep-separated", default="none: checkpoint calls are refused",
    readers=f"{_SERVE}; named in {_CKPT}'s messages")
METRICS_PORT = _var("SIDECAR_METRICS_PORT", "--metrics-port: the Prometheus /metrics port",
                    default="no metrics", readers=_SERVE)
LOG_FORMAT = _var("SIDECAR_LOG_FORMAT", "--log-format: text or json", default="text",
                  readers=_SERVE)
LOG_LEVEL = _var("SIDECAR_LOG_LEVEL", "the log level of every sidecar command (DEBUG, INFO, ...)",
                 default="INFO", readers="every sidecar command (cli.py)")
LOG_DIR = _var("SIDECAR_LOG_DIR", "--log-dir of sidecar launch and sidecar local: where they keep "
               "their sidecars' logs, a directory per run in it", default="./sidecar-logs",
               readers="sidecar launch, sidecar local (cli.py)")
TLS_CERT = _var("SIDECAR_TLS_CERT", "--tls-cert: the control port's certificate chain (PEM)",
                default="no TLS", readers=_SERVE)
TLS_KEY = _var("SIDECAR_TLS_KEY", "--tls-key: the control port's private key (PEM)",
               default="no TLS", readers=_SERVE)
TLS_CLIENT_CA = _var("SIDECAR_TLS_CLIENT_CA", "--tls-client-ca: mTLS, the CA of the clients",
                     default="no mTLS", readers=_SERVE)

# ---- the clients of a sidecar: TLS and liveness ------------------------------------------
TLS_CA = _var("SIDECAR_TLS_CA", "the CA (PEM) that verifies the sidecars' certificates",
              default="plaintext unless tls_ca=... is given",
              readers="Controller, sidecar status (protocol.py), server/replicas.py")
TLS_CLIENT_CERT = _var("SIDECAR_TLS_CLIENT_CERT", "this client's certificate (PEM), for mTLS",
                       default="none", readers="Controller (protocol.py), server/replicas.py")
TLS_CLIENT_KEY = _var("SIDECAR_TLS_CLIENT_KEY", "this client's private key (PEM), for mTLS",
                      default="none", readers="Controller (protocol.py), server/replicas.py")
SOCKET_UID = _var(
    "SIDECAR_SOCKET_UID", "users, besides this process's own and root, whose Unix socket a "
    "client trusts with its token: uids or user names, comma-separated (a sidecar run as "
    "another user, as the image's uid 1000 beside a trainer of another uid)",
    default="none: a unix: socket served by any other user is refused before the token goes",
    readers="Controller, sidecar status, the worker socket's calls and streams, replica links "
    "(wire/ipc.py)")
DEFAULT_SILENCE_TIMEOUT_S = 30.0
PEER_TIMEOUT = _var(
    "SIDECAR_PEER_TIMEOUT", "seconds a silent sidecar is given before waits on it end with "
    "HostLostError", default=f"{DEFAULT_SILENCE_TIMEOUT_S:g}", readers="Worker, Controller")
DEFAULT_SYNC_TIMEOUT_S = 300.0
SYNC_TIMEOUT = _var(
    "SIDECAR_SYNC_TIMEOUT", "seconds a process waits for the others at an exchange",
    default=f"{DEFAULT_SYNC_TIMEOUT_S:g}", readers="Controller under N processes (distributed.py)")

# ---- a JobSet's pods, from the downward API (k8s/render.py sets them) --------------------
JOBSET_NAME = _var("SIDECAR_JOBSET_NAME", "the JobSet's name", default="not in a JobSet",
                   readers=f"{_DISCOVERY}, {_TRAINER}")
REPLICATED_JOB = _var("SIDECAR_REPLICATED_JOB", "the replicated job's name",
                      default="not in a JobSet", readers=f"{_DISCOVERY}, {_TRAINER}")
NUM_SLICES = _var("SIDECAR_NUM_SLICES", "slices: the replicated job's replicas",
                  default="not in a JobSet", readers=f"{_DISCOVERY}, {_TRAINER}")
HOSTS_PER_SLICE = _var("SIDECAR_HOSTS_PER_SLICE", "hosts per slice: the Job's completions",
                       default="not in a JobSet; with SIDECAR_HOSTS, not checked",
                       readers=f"{_DISCOVERY}, {_TRAINER}")
SUBDOMAIN = _var("SIDECAR_SUBDOMAIN", "the pods' DNS subdomain", default="the JobSet's name",
                 readers=f"{_DISCOVERY}, {_TRAINER}")
NAMESPACE = _var("SIDECAR_NAMESPACE", "the pods' namespace, for SIDECAR_HOST_TEMPLATE",
                 default="default", readers=_DISCOVERY)
HOST_TEMPLATE = _var("SIDECAR_HOST_TEMPLATE", "str.format template of each host name",
                     default="{jobset}-{replicated_job}-{slice}-{host}.{subdomain}",
                     readers=_DISCOVERY)
DEFAULT_COORDINATOR_PORT = 8476
COORDINATOR_PORT = _var(
    "SIDECAR_COORDINATOR_PORT", "the port of the coordinator a JobSet's trainers derive",
    default=str(DEFAULT_COORDINATOR_PORT), readers=_TRAINER + " in a JobSet")

# ---- Slurm: `sidecar slurm` (tools/slurm/) and what its jobs' trainers read ------------
_RDV = "Controller.from_env, sidecar slurm (core/rendezvous.py)"
HOME = _var("SIDECAR_HOME", "where `sidecar slurm` keeps services and job directories",
            default="~/.sidecar", readers=_RDV)
SLURM_DIR = _var(
    "SIDECAR_SLURM_DIR", "a Slurm job's rendezvous directory: its sidecars' entries, token",
    default="$SIDECAR_HOME/slurm/$SLURM_JOB_ID inside a Slurm job", readers=_RDV)
CLUSTER_FILE = _var(
    "SIDECAR_CLUSTER_FILE", "a service's cluster.env: Controller.from_env connects to it",
    default="none", readers=_DISCOVERY)
SERVICE = _var("SIDECAR_SERVICE", "in a cluster.env: the name of the service that wrote it",
               default="none", readers="Controller.from_cluster_file (its messages)")
SLURM_JOB = _var("SIDECAR_SLURM_JOB", "in a cluster.env: the service's Slurm job id",
                 default="none", readers="Controller.from_cluster_file: is the job alive?")

# ---- the checkpoint host; read in server/checkpoint.py and server/checkpoint_faults.py -----
CKPT_FAULT = _var(
    "SIDECAR_CKPT_FAULT", "tests only: POINT@STEP makes the sidecar SIGKILL itself there "
    "(stage, write, prepared, commit, read, replicate; swap: between a DCP overwrite's two "
    "renames), slow@STEP pauses 2 s before the write (slow@STEP:PATH until PATH exists, at "
    "most 120 s), slowstage@STEP the same before a Stage, enospc@STEP fails the write with "
    "ENOSPC",
    default="no fault", readers="the checkpoint host (server/checkpoint/faults.py)")
REPLICA_SHM = _var(
    "SIDECAR_REPLICA_SHM", "0: replicas go inline over gRPC even to a peer on this machine",
    default="1: through the peer's arena when it is mapped here", readers=_CKPT)
UNCOMMITTED_TIMEOUT = _var(
    "SIDECAR_UNCOMMITTED_TIMEOUT", "seconds a written step whose commit never comes is kept",
    default="600", readers=_CKPT)

# The launcher's rows, for ``sidecar launch --help``.
DESCRIPTIONS: dict[str, str] = {v.name: v.meaning for v in VARS.values() if v.launcher}


def _known(name: str) -> str:
  if name not in VARS:
    raise KeyError(f"{name!r} is not in sidecar/_src/core/env.py's table; add it there (with its "
                   "meaning, default and reader) before reading it")
  return name


def get(name: str, default: str | None = None, environ: Mapping[str, str] | None = None
        ) -> str | None:
  """``environ[name]`` (default ``os.environ``), or ``default`` when unset or empty.

  Raises:
    KeyError: ``name`` is not in the table.
  """
  value = (os.environ if environ is None else environ).get(_known(name))
  return default if value is None or value == "" else value


def table() -> str:
  """The table as text: name, meaning, default and who reads it, one variable a paragraph."""
  return "\n".join(f"{v.name}\n  {v.meaning}\n  default: {v.default}\n  read by: {v.readers}"
                   for v in VARS.values())


def token(token_file: str | None = None, environ: Mapping[str, str] | None = None
          ) -> str | None:
  """The token in ``token_file``, else ``$SIDECAR_TOKEN``, else in ``$SIDECAR_TOKEN_FILE``.

  Raises:
    OSError: the file cannot be read.
    InvalidArgumentError: the file is empty.
  """
  return _token(TOKEN, TOKEN_FILE, "token", token_file, environ)


def socket_uids(environ: Mapping[str, str] | None = None) -> frozenset[int]:
  """The uids ``$SIDECAR_SOCKET_UID`` names (numbers or user names), empty where unset.

  Raises:
    InvalidArgumentError: a name no user of this machine has, naming the variable.
  """
  uids = set()
  for item in (get(SOCKET_UID, "", environ) or "").split(","):
    if not (item := item.strip()):
      continue
    if item.isdigit():
      uids.add(int(item))
      continue
    try:
      uids.add(pwd.getpwnam(item).pw_uid)
    except KeyError:
      raise errors.InvalidArgumentError(
          f"{SOCKET_UID}={item!r}: no such user on this machine; name the user (or uid) the "
          "sidecar runs as, comma-separated") from None
  return frozenset(uids)


def _warn_if_readable(fd: int, path: str) -> None:
  """Warns where a token file is readable by others, or by a group this process is not in
  (a Kubernetes fsGroup, which the sidecar shares, is fine)."""
  st = os.fstat(fd)
  mine = st.st_gid == os.getgid() or st.st_gid in os.getgroups()
  if st.st_mode & stat.S_IROTH or (st.st_mode & stat.S_IRGRP and not mine):
    logging.getLogger(__name__).warning(
        "token file %s is readable by %s (mode %o): anyone who reads it may use the sidecars; "
        "chmod 600 %s", path, "everyone" if st.st_mode & stat.S_IROTH else "its group",
        stat.S_IMODE(st.st_mode), path)


def client_tokens(path: str | None) -> tuple[tuple[str, str], ...]:
  """The ``(name, token)`` pairs of a client tokens file: one ``NAME TOKEN`` a line ('#'
  starts a comment); ``()`` without a file.

  Raises:
    OSError: the file cannot be read.
    InvalidArgumentError: a line is not ``NAME TOKEN``, or the file holds none.
  """
  if not path:
    return ()
  pairs = []
  with open(path) as f:
    _warn_if_readable(f.fileno(), path)
    for number, line in enumerate(f, 1):
      words = line.split("#", 1)[0].split()
      if not words:
        continue
      if len(words) != 2:
        raise errors.InvalidArgumentError(
            f"{path}:{number}: a line of a client tokens file is 'NAME TOKEN', got "
            f"{len(words)} words")
      pairs.append((words[0], words[1]))
  if not pairs:
    raise errors.InvalidArgumentError(f"client tokens file {path!r} names no client")
  return tuple(pairs)


def replica_token(token_file: str | None = None, environ: Mapping[str, str] | None = None
               ) -> str | None:
  """The peer token in ``token_file``, else ``$SIDECAR_PEER_TOKEN``, else in
  ``$SIDECAR_PEER_TOKEN_FILE``; raises as :func:`token` does."""
  return _token(PEER_TOKEN, PEER_TOKEN_FILE, "peer token", token_file, environ)


def _token(var: str, file_var: str, what: str, token_file: str | None,
           environ: Mapping[str, str] | None) -> str | None:
  """The ``what`` in ``token_file``, else ``$var``, else in ``$file_var``."""
  if not token_file and get(var, environ=environ):
    return get(var, environ=environ)
  token_file = token_file or get(file_var, environ=environ)
  if not token_file:
    return None
  with open(token_file) as f:
    text = f.read().strip()
    _warn_if_readable(f.fileno(), token_file)
  if not text:
    raise errors.InvalidArgumentError(f"{what} file {token_file!r} is empty; put the {what} in it")
  return text


def int_var(env: Mapping[str, str], name: str, default: int | None, *, minimum: int,
            maximum: int | None = None) -> int:
  """The integer in ``env[name]`` (``default`` when unset, if there is one).

  Raises:
    InvalidArgumentError: it is unset with no default, not an integer, or out of bounds;
      the message names the variable and what it holds.
  """
  text = env.get(_known(name), "").strip()
  if not text and default is not None:
    return default
  try:
    value: int | None = int(text)
  except ValueError:
    value = None
  if value is None or value < minimum or (maximum is not None and value > maximum):
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    raise errors.InvalidArgumentError(f"{name} must be an integer {bounds}, got {text!r}")
  return value


def float_var(env: Mapping[str, str], name: str, default: float, *, minimum: float,
              maximum: float | None = None) -> float:
  """The number in ``env[name]`` (``default`` when unset); above ``minimum``, at most ``maximum``.

  Raises:
    InvalidArgumentError: it is not a finite number or out of bounds; the message names the
      variable and what it holds.
  """
  text = env.get(_known(name), "").strip()
  if not text:
    return default
  try:
    value: float | None = float(text)
  except ValueError:
    value = None
  if value is None or not math.isfinite(value) or value <= minimum or (
      maximum is not None and value > maximum):
    bounds = f"> {minimum:g}" + ("" if maximum is None else f" and <= {maximum:g}")
    raise errors.InvalidArgumentError(f"{name} must be a number of seconds {bounds}, got {text!r}")
  return value


def silence_timeout(value: float | None, env: Mapping[str, str] | None = None) -> float:
  """``value``, or ``$SIDECAR_PEER_TIMEOUT`` when None (30 s unset): how long a silent
  sidecar is waited on before it counts as lost.

  Raises:
    InvalidArgumentError: ``value`` or the variable is not a positive number of seconds.
  """
  if value is None:
    return float_var(os.environ if env is None else env, PEER_TIMEOUT, DEFAULT_SILENCE_TIMEOUT_S,
                     minimum=0.0)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise errors.InvalidArgumentError(
        f"silence_timeout must be a positive number of seconds, got {value!r}")
  return float(value)
