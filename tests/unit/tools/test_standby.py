"""Which trainer commands a standby process can run (tools/standby.command); the standby
itself runs in tests/processes/tools/test_launch_standby.py."""

import pytest

from sidecar._src.tools import standby

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("trainer, target", [
    (["python", "train.py", "--steps", "3"], ["train.py", "--steps", "3"]),
    (["/usr/bin/python3.11", "-m", "pkg.train", "-x"], ["-m", "pkg.train", "-x"]),
    (["python3", "dir/t.py"], ["dir/t.py"]),
])
def test_a_python_script_or_module_gets_a_standby_command(trainer, target):
  got = standby.command(trainer, ["optax", "grain"])
  assert got == [trainer[0], "-m", "sidecar._src.tools.standby", "--preload", "optax",
                 "--preload", "grain", "--", *target]


def test_a_command_run_by_env_passes_its_assignments():
  got = standby.command(["env", "JAX_LOG_COMPILES=1", "A=b=c", "python3", "t.py", "x"], [])
  assert got == ["python3", "-m", "sidecar._src.tools.standby", "--set", "JAX_LOG_COMPILES=1",
                 "--set", "A=b=c", "--", "t.py", "x"]


@pytest.mark.parametrize("trainer", [
    ["env", "-i", "python", "t.py"],  # env's own options: run as given
    ["env", "A=1", "bash", "t.sh"],
    ["bash", "-c", "python train.py"],  # not Python itself
    ["python"],  # no script
    ["python", "-c", "print(1)"],  # code on the command line
    ["python", "-u", "train.py"],  # an interpreter flag: run as given, not guessed at
    ["python", "-m"],  # no module
    ["torchrun", "train.py"],
])
def test_anything_else_gets_none(trainer):
  assert standby.command(trainer, []) is None
