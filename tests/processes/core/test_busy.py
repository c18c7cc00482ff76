"""Whether a trainer works (core/busy.py), read from the kernel for a real process group."""

import subprocess
import sys
import time

import pytest

from sidecar._src.core import busy

pytestmark = pytest.mark.processes


def test_a_process_group_burns_while_it_works():
  """A spinning child in a group of its own: the group's CPU time grows between readings.

  A group of its own, not pytest's: another worker of pytest's group may end between the two
  readings and take its CPU time out of the sum (a CI run saw 321.75 s, then 321.52 s).
  """
  child = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
  try:
    group = child.pid  # a new session's leader leads its own group
    time.sleep(0.2)
    c0 = busy.groups_cpu([group])[group]
    time.sleep(0.3)
    c1 = busy.groups_cpu([group])[group]
    assert c0 is not None and c1 is not None
    assert c1 - c0 >= 0.3 * busy.BUSY_SHARE
  finally:
    child.kill()
    child.wait()
  assert busy.groups_cpu([group]) == {group: None}  # gone with its last member
  assert busy.groups_cpu([2**22]) == {2**22: None}
