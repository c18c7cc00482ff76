"""``sidecar launch --standby``: each restart runs in a process started ahead, its imports
done, with the new start's environment, as a fresh process would have run.

The trainer is tests/support/standby_trainer.py: it reports what its process saw, then
process 1 fails on the first two starts (exit 3, then SIGKILL).
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.support.paths import ROOT
from tests.support.trainers import results

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
TRAINER = ["tests.support.standby_trainer"]
PRELOAD = "tests.support.standby_preload"


def _launch(*args: str, timeout: float = 240) -> tuple[int, str, str]:
  p = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--shm-size", "16MiB", *args],
                     cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  return p.returncode, p.stdout, p.stderr


def _standby_processes(marker: str) -> list[str]:
  """Command lines of live standby processes whose command names ``marker``."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode()
    except OSError:
      continue
    if "sidecar._src.tools.standby" in cmd and marker in cmd:
      out.append(cmd)
  return out


def test_restarts_run_in_standby_processes_started_ahead_with_the_new_environment(tmp_path):
  code, out, err = _launch("--hosts", "2", "--max-restarts", "3", "--standby", "--preload",
                           PRELOAD, "--", sys.executable, "-m", *TRAINER, str(tmp_path))
  assert code == 0, out + err
  got = sorted(results(out), key=lambda r: (r["restart"], r["process"]))
  assert [(r["restart"], r["process"]) for r in got] == [(s, p) for s in range(3)
                                                         for p in range(2)], out
  first, later = got[:2], got[2:]
  for r in first:  # the first start is a fresh process: no standby ran it
    assert r["started"] is None and r["preloaded_at"] is None, r
    assert r["ledger_start"] == pytest.approx(r["kernel_start"], abs=0.05), r
  for r in later:
    started = float(r["started"])
    # Started before it was told to run, its preload imported before that too; the
    # goodput ledger counts its life from the go.
    assert r["kernel_start"] < r["preloaded_at"] <= started <= r["now"], r
    assert r["ledger_start"] == started, r
    # What the imports exported (as JAX's TPU setup does) outlives the new environment.
    assert r["exported_at_import"] == "yes", r
  for r in got:  # what `python -m MODULE ARGS` would have seen
    assert r["argv"][1:] == [str(tmp_path)] and r["argv"][0].endswith("standby_trainer.py"), r
    assert r["path0"] == str(ROOT) and r["stdin"] == "", r
  assert len({r["pid"] for r in got}) == 6, got
  assert "could not take over" not in err, err
  # The standby made for a fourth start, never needed, is gone with the launch.
  assert _standby_processes(str(tmp_path)) == []


def test_a_script_path_runs_as_python_runs_it_env_s_assignments_kept(tmp_path):
  script = ROOT / "tests" / "support" / "standby_trainer.py"
  code, out, err = _launch("--hosts", "2", "--max-restarts", "2", "--standby", "--",
                           "env", "TEST_SET_BY_ENV=1", sys.executable, str(script),
                           str(tmp_path))
  assert code == 0, out + err
  got = results(out)
  assert len(got) == 6, out + err
  for r in got:
    assert r["argv"] == [str(script), str(tmp_path)], r
    assert r["path0"] == str(script.parent), r  # the script's directory, not the cwd
    assert r["set_by_env"] == "1", r
  assert sum(r["started"] is not None for r in got) == 4, got


def test_a_standby_gone_before_its_turn_is_replaced_by_a_fresh_process(tmp_path):
  code, out, err = _launch("--hosts", "2", "--max-restarts", "3", "--standby", "--",
                           sys.executable, "-m", *TRAINER, str(tmp_path), "--kill-standbys")
  assert code == 0, out + err
  assert err.count("standby process could not take over") == 2, err  # both ranks'
  got = sorted(results(out), key=lambda r: (r["restart"], r["process"]))
  assert [r["restart"] for r in got] == [0, 0, 1, 1, 2, 2], out
  assert all(r["started"] is None for r in got if r["restart"] == 1), got  # fresh ones
  assert all(r["started"] is not None for r in got if r["restart"] == 2), got


def test_the_restarts_running_out_still_end_the_job_with_the_failure(tmp_path):
  code, out, err = _launch("--hosts", "2", "--max-restarts", "1", "--standby", "--",
                           sys.executable, "-m", *TRAINER, str(tmp_path))
  assert code == 128 + 9, out + err  # the second start's SIGKILL, as without --standby
  assert "after 1 restarts (--max-restarts 1)" in err, err
  assert _standby_processes(str(tmp_path)) == []


@pytest.mark.parametrize("args, message", [
    (["--standby", "--max-restarts", "1", "--", "bash", "-c", "true"],
     "the command must be `python SCRIPT ...`"),
    (["--preload", "json", "--", sys.executable, "-c", "pass"], "--preload applies only with"),
])
def test_bad_standby_flags_are_refused_before_anything_starts(args, message):
  code, out, err = _launch("--hosts", "1", *args, timeout=60)
  assert code != 0 and message in err, out + err


CHANGING_TRAINER = """\
import os, pathlib, sys, time
import standby_fix
restart = os.environ["SIDECAR_RESTART"]
print(f"life {restart} runs VERSION {standby_fix.VERSION}", flush=True)
if restart == "0":
  while not pathlib.Path(sys.argv[1], "go").exists():
    time.sleep(0.05)
  sys.exit(3)
"""


@pytest.mark.parametrize("fix", ["edit", "shadow"])
def test_a_preloaded_module_changed_between_lives_runs_its_new_code_in_a_fresh_process(
    tmp_path, fix):
  """The operator fixes the module in place, or (issue 70, item 8) by a new file of its
  name beside the script, earlier on a fresh process's path than the one imported."""
  (tmp_path / "mods").mkdir()
  module = tmp_path / "mods" / "standby_fix.py"
  module.write_text("VERSION = 1\n")
  (tmp_path / "train.py").write_text(CHANGING_TRAINER)
  p = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "16MiB",
       "--max-restarts", "1", "--standby", "--preload", "standby_fix", "--", sys.executable,
       str(tmp_path / "train.py"), str(tmp_path)],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(tmp_path / "mods")),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert p.stdout.readline() == "[host 0] life 0 runs VERSION 1\n"
    err = ""
    while "unix://" not in err:
      err += p.stderr.readline()
    # The standby for life 1 has imported the module (its report says so); then an
    # operator fixes the module, and life 0 fails.
    cluster = os.path.dirname(err.split("unix://")[-1].split()[0])
    report = os.path.join(cluster, "standby", "rank0-start1.json")
    deadline = time.monotonic() + 120
    while not os.path.exists(report):
      assert time.monotonic() < deadline and p.poll() is None, err
      time.sleep(0.05)
    assert str(module) in json.loads(pathlib.Path(report).read_text())["files"]
    (module if fix == "edit" else tmp_path / "standby_fix.py").write_text("VERSION = 2\n")
    (tmp_path / "go").touch()
    out, rest = p.communicate(timeout=120)
  finally:
    p.kill()
    p.wait()
  assert p.returncode == 0, out + err + rest
  assert out == "[host 0] life 1 runs VERSION 2\n", out
  said = (f"rank 0's standby process imported {module}, changed since" if fix == "edit" else
          f"rank 0's standby process imported module 'standby_fix' from {module}, but a new "
          f"process would import {tmp_path / 'standby_fix.py'}")
  assert said + "; starting a new one, which runs the new code" in rest, rest
