"""``sidecar slurm batch|service|status|stop``, and the drivers its scripts run.

``register(subparsers)`` adds the ``slurm`` command to the ``sidecar`` CLI. The commands
whose names start with ``_`` are what the scripts run inside the job (job.py, tasks.py,
service.py); they are not listed in ``--help``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from sidecar._src.core import errors
from sidecar._src.tools import cli_format

BATCH_HELP = """\
Prints an sbatch script (or submits it with --submit) that, on the job's first node:
starts --hosts-per-node sidecars on every node as a background step (srun --overlap),
waits until every one serves (one that fails to start fails the job at once, naming its
node, task and last log lines), runs CMD as the trainer step (--ntasks-per-node tasks per
node, each in equal shares beside its node's sidecars, with the environment of `sidecar
launch`: SIDECAR_ADDRESS, SIDECAR_HOSTS, SIDECAR_PROCESS_ID, ... so that
sidecar.jax.initialize() and sidecar.jax.Controller.from_env() need nothing else), and
when the trainers end, fail, or the job is cancelled, stops every step and removes what
it wrote in the job's rendezvous directory ($SIDECAR_HOME/slurm/JOB_ID, with its 0600 token
file), and the directory if it made it. SIDECAR_SLURM_DIR may name another: a path that does
not exist, or an empty directory (a non-empty one is refused, untouched).

With --elastic, a lost sidecar or node stops the trainers and starts them again on the
sidecars that remain (their RAM tiers keep the last steps), while --min-hosts remain.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``slurm`` and its subcommands to ``subparsers``."""
  slurm = subparsers.add_parser(
      "slurm", help="Slurm batch jobs and long-lived sidecar services",
      description="Run sidecars and trainers under Slurm: a batch job's sidecars beside "
                  "its trainers, or a service of sidecars that clients and notebooks join "
                  "through a cluster file (docs/slurm.md).",
      formatter_class=cli_format.DefaultsFormatter)
  commands = slurm.add_subparsers(dest="slurm_command", metavar="{batch,service,status,stop}")
  commands.required = True
  _add_batch(commands)
  _add_service(commands)
  _add_status_stop(commands)
  _add_internal(commands)


def _common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--hosts-per-node", type=int, default=1,
                 help="sidecars per node; each serves an equal share of the node's tasks")
  p.add_argument("--shm-size", default="1GiB", help="each sidecar's arena size")
  p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                 help="module each sidecar imports, so its decorators register (repeatable; "
                      "default: none)")
  p.add_argument("--checkpoint-root", metavar="DIR",
                 help="directory the sidecars may checkpoint in (default: the submit "
                      "directory)")
  p.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[],
                 metavar="ARG", help="one more sbatch option, e.g. --sbatch-arg=--time=2:00:00 "
                 "(repeatable; default: none)")


def _add_batch(commands: argparse._SubParsersAction) -> None:
  p = commands.add_parser(
      "batch", help="print (or submit) an sbatch script: sidecars beside the trainers",
      usage="sidecar slurm batch [options] -- CMD [ARGS...]", epilog=BATCH_HELP,
      description="A Slurm batch job of sidecars and trainer tasks.",
      formatter_class=cli_format.RawDescriptionDefaultsFormatter)
  p.add_argument("--nodes", type=int, default=1, help="nodes of the job")
  p.add_argument("--ntasks-per-node", type=int, default=1,
                 help="trainer tasks (processes) per node")
  _common(p)
  p.add_argument("--devices-per-task", type=int,
                 help="CPU runs only: CPU devices of each trainer, SIDECAR_LOCAL_DEVICES "
                      "(default: JAX's own count)")
  p.add_argument("--elastic", action="store_true",
                 help="a lost sidecar or node restarts the others' trainers (default: off)")
  p.add_argument("--min-hosts", type=int, default=1,
                 help="with --elastic: restart while at least this many sidecars remain")
  p.add_argument("--job-name", default="sidecar", help="the job's name")
  p.add_argument("--submit", action="store_true",
                 help="submit the script with sbatch and print the job id (default: print "
                      "the script)")
  p.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                 help="the trainer command, run once per task")
  p.set_defaults(func=_batch, parser=p)


def _batch(args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import script
  command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
  if args.min_hosts != 1 and not args.elastic:
    args.parser.error("--min-hosts applies only with --elastic")
  try:
    spec = script.BatchSpec(
        command=tuple(command), nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
        hosts_per_node=args.hosts_per_node, shm_size=args.shm_size, imports=tuple(args.imports),
        checkpoint_root=os.path.abspath(args.checkpoint_root or os.getcwd()),
        elastic=args.elastic, min_hosts=args.min_hosts,
        devices_per_task=args.devices_per_task, sbatch_args=tuple(args.sbatch_args),
        job_name=args.job_name)
  except errors.InvalidArgumentError as e:
    args.parser.error(str(e))
  text = script.batch_script(spec)
  if not args.submit:
    sys.stdout.write(text)
    return 0
  return _submit(text)


def _submit(text: str) -> int:
  try:
    done = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True,
                          timeout=120)
  except FileNotFoundError:
    print("sidecar slurm: sbatch is not on PATH; run this on a Slurm login node, or print the "
          "script (no --submit) and submit it there", file=sys.stderr)
    return 127
  if done.returncode:
    print(f"sidecar slurm: sbatch refused the job: {done.stderr.strip()}", file=sys.stderr)
    return done.returncode
  print(done.stdout.strip().split(";")[0])
  return 0


def _add_service(commands: argparse._SubParsersAction) -> None:
  p = commands.add_parser(
      "service", help="submit a long-lived service of sidecars, joined by cluster file",
      formatter_class=cli_format.DefaultsFormatter,
      description="Submit a service job that keeps an array job of sidecars running (one "
                  "task per node, requeued when it fails) and writes "
                  "$SIDECAR_HOME/NAME/cluster.env once --min-nodes of them serve. Clients "
                  "connect with sidecar.jax.Controller.from_cluster_file(PATH) or from_env() "
                  "with SIDECAR_CLUSTER_FILE=PATH.")
  p.add_argument("--name", required=True, help="the service's name")
  p.add_argument("--nodes", type=int, default=1, help="nodes (array tasks) of sidecars")
  p.add_argument("--min-nodes", type=int, help="write the cluster file once this many "
                 "tasks serve (default: --nodes)")
  p.add_argument("--devices-per-host", type=int, default=1,
                 help="device ids each sidecar declares, for one-process clients (host h "
                      "owns h*D..h*D+D-1)")
  p.add_argument("--pool", metavar="FILE",
                 help="a pool file (YAML, on a filesystem every node reads): each sidecar "
                      "serves its tenants, each with its token and quotas, instead of the "
                      "service's one token; docs/pool.md (default: none)")
  _common(p)
  p.set_defaults(func=_service, parser=p)


def _service(args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import service
  try:
    spec = service.ServiceSpec(
        name=args.name, nodes=args.nodes,
        min_nodes=args.nodes if args.min_nodes is None else args.min_nodes,
        hosts_per_node=args.hosts_per_node, devices_per_host=args.devices_per_host,
        shm_size=args.shm_size, imports=tuple(args.imports),
        checkpoint_root=os.path.abspath(args.checkpoint_root or os.getcwd()),
        sbatch_args=tuple(args.sbatch_args),
        pool=os.path.abspath(args.pool) if args.pool else "")
  except errors.InvalidArgumentError as e:
    args.parser.error(str(e))
  return service.submit(spec)


def _add_status_stop(commands: argparse._SubParsersAction) -> None:
  p = commands.add_parser("status", help="show a service: jobs, tasks, hosts, arena use",
                          formatter_class=cli_format.DefaultsFormatter,
                          description="Show a service's jobs and array tasks (squeue), its "
                                      "hosts and their arena use (sidecar status).")
  p.add_argument("name", help="the service's name")
  p.add_argument("--timeout", type=float, default=5.0, help="seconds each sidecar is given")
  p.set_defaults(func=lambda a: _service_call("status", a))
  p = commands.add_parser("stop", help="end a service and remove its cluster file",
                          formatter_class=cli_format.DefaultsFormatter,
                          description="Cancel a service's jobs, wait until they are gone, "
                                      "and remove what the service wrote in "
                                      "$SIDECAR_HOME/NAME (and it, if the service made it).")
  p.add_argument("name", help="the service's name")
  p.add_argument("--timeout", type=float, default=60.0,
                 help="seconds to wait for the jobs to end")
  p.set_defaults(func=lambda a: _service_call("stop", a))


def _service_call(what: str, args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import service
  try:
    return getattr(service, what)(args.name, timeout=args.timeout)
  except errors.SidecarError as e:
    print(f"sidecar slurm {what}: {e}", file=sys.stderr)
    return 1


def _add_internal(commands: argparse._SubParsersAction) -> None:
  p = commands.add_parser("_job", formatter_class=cli_format.DefaultsFormatter)
  p.add_argument("--hosts-per-node", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--shm-size", default="1GiB", help=argparse.SUPPRESS)
  p.add_argument("--import", dest="imports", action="append", default=[], help=argparse.SUPPRESS)
  p.add_argument("--checkpoint-root", default="", help=argparse.SUPPRESS)
  p.add_argument("--devices-per-task", type=int, help=argparse.SUPPRESS)
  p.add_argument("--elastic", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--min-hosts", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("command_line", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
  p.set_defaults(func=_job)

  p = commands.add_parser("_sidecars", formatter_class=cli_format.DefaultsFormatter)
  p.add_argument("--dir", required=True, help=argparse.SUPPRESS)
  p.add_argument("--hosts-per-node", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--shm-size", default="1GiB", help=argparse.SUPPRESS)
  p.add_argument("--import", dest="imports", action="append", default=[], help=argparse.SUPPRESS)
  p.add_argument("--checkpoint-root", dest="checkpoint_roots", action="append", default=[],
                 help=argparse.SUPPRESS)
  p.add_argument("--session-quota", default=None, help=argparse.SUPPRESS)
  p.set_defaults(func=_sidecars)

  p = commands.add_parser("_trainer", formatter_class=cli_format.DefaultsFormatter)
  p.add_argument("--dir", required=True, help=argparse.SUPPRESS)
  p.add_argument("--step", type=int, required=True, help=argparse.SUPPRESS)
  p.add_argument("command_line", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
  p.set_defaults(func=_trainer)

  for name in ("_service", "_array"):
    p = commands.add_parser(name, formatter_class=cli_format.DefaultsFormatter)
    p.add_argument("--name", required=True, help=argparse.SUPPRESS)
    p.set_defaults(func=_service_driver, which=name)


def _job(args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import job
  command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
  return job.run(job.JobOptions(
      command=tuple(command), hosts_per_node=args.hosts_per_node, shm_size=args.shm_size,
      imports=tuple(args.imports),
      checkpoint_roots=(args.checkpoint_root,) if args.checkpoint_root else (),
      devices_per_task=args.devices_per_task, elastic=args.elastic, min_hosts=args.min_hosts))


def _sidecars(args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import tasks
  return tasks.run_sidecars(args.dir, hosts_per_node=args.hosts_per_node,
                            shm_size=args.shm_size, imports=args.imports,
                            checkpoint_roots=args.checkpoint_roots,
                            session_quota=args.session_quota)


def _trainer(args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import tasks
  command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
  return tasks.run_trainer(args.dir, args.step, command)


def _service_driver(args: argparse.Namespace) -> int:
  from sidecar._src.tools.slurm import service
  return service.run_service(args.name) if args.which == "_service" else \
      service.run_array(args.name)
