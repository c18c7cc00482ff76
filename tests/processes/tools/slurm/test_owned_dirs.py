"""``sidecar slurm`` removes only directories of its own (issue 35 item 3), on a real
single-node Slurm: a ``SIDECAR_SLURM_DIR`` that holds the user's files is refused and
kept, an empty one of the user's is used and left (empty), a service may not be named
``slurm`` (where the batch jobs' directories live), and neither ``service`` nor ``stop``
removes a directory in ``$SIDECAR_HOME`` that no service made."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def run_job(slurm, tmp_path, env, command, timeout=180) -> tuple[str, int, str]:
  """Submits a 1-node batch job of ``command``; its id, exit code and output at its end."""
  out = tmp_path / "job.out"
  text = subprocess.run(
      [sys.executable, "-m", "sidecar", "slurm", "batch", "--shm-size", "64MiB",
       "--checkpoint-root", str(tmp_path), f"--sbatch-arg=--output={out}", "--", *command],
      cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60).stdout
  job = slurm.run(["sbatch", "--parsable"], input=text, env=env, cwd=ROOT).stdout.strip()
  deadline = time.monotonic() + timeout
  while job in slurm.jobs():
    assert time.monotonic() < deadline, f"job {job} still runs after {timeout} s"
    time.sleep(0.5)
  shown = slurm.run(["scontrol", "show", "job", job]).stdout
  return job, int(re.search(r"ExitCode=(\d+):", shown).group(1)), out.read_text()


def job_env(slurm, tmp_path, rdv) -> dict[str, str]:
  return {**slurm.env, "SIDECAR_HOME": str(tmp_path / "home"), "SIDECAR_SLURM_DIR": str(rdv),
          "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def test_a_job_refuses_a_slurm_dir_holding_files_of_the_users_and_keeps_them(slurm,
                                                                             tmp_path):
  rdv = tmp_path / "rdv"
  (rdv / "data").mkdir(parents=True)
  (rdv / "notes.txt").write_text("mine\n")
  (rdv / "data" / "x.bin").write_bytes(b"\0" * 10)
  job, code, output = run_job(slurm, tmp_path, job_env(slurm, tmp_path, rdv), ["true"])
  assert rdv.is_dir() and sorted(os.listdir(rdv)) == ["data", "notes.txt"], output
  assert (rdv / "notes.txt").read_text() == "mine\n" and (rdv / "data" / "x.bin").exists()
  assert code == 2, output
  assert f"{rdv} (SIDECAR_SLURM_DIR) is not empty (data, notes.txt) and was not made by " \
         "sidecar slurm" in output, output
  assert "serves" not in output  # no sidecar started


def test_a_job_uses_an_empty_slurm_dir_of_the_users_and_leaves_it_empty(slurm, tmp_path):
  rdv = tmp_path / "rdv"
  rdv.mkdir(mode=0o750)
  check = f'test "$SIDECAR_TOKEN_FILE" = {rdv}/token && test -f {rdv}/token'
  job, code, output = run_job(slurm, tmp_path, job_env(slurm, tmp_path, rdv),
                              ["sh", "-c", check])
  assert code == 0, output
  assert "sidecar host 0 (node" in output and "the trainers exited 0" in output, output
  assert rdv.is_dir() and os.listdir(rdv) == []  # the user's directory, as it was
  assert oct(rdv.stat().st_mode & 0o777) == "0o750"
  assert not (tmp_path / "home" / "slurm" / job).exists()


def cli(slurm, env, *args):
  return subprocess.run([sys.executable, "-m", "sidecar", "slurm", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def test_no_service_is_named_slurm_over_the_batch_jobs_directories(slurm, tmp_path):
  home = tmp_path / "home"
  env = {**slurm.env, "SIDECAR_HOME": str(home)}
  # A running batch job's rendezvous directory, where a service 'slurm' would live.
  batch = home / "slurm" / "4242"
  batch.mkdir(parents=True)
  (batch / "token").write_text("secret\n")
  done = cli(slurm, env, "service", "--name", "slurm")
  assert (batch / "token").read_text() == "secret\n"
  assert done.returncode == 2, done.stdout + done.stderr
  assert "--name 'slurm' is taken" in done.stderr
  assert slurm.jobs() == []  # nothing was submitted


def test_neither_service_nor_stop_removes_a_directory_no_service_made(slurm, tmp_path):
  home = tmp_path / "home"
  env = {**slurm.env, "SIDECAR_HOME": str(home)}
  mine = home / "lab"
  mine.mkdir(parents=True)
  (mine / "results.csv").write_text("1,2\n")
  (mine / "state.json").write_text('{"service_job": "999999"}')
  done = cli(slurm, env, "stop", "lab")  # a state.json of the user's own names no job
  assert sorted(os.listdir(mine)) == ["results.csv", "state.json"], done.stdout
  assert done.returncode == 1, done.stdout + done.stderr
  assert f"{mine} was not made by sidecar slurm service: left as it is" in done.stderr
  done = cli(slurm, env, "service", "--name", "lab")
  assert sorted(os.listdir(mine)) == ["results.csv", "state.json"], done.stdout
  assert done.returncode == 2, done.stdout + done.stderr
  assert f"{mine} (--name lab) is not empty (results.csv, state.json)" in done.stderr
  assert slurm.jobs() == []  # nothing was submitted
