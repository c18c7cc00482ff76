"""examples/vision end to end: `sidecar launch` trains the tiny ViT on JPEGs its sidecar
decodes, its loss goes down, and a trainer killed mid-way resumes beside the same sidecar
bit-exactly, its re-done steps served the batches the sidecar kept."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import alive, eventually

# Two launches, each importing JAX and compiling, beside the sidecar's feed workers.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(400)]

ROOT = pathlib.Path(__file__).resolve().parents[3]
STEPS, SAVE_EVERY, KILL_AFTER = 30, 10, 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp("images")
  subprocess.run([sys.executable, "examples/vision/prepare.py", "--out", str(out), "--images",
                  "128", "--classes", "4", "--size", "48", "--jobs", "1"],
                 cwd=ROOT, check=True, capture_output=True, timeout=120)
  return out


def _launch(data, work, name, *extra: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--import",
       "pipelines.vision", "--shm-size", "64MiB", "--max-restarts", "1", "--",
       sys.executable, "examples/vision/train.py", "--config", "tiny", "--data", str(data),
       "--ckpt", str(work / f"{name}-ckpt"), "--steps", str(STEPS), "--save-every",
       str(SAVE_EVERY), "--metrics", str(work / f"{name}.jsonl"), "--workers", "1",
       "--progress-every", "0", *extra],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "PYTHONPATH": str(ROOT)})


def _lines(path) -> list[dict]:
  if not os.path.exists(path):
    return []
  return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines() if x.endswith("}")]


@pytest.fixture(scope="module")
def whole(data, tmp_path_factory) -> dict[int, float]:
  """The losses of an uninterrupted run."""
  work = tmp_path_factory.mktemp("whole")
  p = _launch(data, work, "whole")
  out, _ = p.communicate(timeout=300)
  assert p.returncode == 0, out
  assert f"trained to step {STEPS}; checkpoints [10, 20, 30]" in out
  lines = _lines(work / "whole.jsonl")
  assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
  assert all(set(x) == {"step", "loss", "time", "wait"} for x in lines)
  return {x["step"]: x["loss"] for x in lines}


def test_it_learns(whole):
  first = sum(whole[s] for s in range(1, 6)) / 5
  last = sum(whole[s] for s in range(STEPS - 4, STEPS + 1)) / 5
  assert last < first - 0.3, (first, last)  # 4 classes: ln 4 = 1.39 at best by chance


def test_a_killed_trainer_resumes_bit_exactly_on_the_batches_its_sidecar_kept(
    data, whole, tmp_path):
  p = _launch(data, tmp_path, "killed")
  out = ""
  while "initialised" not in out:
    line = p.stdout.readline()
    assert line, out
    out += line
  trainer = int(re.search(r"pid (\d+) initialised", out).group(1))
  assert eventually(lambda: any(x["step"] >= KILL_AFTER for x in _lines(tmp_path / "killed.jsonl"))
                    and (tmp_path / "killed-ckpt" / str(SAVE_EVERY)).is_dir(), timeout=120), out
  os.kill(trainer, signal.SIGKILL)
  rest, _ = p.communicate(timeout=300)
  out += rest
  assert p.returncode == 0, out  # restarted once beside the same sidecar, and done
  assert not alive(trainer)
  assert re.search(r"pid \d+ restored step (10|20) \(ram tier", out), out
  lines = _lines(tmp_path / "killed.jsonl")
  losses = {x["step"]: x["loss"] for x in lines}  # the last line of each step
  assert losses == whole  # every step, the re-done ones included: bit for bit
  assert len(lines) > STEPS  # some steps computed twice: those after the save restored
  # The restarted trainer's feed opened where its save was, and its sidecar served it the
  # batches it had kept since, instead of decoding them again.
  restored = int(re.search(r"restored step (\d+)", out).group(1))
  logs = pathlib.Path(re.search(r"logs go to (\S+)/host<i>\.log", out).group(1))
  served = re.findall(r"feed 'vision' opens at \((\d+), (\d+)\) with (\d+) kept batches",
                      (logs / "host0.log").read_text())
  assert served, (logs / "host0.log").read_text()[-3000:]
  epoch, position, count = map(int, served[-1])
  assert (epoch, position) == divmod(restored * 8, 128) and count >= 1  # 128 images, 8 a step
