"""examples/lm end to end: `sidecar launch` trains the tiny LM, is killed, and resumes exactly."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import alive, eventually

# Two or three launches a test, each importing JAX and compiling: 30-60 s each alone, more
# than the suite's 120 s a test beside a second suite (the first of three runs in a row
# timed out in the resumed run).
pytestmark = [pytest.mark.processes, pytest.mark.timeout(400)]

ROOT = pathlib.Path(__file__).resolve().parents[3]
# Killed once step KILL_AFTER is written and step SAVE_EVERY's checkpoint committed (the
# trainer commits it: killed before, it would start again from scratch, and resume nothing).
STEPS, SAVE_EVERY, KILL_AFTER = 50, 10, 15


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp("corpus")
  subprocess.run([sys.executable, "examples/lm/prepare.py", "--out", str(out), "--max-mb", "1"],
                 cwd=ROOT, check=True, capture_output=True, timeout=60)
  return out


def _launch(data, ckpt, metrics, *, restarts: int = 0) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--import", "pipelines.lm",
       "--shm-size", "64MiB", "--max-restarts", str(restarts), "--", sys.executable,
       "examples/lm/train.py", "--config", "tiny",
       "--data", str(data), "--ckpt", str(ckpt), "--steps", str(STEPS),
       "--save-every", str(SAVE_EVERY), "--metrics", str(metrics)],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "PYTHONPATH": str(ROOT)})


def _run(data, ckpt, metrics) -> str:
  p = _launch(data, ckpt, metrics)
  out, _ = p.communicate(timeout=300)
  assert p.returncode == 0, out
  return out


def _losses(metrics) -> dict[int, float]:
  """{step: loss}, the last line written for each step."""
  lines = [json.loads(line) for line in pathlib.Path(metrics).read_text().splitlines()]
  assert all(set(line) == {"step", "loss", "time"} for line in lines)
  return {line["step"]: line["loss"] for line in lines}


def _steps(metrics) -> list[int]:
  if not os.path.exists(metrics):
    return []
  return [json.loads(line)["step"] for line in pathlib.Path(metrics).read_text().splitlines()
          if line.endswith("}")]


@pytest.fixture(scope="module")
def expected(data, tmp_path_factory) -> dict[int, float]:
  """The losses of an uninterrupted run."""
  work = tmp_path_factory.mktemp("whole")
  out = _run(data, work / "ckpt", work / "whole.jsonl")
  assert "initialised" in out and f"trained to step {STEPS}; checkpoints [30, 40, 50]" in out
  losses = _losses(work / "whole.jsonl")
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert losses[STEPS] < losses[1] - 1  # it learns
  return losses


def _killed_once(p: subprocess.Popen, ckpt, metrics, *, timeout: float) -> tuple[int, str]:
  """:func:`_kill_mid_way`, then the launch's end (within ``timeout``; killed if not): the
  trainer's pid and all the launcher printed."""
  try:
    trainer, header = _kill_mid_way(p, ckpt, metrics)
    rest, _ = p.communicate(timeout=timeout)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  return trainer, header + rest


def _kill_mid_way(p: subprocess.Popen, ckpt, metrics) -> tuple[int, str]:
  """SIGKILLs the trainer of launch ``p`` once step KILL_AFTER is written and step
  SAVE_EVERY committed; its pid, and what the launcher printed until then."""
  header = p.stdout.readline() + p.stdout.readline()
  while "initialised" not in header:
    line = p.stdout.readline()
    assert line, header
    header += line
  trainer = int(re.search(r"pid (\d+) initialised", header).group(1))
  assert eventually(lambda: KILL_AFTER in _steps(metrics)
                    and (ckpt / str(SAVE_EVERY)).is_dir(), timeout=60), header
  os.kill(trainer, signal.SIGKILL)
  return trainer, header


def test_a_killed_run_resumes_bit_exactly(data, expected, tmp_path):
  metrics, ckpt = tmp_path / "killed.jsonl", tmp_path / "ckpt-killed"
  p = _launch(data, ckpt, metrics)
  trainer, out = _killed_once(p, ckpt, metrics, timeout=60)
  assert p.returncode != 0, out  # the launcher reports its trainer's death
  assert not alive(trainer)
  killed_at = max(_steps(metrics))
  assert KILL_AFTER <= killed_at < STEPS, out  # killed mid-way, not after the end
  assert _losses(metrics) == {
      s: expected[s] for s in range(1, killed_at + 1)}

  # the resumed run: the same command, the same metrics file appended to
  out = _run(data, ckpt, metrics)
  found = re.search(r"restored step (\d+)", out)
  assert found, out
  restored = int(found.group(1))
  assert restored % SAVE_EVERY == 0 and 0 < restored <= killed_at, out
  assert _steps(metrics)[-(STEPS - restored):] == list(range(restored + 1, STEPS + 1))
  assert _losses(metrics) == expected  # bit-exact: float32 losses, printed in full


def test_a_trainer_killed_under_max_restarts_resumes_bit_exactly(
    data, expected, tmp_path):
  """Issue 53: the launcher restarts the killed trainer beside the same sidecar; it
  restores the last committed step, and the losses of every
  step, the re-done ones included, are the uninterrupted run's. The sidecar's ledger
  counts the restart, and its categories add up to its wall time."""
  metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
  p = _launch(data, ckpt, metrics, restarts=1)
  trainer, out = _killed_once(p, ckpt, metrics, timeout=120)
  assert p.returncode == 0, out
  assert not alive(trainer)
  assert "restart 1: host 0's trainer was killed by SIGKILL" in out, out
  restored = int(re.search(r"pid \d+ restored step (\d+)", out).group(1))
  assert restored % SAVE_EVERY == 0 and restored >= SAVE_EVERY, out
  lines = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert all(line["loss"] == expected[line["step"]] for line in lines)  # re-done ones too
  assert _losses(metrics) == expected
  ledger = subprocess.run([sys.executable, "-m", "sidecar", "goodput", str(ckpt), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert ledger.returncode == 0, ledger.stderr
  account = json.loads(ledger.stdout)
  assert account["restarts"] == 1, account
  total = account["productive_s"] + sum(account["badput_s"].values())
  assert abs(total - account["wall_s"]) <= 0.01 * account["wall_s"], account
  assert account["badput_s"]["restore"] > 0 and 0 < account["goodput"] < 1, account
