"""The suite's own leak check: a segment another process tree holds is not this test's
(``pytest -n``: the other worker's test makes and holds its own meanwhile)."""

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import _held_by_others, eventually
from tests.support import leaks

pytestmark = pytest.mark.processes

# Opens the segment, then says so; the holder is the grandchild, so nobody's child once
# the child exits (another tree's process, as another xdist worker's are).
HOLD = """
import subprocess, sys
path, ready = sys.argv[1], sys.argv[2]
subprocess.Popen([sys.executable, "-c", f'''
import os, time
f = open({path!r}, "x")
open({ready!r}, "w").write(str(os.getpid()))
time.sleep(60)
'''])
"""


def test_a_segment_held_by_another_tree_is_not_ours_one_held_by_our_child_is(tmp_path):
  theirs, mine = f"psm_theirs-{os.getpid()}", f"psm_mine-{os.getpid()}"
  ready = tmp_path / "ready"
  subprocess.run([sys.executable, "-c", HOLD, os.path.join(leaks.SHM_DIR, theirs), str(ready)],
                 check=True, timeout=30)
  assert eventually(ready.exists, timeout=30)
  assert eventually(lambda: ready.read_text() != "", timeout=5)
  holder = int(ready.read_text())
  child = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                            "f = open(sys.argv[1], 'x'); print(flush=True); time.sleep(60)",
                            os.path.join(leaks.SHM_DIR, mine)], stdout=subprocess.PIPE)
  try:
    child.stdout.readline()
    assert _held_by_others({theirs, mine}) == {theirs}
  finally:
    os.kill(holder, signal.SIGKILL)
    child.kill()
    child.wait()
    for name in (theirs, mine):
      os.unlink(os.path.join(leaks.SHM_DIR, name))
