"""``sidecar slurm batch``'s script and its checks of the arguments, with no Slurm."""

import sys

import pytest

from sidecar._src.core import errors
from sidecar._src.tools.slurm import script

pytestmark = pytest.mark.unit


def test_hosts_per_node_must_divide_the_tasks_per_node_naming_both():
  with pytest.raises(errors.InvalidArgumentError,
                     match="--hosts-per-node 2 does not divide --ntasks-per-node 3"):
    script.BatchSpec(command=("true",), ntasks_per_node=3, hosts_per_node=2)
  with pytest.raises(errors.InvalidArgumentError, match="CMD is missing"):
    script.BatchSpec(command=())
  with pytest.raises(errors.InvalidArgumentError, match="--sbatch-arg 'time=1' is not one"):
    script.BatchSpec(command=("true",), sbatch_args=("time=1",))


def test_the_script_asks_for_the_nodes_and_tasks_and_runs_the_driver():
  text = script.batch_script(script.BatchSpec(
      command=("python", "train.py", "--lr", "0.1"), nodes=2, ntasks_per_node=4,
      hosts_per_node=2, imports=("my_pkg.fns",), checkpoint_root="/ck", elastic=True,
      sbatch_args=("--time=1:00:00",)))
  assert text.startswith("#!/bin/bash\n")
  for line in ("#SBATCH --nodes=2\n", "#SBATCH --ntasks-per-node=4\n",
               "#SBATCH --time=1:00:00\n"):
    assert line in text
  last = text.splitlines()[-1]
  assert last.startswith(f"exec {sys.executable} -m sidecar slurm _job --hosts-per-node 2")
  assert "--import my_pkg.fns" in last and "--elastic --min-hosts 1" in last
  assert last.endswith("-- python train.py --lr 0.1")
