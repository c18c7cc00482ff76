"""One job per checkpoint directory (issue 62 item 5), as the issue met it: two
``sidecar launch``es on one ``--ckpt`` directory, each with its own sidecar.

Before: both exited 0, ``max_to_keep`` of each deleting the other's steps, and the goodput
ledger merged both jobs. Now the second launch's trainer is refused at its checkpointer's
open, naming the first launch (its launcher's pid and machine) and the directory; once
the first launch is SIGKILLed whole (launcher, sidecar, trainer: nothing cleaned up), a
third takes the directory over at once and saves.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import eventually
from tests.support.paths import entries

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

TRAINER = """
    import os, pathlib, sys, time
    import numpy as np
    import sidecar
    directory, step, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "wait"
    with sidecar.jax.Controller.from_env(timeout=30) as ctl:
      try:
        ckpt = ctl.checkpointer(directory, max_to_keep=1)
      except sidecar.PermissionDeniedError as e:
        print("REFUSED", e, flush=True)
        sys.exit(3)
      with ckpt:
        ckpt.save(step, {"w": np.full(4, step, np.float32)}).durable.result(60)
        print("HELD", os.getpid(), flush=True)
        while wait:
          time.sleep(1)
"""


def _launch(directory, step: int, mode: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "8MiB",
       "--checkpoint-root", str(directory.parent), "--", sys.executable, "-c",
       textwrap.dedent(TRAINER), str(directory), str(step), mode],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_second_launch_on_one_directory_is_refused_and_a_killed_one_taken_over(tmp_path):
  directory = tmp_path / "ck"
  first = _launch(directory, 1, "wait")
  try:
    out = ""
    while "HELD" not in out:
      line = first.stdout.readline()
      assert line, out
      out += line
    second = _launch(directory, 2, "exit")
    said = second.communicate(timeout=120)[0]
    assert second.returncode != 0, said
    assert f"REFUSED checkpoint directory {str(directory)!r} is held by another live job, " \
           f"'sidecar launch " in said, said
    assert f"(pid {first.pid} on " in said, said  # the first launcher, by its pid
    assert entries(directory) == ["1"]  # its max_to_keep deleted nothing of the first's
  finally:
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and its sidecar, then its trainer
    first.wait(timeout=60)
    if found := re.search(r"HELD (\d+)", out):  # the trainer, in a session of its own
      with contextlib.suppress(ProcessLookupError):
        os.kill(int(found.group(1)), signal.SIGKILL)
  assert eventually(lambda: subprocess.run(["pgrep", "-s", str(first.pid)],
                                           capture_output=True).returncode != 0, timeout=30)
  third = _launch(directory, 3, "exit")
  said = third.communicate(timeout=120)[0]
  assert third.returncode == 0 and "HELD" in said, said
  assert entries(directory) == ["3"]  # the third job's own max_to_keep=1
