"""``sidecar launch --elastic``: 3 trainer processes x 1 CPU device, one host's sidecar
SIGKILLed mid-training, the job restarted on the other 2 beside the same sidecars.

The trainer is tests/support/train_elastic.py; each process prints ``RESULT {json}``.
"""

import os
import re
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from sidecar._src.ckptfmt.orbax import read as orbax_read
from tests.conftest import alive, eventually
from tests.support.paths import ROOT
from tests.support.train_elastic import GLOBAL_BATCH, STEPS
from tests.support.trainers import results

KILL_AT = 5  # process 1 kills its sidecar before batch 5: step 3 is the last committed
pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def _start(directory, *flags: str, kill_at: int | None = None,
           replicas: int = 0) -> subprocess.Popen:
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "3", *flags,
             "--import", "tests.support.feed_fns", "--shm-size", "32MiB", "--",
             sys.executable, "-m", "tests.support.train_elastic", str(directory)]
  if kill_at is not None:
    command.append(str(kill_at))
  return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "SIDECAR_TEST_REPLICAS": str(replicas)})


def _finish(p: subprocess.Popen) -> tuple[int, list[dict], str, str]:
  out, err = p.communicate(timeout=240)
  return p.returncode, results(out), out, err


def _of(results: list[dict], kind: str, **where) -> list[dict]:
  return [r for r in results if r["kind"] == kind
          and all(r[k] == v for k, v in where.items())]


def _assert_nothing_left(results: list[dict], err: str) -> None:
  sidecars = [int(p) for p in re.findall(r"host \d+'s sidecar \(pid (\d+)\)", err)]
  trainers = [r["pid"] for r in _of(results, "start")]
  assert len(sidecars) == 3 and trainers, err
  assert eventually(lambda: not any(alive(p) for p in sidecars + trainers))
  temp_dir = os.path.dirname(re.search(r"unix://(\S+)", err).group(1))
  assert not os.path.exists(temp_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run's results (started at once: it runs beside the first test)."""
  proc = _start(tmp_path_factory.mktemp("reference"))
  done: list = []

  def results() -> list[dict]:
    if not done:
      code, ref, ref_out, ref_err = _finish(proc)
      assert code == 0, ref_out + ref_err
      _assert_nothing_left(ref, ref_err)
      done.append(ref)
    return done[0]

  yield results
  if proc.poll() is None:
    proc.kill()
    proc.communicate()


def _assert_same_run_after(got: list[dict], ref: list[dict], *, restart: int) -> None:
  """From its data position the global batches continue as in the uninterrupted run (none
  repeated, none skipped), and end in its state, bit for bit (integer-valued data)."""
  ref_batches = {r["i"]: r["ids"] for r in _of(ref, "batch", process=0)}
  processes = sorted({r["process"] for r in _of(got, "batch", restart=restart)})
  for p in processes:
    after = [(r["i"], r["ids"]) for r in _of(got, "batch", restart=restart, process=p)]
    assert [i for i, _ in after] == list(range(KILL_AT - 1, STEPS))
    assert all(ids == ref_batches[i] for i, ids in after)
  ref_final = _of(ref, "final", process=0)[0]
  finals = _of(got, "final")
  assert [r["restart"] for r in finals] == [restart] * len(processes)
  assert all(r["w"] == ref_final["w"] for r in finals)


def test_a_lost_host_restarts_the_job_on_the_others_from_the_last_step(tmp_path, reference):
  elastic = _start(tmp_path / "elastic", "--elastic", kill_at=KILL_AT, replicas=1)
  ref = reference()
  code, got, out, err = _finish(elastic)
  assert code == 0, out + err

  assert len(re.findall(r"restart \d+:", err)) == 1, err
  assert re.search(r"restart 1: host 1 lost \(its sidecar was killed by SIGKILL\); 2 "
                   r"processes on hosts \[0, 2\], started [\d.]+ s after the loss", err), err
  # The first start: 3 processes; the restart: hosts 0 and 2 as processes 0 and 1.
  first, second = _of(got, "start", restart=0), _of(got, "start", restart=1)
  assert sorted((r["host"], r["process"], r["processes"]) for r in first) == [
      (0, 0, 3), (1, 1, 3), (2, 2, 3)]
  assert sorted((r["host"], r["process"], r["processes"]) for r in second) == [
      (0, 0, 2), (2, 1, 2)]
  # The surviving sidecars are the same processes: their arenas and RAM tiers survived.
  before = first[0]["sidecar_pids"]
  for r in second:
    assert r["sidecar_pids"] == {h: before[h] for h in ("0", "2")}

  # The restarted job restored the last step committed before the loss, bit-exact.
  committed_before = {r["step"]: r["w"] for r in _of(got, "committed", restart=0)}
  assert max(committed_before) == KILL_AT - 2, committed_before
  ref_committed = {r["step"]: r["w"] for r in _of(ref, "committed", process=0)}
  restored = _of(got, "restored", restart=1)
  assert len(restored) == 2 and not _of(got, "restored", restart=0)
  for r in restored:
    assert r["step"] == KILL_AT - 2 and r["steps"] == [1, 3]
    assert r["w"] == committed_before[KILL_AT - 2] == ref_committed[KILL_AT - 2]
    assert r["data_state"]["position"] == (KILL_AT - 1) * GLOBAL_BATCH
    # From the survivors' memory only: host 1's shards from the replica on host 2.
    assert "storage" not in r["sources"] and "replica:host2" in r["sources"], r["sources"]

  _assert_same_run_after(got, ref, restart=1)
  finals = _of(got, "final")
  assert len(finals) == 2

  # No step is listed that was not committed; the job after the loss saved steps too.
  committed = {r["step"] for r in _of(got, "committed")}
  assert orbax_read.list_steps(str(tmp_path / "elastic")) == [1, 3, 5, 7]
  assert set(finals[0]["steps"]) <= committed and set(finals[0]["steps"]) == {1, 3, 5, 7}
  # Stock Orbax restores a step that hosts 0 and 2 saved as a job of 2.
  with ocp.CheckpointManager(tmp_path / "elastic") as mngr:
    stock = mngr.restore(7, args=ocp.args.StandardRestore(
        {"w": np.zeros((GLOBAL_BATCH, 4), np.float32), "step": 0}))
  assert np.asarray(stock["w"]).tolist() == _of(got, "committed", step=7, process=0)[0]["w"]
  _assert_nothing_left(got, err)


def test_in_place_a_lost_sidecar_starts_again_empty_and_the_job_keeps_its_size(
    tmp_path, reference):
  """--elastic --in-place, as Kubernetes restarts containers: host 1's sidecar is killed,
  a new one starts empty at the same address, and all 3 trainers restart; host 1's
  shards come back from the replica on host 2, the others' from their own RAM tiers."""
  code, got, out, err = _finish(_start(tmp_path, "--elastic", "--in-place", kill_at=KILL_AT,
                                       replicas=1))
  assert code == 0, out + err
  assert re.search(r"restart 1: host 1's sidecar was killed by SIGKILL; 3 processes on hosts "
                   r"\[0, 1, 2\] in place, started [\d.]+ s after the loss", err), err
  first, second = _of(got, "start", restart=0), _of(got, "start", restart=1)
  assert sorted((r["host"], r["process"], r["processes"]) for r in second) == [
      (0, 0, 3), (1, 1, 3), (2, 2, 3)]
  before, after = first[0]["sidecar_pids"], second[0]["sidecar_pids"]
  assert after["0"] == before["0"] and after["2"] == before["2"]
  assert after["1"] != before["1"]  # a new sidecar, with an empty arena
  restored = {r["host"]: r for r in _of(got, "restored", restart=1)}
  assert sorted(restored) == [0, 1, 2]
  for r in restored.values():
    assert r["step"] == KILL_AT - 2 and r["data_state"]["position"] == (KILL_AT - 1) * GLOBAL_BATCH
    assert "storage" not in r["sources"], r["sources"]
  assert "replica:host2" in restored[1]["sources"], restored[1]["sources"]
  assert set(restored[0]["sources"]) == {"ram:host0"}, restored[0]["sources"]
  _assert_same_run_after(got, reference(), restart=1)
  assert orbax_read.list_steps(str(tmp_path)) == [1, 3, 5, 7]
  pids = [int(p) for p in re.findall(r"sidecar \(pid (\d+)\)", err)]
  assert len(pids) == 4 and eventually(lambda: not any(alive(p) for p in pids)), err


def test_a_loss_below_min_hosts_ends_the_job(tmp_path):
  code, got, out, err = _finish(_start(tmp_path, "--elastic", "--min-hosts", "3",
                                       kill_at=KILL_AT))
  assert code == 128 + 9, out + err  # the failure's code: the sidecar's SIGKILL
  assert re.search(r"host 1's sidecar was killed by SIGKILL \(2 hosts would remain, fewer "
                   r"than --min-hosts 3\); stopping every process", err), err
  assert "restart 1:" not in err and not _of(got, "start", restart=1)
  assert orbax_read.list_steps(str(tmp_path)) == [1, 3]
  _assert_nothing_left(got, err)


@pytest.mark.parametrize("flags, match", [
    (["--min-hosts", "2"], "--min-hosts applies only with --elastic"),
    (["--elastic", "--min-hosts", "4"], r"--min-hosts must be in 1..--hosts \(3\), got 4"),
    (["--elastic", "--min-hosts", "0"], r"--min-hosts must be in 1..--hosts \(3\), got 0"),
    (["--in-place"], "--in-place applies only with --elastic"),
    (["--elastic", "--max-restarts", "2"], "--max-restarts applies without --elastic, or with "
     "--elastic --in-place"),
], ids=["without-elastic", "above-hosts", "zero", "in-place-without-elastic",
        "max-restarts-without-in-place"])
def test_bad_min_hosts_is_refused_before_anything_starts(flags, match):
  done = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "3", *flags,
                         "--", "true"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and re.search(match, done.stderr), done.stderr
  assert "sidecar (pid" not in done.stderr


def test_in_place_restarts_stop_after_max_restarts():
  # A trainer that always fails: restarted in place once, then its failure ends the job.
  done = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "2", "--elastic",
                         "--in-place", "--max-restarts", "1", "--", sys.executable, "-c",
                         "import sys; sys.exit(3)"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 3, done.stderr
  assert len(re.findall(r"restart \d+:", done.stderr)) == 1, done.stderr
  assert "after 1 restarts (--max-restarts 1); stopping every process" in done.stderr
