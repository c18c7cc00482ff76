"""What /proc says of a process (core/procfs.py): the one parser of its stat line."""

import os

import pytest

from sidecar._src.core import procfs

pytestmark = pytest.mark.unit


def test_this_process_as_the_kernel_says():
  me = procfs.read(os.getpid())
  assert me is not None and me.alive and me.state == "R"  # it reads: it runs
  assert me.pgrp == os.getpgrp() and me.start == procfs.start(os.getpid())
  assert me.cpu_s == pytest.approx(sum(os.times()[:2]), abs=0.05)
  assert procfs.same(os.getpid(), me.start)


@pytest.mark.parametrize("pid", [0, -1, procfs.PID_MAX, procfs.PID_MAX + 1, True, "1", 1.0],
                         ids=["zero", "negative", "no-such", "past-max", "bool", "str", "float"])
def test_no_process_is_none(pid):
  assert procfs.read(pid) is None and procfs.start(pid) is None
  assert not procfs.same(pid, 0)


def test_a_pid_is_the_same_process_only_with_its_start():
  start = procfs.start(os.getpid())
  assert not procfs.same(os.getpid(), start + 1)  # another process that had this pid
  assert not procfs.same(os.getpid(), None)  # never known: never the same


@pytest.mark.parametrize("line, want", [
    (b"12 (a b) c)) S 1 77 77 0 -1 0 0 0 0 0 5 6 0 0 20 0 1 0 4242 0 0",
     procfs.Stat(12, "S", 77, 11, 4242)),
    (b"12 (x) Z 1 77", None),  # cut short
    (b"garbage", None),
], ids=["name-with-parens", "short", "garbage"])
def test_the_line_is_parsed_after_the_names_last_parenthesis(line, want):
  assert procfs._parse(12, line) == want


def test_every_process_of_a_group():
  found = procfs.in_groups([os.getpgrp(), procfs.PID_MAX])
  assert os.getpid() in [s.pid for s in found[os.getpgrp()]]
  assert found[procfs.PID_MAX] == []
