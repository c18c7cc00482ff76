"""Issue 77 through `sidecar launch` and examples/lm on CPU: busy is not hung.

An evaluation nobody declared, twice the stall timeout and more, burning the CPU, is slow:
said with its stacks and the phase API, never killed; a step that blocks in a call (a hang
that burns nothing) is killed at the timeout and the next life trains on; of two processes,
one that recompiles for longer than the timeout is slow and the other, idle in the
collective that waits for it, waits: neither is killed. The goodput ledger counts the slow
time as `slow` and the hang as `stall`. What each took is printed (the launcher's restart
line), never asserted: benchmarks/stall_stop.py measures it.
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from sidecar._src.core import stall

# Each test is one launch of one or two JAX trainers (and a standby): 30-90 s on 2 cores.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(400)]

ROOT = pathlib.Path(__file__).resolve().parents[3]
# --stall-timeout: the rule's timeout is at least this, and 10x the slowest step where more
# (2 s a step at worst on a loaded 2-core machine: 20 s).
FLOOR = 6
# The work nobody declared: past the timeout where it is below 20 s, and always within the
# slow bound (5x a timeout of 6 s at least: 30 s).
BUSY_S = 21
TRAIN = [sys.executable, "examples/lm/train.py", "--config", "tiny", "--progress-every", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp("corpus")
  subprocess.run([sys.executable, "examples/lm/prepare.py", "--out", str(out), "--max-mb", "1",
                  "--heldout-kb", "64"], cwd=ROOT, check=True, capture_output=True, timeout=120)
  assert (out / "heldout.bin").stat().st_size == 64 << 10
  return out


def _launch(hosts: int, launch: list[str], train: list[str]) -> subprocess.CompletedProcess:
  p = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", str(hosts),
                      "--import", "pipelines.lm", "--shm-size", "64MiB", "--stall-timeout",
                      str(FLOOR), *launch, "--", *TRAIN, *train], cwd=ROOT,
                     capture_output=True, text=True, timeout=360)
  print(p.stderr)  # the launcher's lines, the timing of the restart among them
  return p


def _lines(err: str, what: str) -> list[tuple[float, float, str]]:
  """The launcher's lines that say a trainer is ``what`` ("is slow", "is waiting",
  "stalled"): (seconds without a step, its timeout, the line)."""
  return [(float(m.group(1)), float(m.group(2)), m.group(0)) for m in re.finditer(
      rf"{what}: no step for ([\d.]+) s since its last step \(its stall timeout ([\d.]+) s.*",
      err)]


def test_an_undeclared_busy_evaluation_is_slow_and_an_idle_hang_is_killed(data, tmp_path):
  ckpt = tmp_path / "ckpt"
  p = _launch(1, ["--max-restarts", "1", "--standby"],
              ["--data", str(data), "--ckpt", str(ckpt), "--metrics", str(tmp_path / "m.jsonl"),
               "--steps", "19", "--save-every", "10", "--eval-every", "10",
               "--eval-undeclared", "--eval-min-seconds", str(BUSY_S), "--hang-at", "15"])
  out, err = p.stdout, p.stderr
  assert p.returncode == 0, out + err
  assert "trained to step 19" in out
  assert re.search(r"eval after step 10: held-out loss [\d.]+ \(4 batches x \d+", out), out
  # The evaluation: slow, said once with its stacks and the fix, never killed.
  [(since, timeout, line)] = _lines(err, "host 0 rank 0 is slow")
  assert since >= timeout and "but it works" in line and "ctl.phase" in line
  assert "Worker.phase" in line and "--stall-timeout" in line
  assert re.search(r"\[host 0\] .*line \d+ in maybe", out), out  # its stacks: the evaluation
  # The hang: idle, killed at its timeout (not at the slow bound), its stacks first.
  [(since, timeout, line)] = _lines(err, "host 0 rank 0 stalled")
  assert "and idle" in line and "hung" in line and "ctl.phase" in line, line
  assert timeout <= since < stall.SLOW_MULTIPLE * timeout
  assert re.search(r"\[host 0\] .*line \d+ in check", out), out  # blocked in Stalls.check
  assert re.search(r"restart 1: host 0's trainer stalled .*found [\d.]+ s after its timeout",
                   err), err
  # The ledger: the evaluation's time as slow, the hang's as stall.
  cli = subprocess.run([sys.executable, "-m", "sidecar", "goodput", str(ckpt), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
  ledger = json.loads(cli.stdout)
  assert ledger["badput_s"]["slow"] >= BUSY_S - timeout, ledger
  assert ledger["badput_s"]["stall"] >= FLOOR * 0.9 and ledger["restarts"] == 1, ledger
  table = subprocess.run([sys.executable, "-m", "sidecar", "goodput", str(ckpt)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
  assert re.search(r"^slow +[\d.]+", table, re.M) and re.search(r"^stall +[\d.]+", table, re.M)


def test_a_recompile_on_one_of_two_processes_is_slow_and_the_other_waits(data, tmp_path):
  p = _launch(2, ["--max-restarts", "0"],
              ["--data", str(data), "--ckpt", str(tmp_path / "ckpt"), "--metrics",
               str(tmp_path / "m.jsonl"), "--steps", "12", "--save-every", "6",
               "--recompile-at", f"8:{BUSY_S}:1"])
  out, err = p.stdout, p.stderr
  assert p.returncode == 0, out + err
  assert "trained to step 12" in out and "recompiled" in out
  assert not _lines(err, "stalled"), err
  [(since, timeout, line)] = _lines(err, "host 1 rank 1 is slow")
  assert "but it works" in line
  # Process 0 waits in the step's collective for process 1: idle, but not hung.
  waiting = _lines(err, "host 0 rank 0 is waiting")
  assert len(waiting) == 1 and "rank 1" in waiting[0][2], err
