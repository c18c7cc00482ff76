"""``sidecar launch --stall-timeout``: a trainer that stops making steps is found by its
sidecar's step signal, its stacks printed, killed and restarted; and the launcher's rule
for failures that recur before a first step (tools/watchdog.py).

The hanging trainer is tests/support/stall_train.py: it trains with a feed and saves,
then hangs in a C call (``time.sleep``, a socket read).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from sidecar._src.core import stall
from tests.support.paths import ROOT
from tests.support.trainers import results

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
STALL_S = 8  # the target: detected and training again within 8 + 25 s


def _launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "1",
                         "--shm-size", "16MiB", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.parametrize("how, hangs, flags, code", [
    ("sleep", 1, (), 0),
    ("recv", 2, ("--standby",), stall.EXIT_CODE),
], ids=["sleep-restarted", "recv-standby-twice-ends-the-job"])
def test_a_hung_trainer_is_found_its_stacks_printed_and_it_is_restarted(
    tmp_path, how, hangs, flags, code):
  directory = tmp_path / "ckpt"
  p = _launch("--import", "tests.support.feed_fns", "--stall-timeout", str(STALL_S),
              "--max-restarts", "1", *flags, "--", sys.executable, "-m",
              "tests.support.stall_train", str(directory), how, str(hangs))
  out, err = p.stdout, p.stderr
  assert p.returncode == code, out + err
  stalls = re.findall(r"host 0 rank 0 stalled: no step for ([\d.]+) s since its last step "
                      r"\(its stall timeout ([\d.]+) s", err)
  assert len(stalls) == hangs, err
  for since, limit in stalls:
    assert float(since) >= STALL_S and float(limit) >= STALL_S  # printed to 0.1 s
  # Its stacks, every thread's, with the function each hangs in by name.
  hang = "hang_in_sleep" if how == "sleep" else "hang_in_recv"
  assert re.search(rf"\[host 0\] .*File .*stall_train.py.*line \d+ in {hang}", out), out
  assert re.search(r"\[host 0\] .*line \d+ in side_thread", out), out
  assert "most recent call first" in out
  got = results(out)
  hung = [r for r in got if r["kind"] == "hanging"]
  assert [r["restart"] for r in hung] == list(range(hangs))
  # The restart trains again (from the step saved before the hang)...
  assert any(r["kind"] == "step" and r["restart"] == 1 for r in got), out
  if code == 0:
    assert got[-1]["kind"] == "done" and got[-1]["restart"] == 1
    assert re.search(r"restart 1: host 0's trainer stalled \([\d.]+ s without a step\)", err)
  else:  # ... and a second stall with no restart left ends the job with the stall's code
    assert "after 1 restarts (--max-restarts 1)" in err, err
  # The ledger counts the stall as its own badput.
  cli = subprocess.run([sys.executable, "-m", "sidecar", "goodput", str(directory), "--json"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert cli.returncode == 0, cli.stderr
  ledger = json.loads(cli.stdout)
  assert ledger["badput_s"]["stall"] >= hangs * STALL_S * 0.9, ledger
  assert ledger["restarts"] >= 1 and ledger["skipped_lines"] == 0


def test_a_failure_that_recurs_before_the_first_step_is_not_restarted_again(tmp_path):
  # As a typo in --data: the same error each time, after its Worker attached and before
  # any step.
  script = ("import sidecar.jax\n"
            "with sidecar.jax.Controller.from_env(timeout=60):\n"
            "  raise FileNotFoundError('no corpus manifest at /tmp/lm-dta')")
  p = _launch("--max-restarts", "3", "--", sys.executable, "-c", script, timeout=120)
  assert p.returncode == 1, p.stdout + p.stderr
  assert "FileNotFoundError: no corpus manifest at /tmp/lm-dta" in p.stderr
  assert re.search(r"failed the same way 2 times in a row before its first step \(exited "
                   r"with code 1; its last error: FileNotFoundError: no corpus manifest", p.stderr)
  assert len(re.findall(r"restart \d+:", p.stderr)) == 1, p.stderr  # one restart, not 3


def test_a_failure_that_changes_is_restarted_as_before(tmp_path):
  script = "import os, sys; sys.exit('boom ' + os.environ['SIDECAR_RESTART'])"
  p = _launch("--max-restarts", "2", "--", sys.executable, "-c", script, timeout=120)
  assert p.returncode == 1, p.stdout + p.stderr
  assert len(re.findall(r"restart \d+:", p.stderr)) == 2, p.stderr
  assert "after 2 restarts (--max-restarts 2)" in p.stderr
