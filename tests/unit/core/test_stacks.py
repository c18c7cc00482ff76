"""core/stacks.py: which signal a trainer's stacks come on, and whether a process catches
it. Tier 1: this process only (its own /proc entry)."""

import os
import signal

import pytest

from sidecar._src.core import stacks

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["SIGUSR2", "USR2", "usr2", str(int(signal.SIGUSR2))])
def test_a_signal_is_named_any_usual_way(name):
  assert stacks.parse(name) is signal.SIGUSR2


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP", "SIGNOPE", ""])
def test_a_signal_that_cannot_be_caught_or_is_none_is_refused(name):
  with pytest.raises(ValueError, match="SIDECAR_STACKS_SIGNAL must"):
    stacks.parse(name)


def test_catches_reads_the_processs_caught_signals():
  sig = signal.SIGRTMIN + 3
  old = signal.signal(sig, lambda *_: None)
  try:
    with open("/proc/self/status") as f:
      if "SigCgt:" not in f.read():
        pytest.skip("this kernel's /proc has no SigCgt (gVisor): catches() says None")
    assert stacks.catches(os.getpid(), sig) is True
    signal.signal(sig, signal.SIG_DFL)
    assert stacks.catches(os.getpid(), sig) is False
  finally:
    signal.signal(sig, old)


def test_catches_cannot_tell_for_a_process_that_is_not_there():
  # Unknown is None, never False: a caller sends the signal only where it is not False.
  assert stacks.catches(2**22 + 12345, signal.SIGUSR2) is None
