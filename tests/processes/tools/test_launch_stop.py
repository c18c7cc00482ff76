"""``sidecar launch`` stopped right after a save: the step the sidecar accepted is written and
committed before the launcher stops it, however the job ends, within ``--save-grace``.

The trainer is tests/support/save_trainer.py (one host: the sidecar commits the step itself
once written). The sidecar's write of step 1 is held by fault injection (``slow@1:FILE``:
until FILE exists), so the stop lands while the step is being written; the launch is stopped
only once the sidecar has taken the commit over (its log says so), the moment a trainer's
``save()`` has long returned.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from sidecar._src.core import env as env_lib
from tests.support.paths import ROOT, entries

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]
TAKEN_OVER = "step 1: taken over here"


def _start(tmp_path: pathlib.Path) -> subprocess.Popen:
  env = dict(os.environ, **{env_lib.CKPT_FAULT: f"slow@1:{tmp_path / 'written'}"})
  return subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "16MiB",
       "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-m",
       "tests.support.save_trainer", str(tmp_path / "ckpt")],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _log(tmp_path: pathlib.Path) -> str:
  logs = list((tmp_path / "logs").glob("*/host0.log"))
  return logs[0].read_text(errors="replace") if logs else ""


def _until_taken_over(p: subprocess.Popen, tmp_path: pathlib.Path) -> str:
  """Reads the trainer's output until it saved; waits until the sidecar took the step's
  commit over. Returns the trainer's output."""
  out = p.stdout.readline()
  assert "saved" in out, out + p.communicate(timeout=30)[1]
  while TAKEN_OVER not in _log(tmp_path):
    assert p.poll() is None, p.communicate()
    time.sleep(0.05)
  return out


def _read_until(stream, text: str) -> str:
  got = ""
  while text not in got:
    line = stream.readline()
    assert line, f"the output ended before {text!r}:\n{got}"
    got += line
  return got


def _committed(ckpt: pathlib.Path) -> list[str]:
  return entries(ckpt)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_step_being_written_when_the_launcher_is_stopped_is_committed_before_it_exits(
    tmp_path, signum):
  p = _start(tmp_path)
  _until_taken_over(p, tmp_path)
  p.send_signal(signum)
  err = _read_until(p.stderr, "waiting up to")
  assert "waiting up to 60 s for step 1 on host 0 to be written" in err, err
  (tmp_path / "written").touch()
  _, rest = p.communicate(timeout=60)
  err += rest
  assert p.returncode == 128 + signum, err  # as without the wait
  assert "step 1 on host 0 written and committed" in err, err
  assert "abandoned" not in err, err
  assert _committed(tmp_path / "ckpt") == ["1"]  # renamed from 1.orbax-checkpoint-tmp
  assert (tmp_path / "ckpt" / "1" / "_CHECKPOINT_METADATA").exists()


def test_a_second_sigint_ends_the_wait_at_once_naming_the_step_it_abandons(tmp_path):
  p = _start(tmp_path)
  _until_taken_over(p, tmp_path)
  p.send_signal(signal.SIGINT)
  err = _read_until(p.stderr, "waiting up to")
  p.send_signal(signal.SIGINT)
  _, rest = p.communicate(timeout=60)
  err += rest
  assert p.returncode == 130, err
  assert "got SIGINT while waiting: abandoned step 1 on host 0 (not committed)" in err, err
  assert _committed(tmp_path / "ckpt") == ["1.orbax-checkpoint-tmp"]


def test_a_trainer_killed_after_its_step_was_taken_over_loses_nothing_without_restarts(
    tmp_path):
  p = _start(tmp_path)
  out = _until_taken_over(p, tmp_path)
  os.kill(int(out.split("pid=")[1]), signal.SIGKILL)
  err = _read_until(p.stderr, "waiting up to")
  assert "host 0's trainer was killed by SIGKILL" in err, err
  (tmp_path / "written").touch()
  _, rest = p.communicate(timeout=60)
  err += rest
  assert p.returncode == 128 + signal.SIGKILL, err
  assert "step 1 on host 0 written and committed" in err, err
  assert _committed(tmp_path / "ckpt") == ["1"]


def test_a_step_its_sidecar_commits_as_it_stops_is_said_committed_and_resumable(tmp_path):
  """Issue 69: ``--save-grace 0`` after Ctrl-C said "abandoned step 1 (not committed)" while
  the sidecar, stopping, committed it (a re-run restored it). The launcher now looks in the
  directory once the sidecars stopped, and says how to resume."""
  env = dict(os.environ, **{env_lib.CKPT_FAULT: f"slow@1:{tmp_path / 'written'}"})
  p = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "16MiB",
       "--save-grace", "0", "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-m",
       "tests.support.save_trainer", str(tmp_path / "ckpt")],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _until_taken_over(p, tmp_path)
  p.send_signal(signal.SIGINT)
  err = _read_until(p.stderr, "the sidecars stop now")
  # Its write ends while its sidecar stops, after its committer looked again (every 0.5 s):
  # it waits for the write that stopping lets finish (it abandoned the step, CI saw).
  time.sleep(1.5)
  (tmp_path / "written").touch()
  _, rest = p.communicate(timeout=60)
  err += rest
  assert p.returncode == 130, err
  assert "step 1 on host 0 committed as the sidecars stopped" in err, err
  assert "abandoned" not in err, err
  assert "re-run the same command to resume from step 1" in err, err
  assert _committed(tmp_path / "ckpt") == ["1"]


def test_a_job_whose_sidecar_was_killed_says_how_to_resume(tmp_path):
  """Issue 79 item 5: the launch ended with its sidecar SIGKILLed after step 1 was committed
  and said nothing of it (the steps a sidecar holds are asked as the job ends, and it was
  dead): the directories the sidecars held while the job ran are looked in too."""
  p = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "16MiB",
       "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-m",
       "tests.support.save_trainer", str(tmp_path / "ckpt")],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  err = _read_until(p.stderr, "'s sidecar (pid")
  sidecar_pid = int(err.split("'s sidecar (pid ")[1].split(")")[0])
  out = p.stdout.readline()
  assert "saved" in out, out + p.communicate(timeout=30)[1]
  # Committed, and seen by the launcher's watchdog (it reads each sidecar once a second).
  while not (tmp_path / "ckpt" / "1" / "_CHECKPOINT_METADATA").exists():
    assert p.poll() is None, p.communicate()
    time.sleep(0.05)
  time.sleep(2.5)
  os.kill(sidecar_pid, signal.SIGKILL)
  _, rest = p.communicate(timeout=60)
  err += rest
  assert p.returncode == 128 + signal.SIGKILL, err
  assert "host 0's sidecar was killed by SIGKILL" in err, err
  assert "re-run the same command to resume from step 1" in err, err
