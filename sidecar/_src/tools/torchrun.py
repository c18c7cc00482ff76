"""torchrun, as the sidecar's launchers give it.

:func:`torchrun_env`: the variables torchrun (torchelastic) gives each worker, by its
names: what ``sidecar launch --torch`` and ``sidecar slurm batch`` give each trainer, so
that ``torch.distributed.init_process_group()`` and ``sidecar.torch.connect()`` need no
arguments. ``sidecar torchrun``: stock torchrun for one node of a job the ``SIDECAR_*``
variables name (a pod of the k8s manifests: ``sidecar k8s render --procs-per-pod``), its
ranks sharing the node's sidecar, on the platform JAX would pick (``core/platform.py``:
CPU devices only where no accelerator is here). Standard library only: the Slurm trainer
wrapper reads it before it execs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from sidecar._src.core import errors, job as job_lib, platform

# What `sidecar launch --help` says of --torch (the variables torchrun_env gives).
LAUNCH_HELP = """\
With --torch, each trainer also gets torchrun's environment, by its names: RANK,
LOCAL_RANK (0..P-1), WORLD_SIZE (N*P), LOCAL_WORLD_SIZE (P), GROUP_RANK (the host's place
in the job), GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME=default,
MASTER_ADDR=127.0.0.1, MASTER_PORT=<the job's c10d store>, TORCHELASTIC_RESTART_COUNT
(SIDECAR_RESTART), TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID=none,
TORCHELASTIC_USE_AGENT_STORE=True (the launcher serves the store, as torchrun's agent, on
127.0.0.1 only: a rank's TCPStore would listen on every interface; a fresh one each start),
and OMP_NUM_THREADS=1 unless set, when N*P > 1 (torchrun sets it for a node's ranks; here
every rank shares this machine's cores). torch.distributed.init_process_group()
(env://) and sidecar.torch.connect() then need no arguments.
"""


def torchrun_env(*, rank: int, local_rank: int, world_size: int, local_world_size: int,
                 group_rank: int, group_world_size: int, master_addr: str, master_port: int,
                 restart: int = 0, max_restarts: int = 0,
                 agent_store: bool = False) -> dict[str, str]:
  """The variables torchrun (torchelastic) gives each worker, by the names it uses.

  ``agent_store``: the launcher serves the c10d store at ``master_addr:master_port``
  (every rank is a client), as torchrun's agent does; else rank 0 serves it.
  """
  return {
      "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
      "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(group_rank),
      "GROUP_WORLD_SIZE": str(group_world_size), "ROLE_RANK": str(rank),
      "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
      "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
      "TORCHELASTIC_RESTART_COUNT": str(restart),
      "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_RUN_ID": "none",
      # Else no agent hosts the store: rank 0 serves it at MASTER_ADDR:MASTER_PORT.
      "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
  }


def session_share(ranks: int) -> str | None:
  """``--session-quota`` for a sidecar that ``ranks`` trainer processes share: about 1/P of
  the arena each (0.96/P: the sidecar keeps a little for the controllers' streams), so that
  one rank cannot take what its neighbours need; None for one rank (the default, 0.9)."""
  if ranks <= 1:
    return None
  return f"{0.96 / ranks:.3g}"


def node_args(environ: Mapping[str, str], nproc_per_node: int) -> list[str]:
  """torchrun's flags for this node: one node per process of the job ``environ`` names
  (``core/job.py``: a JobSet's pod, or ``SIDECAR_COORDINATOR_ADDRESS``,
  ``SIDECAR_NUM_PROCESSES`` and ``SIDECAR_PROCESS_ID``), the node rank that process's
  id, and its coordinator (process 0's) as torchrun's master, whose agent keeps the store.

  Raises:
    InvalidArgumentError: the environment names no job, or ``nproc_per_node`` < 1.
  """
  if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
    raise errors.InvalidArgumentError(
        f"--nproc-per-node must be an integer >= 1, got {nproc_per_node!r}")
  job = job_lib.job_from_env(environ)
  if job is None:
    raise errors.InvalidArgumentError(
        "sidecar torchrun: the environment names no job: run it in a pod of the manifests "
        "(sidecar k8s render), or set SIDECAR_COORDINATOR_ADDRESS, SIDECAR_NUM_PROCESSES and "
        "SIDECAR_PROCESS_ID (one process per node)")
  nodes = ["--nnodes", str(job["num_processes"]), "--node-rank", str(job["process_id"]),
           "--nproc-per-node", str(nproc_per_node)]
  if not job["coordinator_address"]:  # one node, no coordinator: torchrun picks its port
    return ["--standalone", *nodes]
  host, _, port = job["coordinator_address"].rpartition(":")
  return [*nodes, "--master-addr", host.strip("[]"), "--master-port", port]


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``sidecar torchrun`` to the CLI's ``subparsers``."""
  p = subparsers.add_parser(
      "torchrun", usage="sidecar torchrun [--nproc-per-node P] -- CMD [ARGS...]",
      help="stock torchrun for this node of a job the SIDECAR_* variables name",
      description="Run torchrun (python -m torch.distributed.run) for one node of the job "
                  "the environment names: a pod of the k8s manifests (sidecar k8s render "
                  "--procs-per-pod P runs it), or SIDECAR_COORDINATOR_ADDRESS, "
                  "SIDECAR_NUM_PROCESSES and SIDECAR_PROCESS_ID. Node count, node rank and "
                  "master come from the job; the node's P ranks share its sidecar "
                  "(SIDECAR_ADDRESS), each with a Worker session of its own.")
  p.add_argument("--nproc-per-node", type=int, default=1, metavar="P",
                 help="ranks on this node, one per accelerator (default: 1)")
  p.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                 help="each rank's command, whole (e.g. python train.py: torchrun --no-python)")
  p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
  """Execs torchrun for this node (returns only where that cannot start)."""
  command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
  if not command:
    args.parser.error("CMD is missing: give each rank's command after --, e.g. "
                      "sidecar torchrun --nproc-per-node 8 -- python train.py")
  try:
    flags = node_args(os.environ, args.nproc_per_node)
  except errors.InvalidArgumentError as e:
    args.parser.error(str(e))
  chosen = platform.for_trainers(os.environ, devices=None)
  print(f"sidecar torchrun: {chosen.summary}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  # --no-python: CMD is a whole command (python train.py), as sidecar launch's is.
  os.execve(sys.executable, [sys.executable, "-m", "torch.distributed.run", *flags,
                             "--no-python", *command], {**os.environ, **chosen.env})
