"""The multi-process tier: 2 trainer processes x 2 CPU devices under jax.distributed,
each beside its own sidecar, started by ``sidecar launch`` (real processes, real gRPC,
real shared memory, gloo collectives), against the same trainer as one process.

The trainer is tests/support/train.py; each process prints ``RESULT {json}`` lines.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from sidecar._src.ckptfmt.orbax import read as orbax_read
from tests.support.paths import ROOT
from tests.support.trainers import by_process, results, single, without

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def launch(directory, scenario: str, **env: str) -> tuple[int, list[dict], str]:
  """Runs the trainer as 2 processes through ``sidecar launch``."""
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "2", "--devices-per-host",
             "2", "--import", "tests.support.feed_fns", "--shm-size", "64MiB", "--",
             sys.executable, "-m", "tests.support.train", "multi", str(directory), scenario]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                        env={**os.environ, **env})
  output = done.stdout + done.stderr
  return done.returncode, results(done.stdout), output


def test_one_script_trains_alike_as_one_process_or_two(tmp_path):
  code, multi, output = launch(tmp_path / "multi", "train")
  assert code == 0, output
  one = single(tmp_path / "single", "train")
  p0, p1 = by_process(multi, 0), by_process(multi, 1)
  # Every process sees the same batches, feed states, saves and restores, and so does
  # one process driving both hosts: global batches depend only on pipeline, args, seed.
  assert without(p0, "identity") == without(p1, "identity")
  assert without(p0, "identity") == without(by_process(one, 0), "identity")
  kinds = [r["kind"] for r in p0]
  assert kinds.count("batch") == 6 and "orbax" in kinds
  restored = next(r for r in p0 if r["kind"] == "restored")
  assert restored["same"] and restored["step"] == 4 and restored["bias"] == [0, 1, 2, 3]
  assert next(r for r in p0 if r["kind"] == "saved")["steps"] == [2, 4]  # max_to_keep=2
  assert next(r for r in p0 if r["kind"] == "orbax") == {"kind": "orbax", "same": True,
                                                          "step": 4}
  # Identity comes from the processes: jax's global device ids, each host's own.
  ident = [r for r in p0 if r["kind"] == "identity"][0]
  assert ident["device_hosts"] == {"0": 0, "1": 0, "2048": 1, "2049": 1}
  assert ident["local_hosts"] == [0] and by_process(multi, 1)[0]["local_hosts"] == [1]
  assert ident["status"] == [[0, 0, [0, 1]], [1, 1, [2048, 2049]]]
  # ctl.call runs on the caller's own host: once per host in all.
  calls = ident["calls"] + by_process(multi, 1)[0]["calls"]
  assert len(calls) == 2 and len(set(calls)) == 2
  assert len(by_process(one, 0)[0]["calls"]) == 2
  assert sorted(orbax_read.list_steps(str(tmp_path / "multi"))) == [2, 4]
  # Stock Orbax in one process (this one) restores what the two processes saved.
  with ocp.CheckpointManager(tmp_path / "multi") as mngr:
    stock = mngr.restore(4, args=ocp.args.StandardRestore(
        {"w": np.zeros((8, 4), np.float32), "bias": np.zeros(4, np.float32), "step": 0}))
  saved = next(r for r in p0 if r["kind"] == "saved")["w"]
  assert np.asarray(stock["w"]).tolist() == saved and int(stock["step"]) == 4
  assert np.asarray(stock["bias"]).tolist() == [0, 1, 2, 3]


def test_a_plain_iterable_feed_has_one_state_in_every_process(tmp_path):
  code, multi, output = launch(tmp_path, "iter")
  assert code == 0, output
  p0, p1 = by_process(multi, 0), by_process(multi, 1)
  assert without(p0, "identity") == without(p1, "identity")
  states = [r["state"] for r in p0 if r["kind"] == "batch"]
  assert states[-1]["shards"] == [{"epoch": 0, "position": 12}] * 2
  assert without(p0, "identity") == without(by_process(single(tmp_path / "one", "iter"), 0),
                                            "identity")


@pytest.mark.parametrize("scenario, match", [
    ("disagree_step", "disagree on the step of save 1 in .*: process 0: step 10; process 1: "
                      "step 11"),
    ("disagree_feed", r"disagree on the arguments of feed 1 \('ids'\): process 0: seed=0; "
                      "process 1: seed=1"),
], ids=["save-step", "feed-seed"])
def test_processes_that_disagree_fail_in_every_process(tmp_path, scenario, match):
  code, multi, output = launch(tmp_path, scenario)
  assert code == 3, output
  errors_seen = [r for r in multi if r["kind"] == "error"]
  assert sorted(r["process"] for r in errors_seen) == [0, 1], output
  for r in errors_seen:
    assert r["type"] == "InvalidArgumentError" and re.search(match, r["message"]), r


@pytest.mark.parametrize("fault, steps", [("trainer@2", [1]), ("sidecar@3", [1, 2])],
                         ids=["trainer-killed-mid-save", "sidecar-killed-mid-feed"])
def test_a_killed_process_stops_the_job_and_the_last_step_restores(tmp_path, fault, steps):
  t0 = time.monotonic()
  code, multi, output = launch(tmp_path, "train", SIDECAR_TEST_FAULT=fault)
  assert code != 0, output
  assert time.monotonic() - t0 < 120, "the survivors were not stopped in bounded time"
  staged = {r["step"]: r["w"] for r in by_process(multi, 0) if r["kind"] == "staged"}
  committed = steps[-1]
  assert committed in staged, output
  # Nothing partial is listed: the step in flight never committed.
  assert orbax_read.list_steps(str(tmp_path)) == steps, output
  # A new job restores the last committed step bit-exact.
  code, again, output = launch(tmp_path, "restore")
  assert code == 0, output
  for p in (0, 1):
    restored = [r for r in by_process(again, p) if r["kind"] == "restored"][0]
    assert restored["step"] == committed and restored["steps"] == steps
    assert restored["w"] == staged[committed]
