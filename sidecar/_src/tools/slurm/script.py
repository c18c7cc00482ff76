"""The sbatch scripts ``sidecar slurm batch`` prints and ``sidecar slurm service`` submits.

Each is a few ``#SBATCH`` lines and one ``exec`` of this Python's ``sidecar slurm`` driver
(job.py for a batch job, service.py for a service), so what runs where is the driver's
business and the script stays readable.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence

from sidecar._src.core import errors


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BatchSpec:
  """What ``sidecar slurm batch`` was given; checked when made."""
  command: tuple[str, ...]
  nodes: int = 1
  ntasks_per_node: int = 1
  hosts_per_node: int = 1
  shm_size: str = "1GiB"
  imports: tuple[str, ...] = ()
  checkpoint_root: str = ""
  elastic: bool = False
  min_hosts: int = 1
  devices_per_task: int | None = None
  sbatch_args: tuple[str, ...] = ()
  job_name: str = "sidecar"

  def __post_init__(self):
    if not self.command:
      raise errors.InvalidArgumentError(
          "CMD is missing: give the trainer command after --, e.g. sidecar slurm batch "
          "--nodes 2 -- python train.py")
    for name in ("nodes", "ntasks_per_node", "hosts_per_node", "min_hosts"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(
            f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
    if self.ntasks_per_node % self.hosts_per_node:
      raise errors.InvalidArgumentError(
          f"--hosts-per-node {self.hosts_per_node} does not divide --ntasks-per-node "
          f"{self.ntasks_per_node}: each sidecar serves an equal share of its node's trainer "
          "tasks; pick a divisor")
    if self.min_hosts > self.nodes * self.hosts_per_node:
      raise errors.InvalidArgumentError(
          f"--min-hosts {self.min_hosts} is more than the job's "
          f"{self.nodes * self.hosts_per_node} sidecars")
    if self.devices_per_task is not None and self.devices_per_task < 1:
      raise errors.InvalidArgumentError(
          f"--devices-per-task must be >= 1, got {self.devices_per_task!r}")
    for arg in self.sbatch_args:
      if not arg.startswith("-") or "\n" in arg:
        raise errors.InvalidArgumentError(
            f"--sbatch-arg {arg!r} is not one sbatch option such as --time=1:00:00")


def _sbatch_lines(args: Sequence[str]) -> str:
  return "".join(f"#SBATCH {a}\n" for a in args)


def batch_script(spec: BatchSpec) -> str:
  """The sbatch script of a batch job: sidecars, then the trainers, then cleanup."""
  driver = [sys.executable, "-m", "sidecar", "slurm", "_job",
            "--hosts-per-node", str(spec.hosts_per_node), "--shm-size", spec.shm_size,
            "--checkpoint-root", spec.checkpoint_root]
  for module in spec.imports:
    driver += ["--import", module]
  if spec.devices_per_task is not None:
    driver += ["--devices-per-task", str(spec.devices_per_task)]
  if spec.elastic:
    driver += ["--elastic", "--min-hosts", str(spec.min_hosts)]
  driver += ["--", *spec.command]
  return (
      "#!/bin/bash\n"
      "# Written by `sidecar slurm batch`. On the first node, the driver below starts\n"
      f"# {spec.hosts_per_node} sidecar(s) per node as a background step (srun --overlap),\n"
      f"# waits until all serve, runs {spec.ntasks_per_node} trainer task(s) per node, and\n"
      "# stops everything when they end, fail, or the job is cancelled.\n"
      + _sbatch_lines([f"--job-name={spec.job_name}", f"--nodes={spec.nodes}",
                       f"--ntasks-per-node={spec.ntasks_per_node}", *spec.sbatch_args])
      + f"exec {shlex.join(driver)}\n")


def service_script(name: str, sbatch_args: Sequence[str], log: str) -> str:
  """The sbatch script of a service's long-lived job (one task, on one node)."""
  driver = [sys.executable, "-m", "sidecar", "slurm", "_service", "--name", name]
  return ("#!/bin/bash\n"
          f"# Written by `sidecar slurm service --name {name}`: keeps the service's array\n"
          "# job of sidecars running and its cluster file up to date.\n"
          + _sbatch_lines([f"--job-name=sidecar-service-{name}", "--nodes=1", "--ntasks=1",
                           f"--output={log}", *sbatch_args])
          + f"exec {shlex.join(driver)}\n")


def array_script(name: str, *, nodes: int, sbatch_args: Sequence[str], log: str) -> str:
  """The sbatch script of a service's array job: one task per node, each its sidecars."""
  driver = [sys.executable, "-m", "sidecar", "slurm", "_array", "--name", name]
  return ("#!/bin/bash\n"
          f"# Written by the service {name!r}: array task i runs the sidecars of node i.\n"
          + _sbatch_lines([f"--job-name=sidecar-{name}", f"--array=0-{nodes - 1}", "--requeue",
                           "--nodes=1", "--ntasks=1", f"--output={log}", *sbatch_args])
          + f"exec {shlex.join(driver)}\n")
