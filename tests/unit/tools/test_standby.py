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


@pytest.mark.parametrize("trainer", [
    ["bash", "-c", "python train.py"],  # not Python itself
    ["python"],  # no script
    ["python", "-c", "print(1)"],  # code on the command line
    ["python", "-u", "train.py"],  # an interpreter flag: run as given, not guessed at
    ["python", "-m"],  # no module
    ["torchrun", "train.py"],
])
def test_anything_else_gets_none(trainer):
  assert standby.command(trainer, []) is None
