"""``sidecar launch --stall-timeout``: a trainer that stops making steps is found by its
sidecar's step signal, its stacks printed, killed and restarted; and the launcher's rule
for failures that recur before a first step (tools/recurring.py; tools/watchdog.py gives it
what the sidecars saw).

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
# The floor of the hung trainers' stall timeout: each hang is waited out, so it is small (the
# issue's target is 8 s: detected and training again within 8 + 25 s). A step seen slow
# (a save on a loaded machine) raises a trainer's timeout to 10x it (core/stall.py), so
# a floor this low takes no healthy step for a hang, as --stall-timeout 2 and 3 below.
STALL_S = 4


def _launch(*args: str, timeout: float = 240, hosts: int = 1) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", str(hosts),
                         "--shm-size", "16MiB", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.parametrize("how, hangs, flags, code, rank", [
    ("sleep", 1, (), 0, 1),
    ("recv", 2, ("--standby",), stall.EXIT_CODE, 0),
], ids=["sleep-rank-1-of-2-restarted", "recv-standby-twice-ends-the-job"])
def test_a_hung_trainer_is_found_its_stacks_printed_and_it_is_restarted(
    tmp_path, how, hangs, flags, code, rank):
  """Rank ``rank`` of ``rank + 1`` hangs (one a host); the others take a step after it and
  wait for it, idle: the one that stopped first is found hung (issue 77: none works); the
  ledger, process 0's, counts the stall all the same (the launcher tells process 0's
  sidecar: issue 69)."""
  directory = tmp_path / "ckpt"
  p = _launch("--import", "tests.support.feed_fns", "--stall-timeout", str(STALL_S),
              "--max-restarts", "1", *flags, "--", sys.executable, "-m",
              "tests.support.stall_train", str(directory), how, str(hangs), str(STALL_S),
              str(rank), hosts=rank + 1)
  out, err = p.stdout, p.stderr
  assert p.returncode == code, out + err
  stalls = re.findall(rf"host {rank} rank {rank} stalled: no step for ([\d.]+) s since its "
                      r"last step \(its stall timeout ([\d.]+) s", err)
  assert len(stalls) == hangs, err
  for since, limit in stalls:
    assert float(since) >= STALL_S and float(limit) >= STALL_S  # printed to 0.1 s
  # Its stacks, every thread's, with the function each hangs in by name.
  hang = "hang_in_sleep" if how == "sleep" else "hang_in_recv"
  assert re.search(rf"\[host {rank}\] .*File .*stall_train.py.*line \d+ in {hang}", out), out
  assert re.search(rf"\[host {rank}\] .*line \d+ in side_thread", out), out
  assert "most recent call first" in out
  got = results(out)
  hung = [r for r in got if r["kind"] == "hanging"]
  assert len({r["pid"] for r in got if r["kind"] == "waiting"}) == rank  # the others
  assert [r["restart"] for r in hung] == list(range(hangs))
  # The restart trains again (from the step saved before the hang)...
  assert any(r["kind"] == "step" and r["restart"] == 1 for r in got), out
  if code == 0:
    assert [r["restart"] for r in got if r["kind"] == "done"] == [1] * (rank + 1)
    assert re.search(rf"restart 1: host {rank}'s trainer stalled \([\d.]+ s without a step\)",
                     err)
  else:  # ... and a second stall with no restart left ends the job with the stall's code
    assert "after 1 restarts (--max-restarts 1)" in err, err
  # The ledger counts the stall as its own badput.
  cli = subprocess.run([sys.executable, "-m", "sidecar", "goodput", str(directory), "--json"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert cli.returncode == 0, cli.stderr
  ledger = json.loads(cli.stdout)
  assert ledger["badput_s"]["stall"] >= hangs * STALL_S * 0.9, ledger
  died = [json.loads(line) for line in (directory / "goodput.jsonl").read_text().splitlines()
          if '"died"' in line]
  assert len(died) == hangs and all(d.get("stalled") for d in died), died
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


def test_a_first_step_slower_than_the_stall_timeout_and_a_long_phase_are_no_stall(tmp_path):
  """Issue 69: the first batch is taken before the first step's compile; a compile of 3x
  --stall-timeout in every life (and an evaluation announced with ``ctl.phase``) is never
  taken for a hang: the trainer, SIGKILLed once, runs to its last step with no stall."""
  floor = 2
  p = _launch("--import", "tests.support.feed_fns", "--stall-timeout", str(floor),
              "--max-restarts", "1", "--", sys.executable, "-m", "tests.support.stall_train",
              str(tmp_path / "ckpt"), "slow", "1", str(floor))
  out, err = p.stdout, p.stderr
  assert p.returncode == 0, out + err
  assert "stalled" not in err, err
  assert re.search(r"restart 1: host 0's trainer was killed by SIGKILL", err), err
  got = results(out)
  assert got[-1]["kind"] == "done" and got[-1]["restart"] == 1
  assert [r["step"] for r in got if r["kind"] == "step" and r["restart"] == 1] == list(
      range(5, 13))  # from the step saved before the kill


def test_a_trainer_that_steps_while_its_stacks_are_written_is_not_killed(tmp_path):
  p = _launch("--import", "tests.support.feed_fns", "--stall-timeout", "3",
              "--max-restarts", "1", "--", sys.executable, "-m", "tests.support.stall_train",
              str(tmp_path / "ckpt"), "wakes", "1", "3")
  out, err = p.stdout, p.stderr
  assert p.returncode == 0, out + err
  assert "host 0 rank 0 stalled: no step for" in err, err
  assert re.search(r"host 0 rank 0 stepped while its stacks were written \(its last step "
                   r"[\d.]+ s ago\); not killing it", err), err
  assert re.search(r"\[host 0\] .*line \d+ in hang_until_signalled", out), out
  assert "restart 1" not in err, err
  got = results(out)
  assert got[-1]["kind"] == "done" and got[-1]["restart"] == 0


def test_the_same_bug_at_the_same_step_ends_the_job_after_two_lives(tmp_path):
  """Issue 69: a bug that raises in the same step in every life (after its first, from the
  step saved before it) is not restarted until --max-restarts runs out."""
  p = _launch("--import", "tests.support.feed_fns", "--stall-timeout", "0",
              "--max-restarts", "3", "--", sys.executable, "-m", "tests.support.stall_train",
              str(tmp_path / "ckpt"), "raise", "0")
  out, err = p.stdout, p.stderr
  assert p.returncode == 1, out + err
  assert re.search(r"it failed the same way 2 times in a row at the same point of its run "
                   r"\(6: the step it resumed from plus the batches its feeds handed it, those "
                   r"sent ahead included, so not the step it raised in: its traceback names "
                   r"that\) \(exited with code 1; its last error: RuntimeError: a bug in step "
                   r"6\)", err), err
  assert len(re.findall(r"restart \d+:", err)) == 1, err  # two lives, not four
  # Issue 79 item 5: "re-run the same command to resume" after "a restart would fail again"
  assert ("once what failed is fixed, re-run the same command to resume from step 4 (as it "
          "is, it would fail the same way again)") in err, err


def test_a_missing_script_ends_the_job_at_once_naming_it(tmp_path):
  missing = tmp_path / "no-such-dir" / "train.py"
  p = _launch("--max-restarts", "3", "--", sys.executable, str(missing), timeout=60)
  assert p.returncode == 127, p.stdout + p.stderr
  assert f"its script {missing} is not a file" in p.stderr, p.stderr
  assert "restart" not in p.stderr and "sidecar (pid" not in p.stderr, p.stderr
