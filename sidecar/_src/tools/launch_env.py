"""The environment ``sidecar launch`` gives each trainer: what ``env.py`` lists (the
``SIDECAR_*`` variables that ``Worker`` and ``Controller.from_env()`` read), the platform
JAX would pick (``core/platform.py``: CPU devices only where no accelerator is here) and,
with ``--torch``, what torchrun gives its workers (``RANK``, ``MASTER_PORT``, ...)."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence

from sidecar._src.core import env as env_lib, errors, platform
from sidecar._src.tools.local import LocalCluster
from sidecar._src.tools.torchrun import torchrun_env

PREEMPTION_SERVICE = "JAX_ENABLE_PREEMPTION_SERVICE"
# This launch's job name (SIDECAR_JOB): every trainer of it, restarts included, has it.
JOB = f"sidecar launch {secrets.token_hex(4)} (pid {os.getpid()} on {socket.gethostname()})"
COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def loopback_tcp(say: Callable[[str], None], processes: int, torch: bool) -> bool:
  """Whether a job of ``processes`` trainers has the loopback TCP port its coordinator
  needs (none for one process); where not, says what failed and how to run here."""
  if processes == 1:
    return True
  try:
    free_port()
  except OSError as e:
    what = "torch's store" if torch else "jax.distributed's coordinator"
    say(f"a job of {processes} trainer processes needs a TCP port on 127.0.0.1 for "
               f"{what}, and this machine allows none ({e}); run one process here "
               "(--hosts 1 --procs-per-host 1), which needs no coordinator")
    return False
  return True


def trainer_env(cluster: LocalCluster, host: int, coordinator: str | None,
                base: Mapping[str, str], *, hosts: Sequence[int] | None = None,
                restart: int = 0, procs_per_host: int = 1, local_rank: int = 0,
                torch_master: str | None = None, max_restarts: int = 0) -> dict[str, str]:
  """The environment of trainer ``local_rank`` beside ``host``: ``base`` plus what
  ``env.py`` lists and ``platform.for_trainers`` sets (``JAX_PLATFORMS=cpu`` and
  ``cluster.devices_per_host`` CPU devices where no accelerator is here, nothing where one
  is), and with ``torch_master`` (``addr:port``, where the launcher serves the job's c10d
  store: ``c10d_store.py``) what torchrun sets.

  ``hosts`` are the host ids of the job, in order (default: every host of ``cluster``);
  the process ids (ranks) follow that order, ``procs_per_host`` per host, the local ranks
  of one host in a row. ``restart`` is how often the job was restarted; ``max_restarts``
  how often it may be (with any, JAX's persistent compilation cache gets a directory of
  the cluster's unless ``base`` names one).
  """
  hosts = list(range(cluster.num_hosts)) if hosts is None else list(hosts)
  if not 0 <= local_rank < procs_per_host:
    raise errors.InvalidArgumentError(
        f"local_rank must be in 0..{procs_per_host - 1}, got {local_rank!r}")
  group = hosts.index(host)
  rank, world = group * procs_per_host + local_rank, len(hosts) * procs_per_host
  result = dict(base)
  result.update(platform.for_trainers(base, devices=cluster.devices_per_host).env)
  result.setdefault("PYTHONUNBUFFERED", "1")
  # jax.distributed.initialize() would start JAX's preemption service, whose notifier
  # catches SIGTERM (to sync a save at preemption, on Cloud TPU): a trainer stopped here
  # would go on until the SIGKILL after the grace, seconds of every elastic restart.
  result.setdefault(PREEMPTION_SERVICE, "false")
  if max_restarts > 0:
    # A restarted trainer reads what its predecessor compiled from JAX's persistent cache
    # instead of compiling it again (seconds a restart on a TPU); one per launch, gone
    # with the cluster's directory.
    result.setdefault(COMPILATION_CACHE, cluster.scratch("jax-cache"))
  result.pop(env_lib.COORDINATOR_ADDRESS, None)
  if coordinator is not None:  # a job of one process has none
    result[env_lib.COORDINATOR_ADDRESS] = coordinator
  result.update({
      env_lib.NUM_PROCESSES: str(world),
      env_lib.PROCESS_ID: str(rank),
      env_lib.LOCAL_DEVICES: str(cluster.devices_per_host),
      env_lib.HOST_ID: str(host),
      env_lib.SLICE_ID: "0",
      env_lib.ADDRESS: f"unix://{cluster.socket(host)}",
      env_lib.HOSTS: ",".join(cluster.host_entry(h) for h in hosts),
      env_lib.RESTART: str(restart),
      env_lib.JOB: base.get(env_lib.JOB) or JOB,
  })
  if torch_master is not None:
    addr, port = torch_master.rsplit(":", 1)
    result.update(torchrun_env(rank=rank, local_rank=local_rank, world_size=world,
                               local_world_size=procs_per_host, group_rank=group,
                               group_world_size=len(hosts), master_addr=addr,
                               master_port=int(port), restart=restart,
                               max_restarts=max_restarts, agent_store=True))
    if world > 1:  # as torchrun for a node's ranks: every rank here shares this machine's cores
      result.setdefault("OMP_NUM_THREADS", "1")
  if cluster.token:
    result[env_lib.TOKEN] = cluster.token
  return result
