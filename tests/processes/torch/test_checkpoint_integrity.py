"""The PyTorch checkpoint path's data integrity (issue 35, items 1, 2, 4 and 5), each with
real sidecar processes under ``sidecar launch --torch`` and real files
(``tests/processes/torch/ckpt_faults.py`` is the trainer):

1. a restore never mixes two saves of one DCP path: a replica of the older save on a
   surviving sidecar is not served for the newer (its crc32c is checked against the
   committed manifest, and a copy that fails the check is skipped for storage);
2. a save whose write fails (``SIDECAR_CKPT_FAULT=enospc@2``: ENOSPC once its first bytes
   are on disk) fails at once, leaves no partial files, the next save raises it (once, as
   ``ctl.checkpointer``'s: the core's), and the save after is durable;
4. a sidecar killed in the middle of an overwrite (``swap@1``) leaves a complete
   checkpoint at the path, which a new job restores and saves over;
5. empty numbered directories are not steps, and a save's failure is raised once (the
   ``Checkpointer`` keeps its steps with the core's ``Retention`` and returns the core's
   ``SaveHandle``, its ``replicated`` future set).

And (issue 36 item 1) ``Checkpointer(if_busy="skip")`` skips a save while the previous is
in flight, every rank alike, as ``ctl.checkpointer`` does; it takes the same
``CheckpointOptions``, and its ``replicated`` future resolves apart from ``durable``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed.checkpoint as dcp

from tests.support.paths import ROOT, entries
from tests.support.torch_ckpt import same, state, zeros_like

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def launch(directory, mode, *, hosts=1, flags=(), fault=None, timeout=150):
  env = {k: v for k, v in os.environ.items() if k != "SIDECAR_CKPT_FAULT"}
  if fault:
    env["SIDECAR_CKPT_FAULT"] = fault
  p = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--torch", *flags, "--hosts", str(hosts),
       "--procs-per-host", "1", "--shm-size", "32MiB", "--", sys.executable, "-m",
       "tests.processes.torch.ckpt_faults", str(directory), mode],
      cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
  records = [json.loads(line.split("] ", 1)[1]) for line in p.stdout.splitlines()
             if "] {" in line]
  return p, records


def test_a_restore_never_serves_a_replica_of_an_older_save_of_the_path(tmp_path):
  p, records = launch(tmp_path, "mix", hosts=2, flags=("--elastic",))
  assert p.returncode == 0, p.stdout + p.stderr
  first = [r for r in records if "first" in r]
  assert [r["first"] for r in first] == [True, True], records
  assert sum(r["stats"]["from_replicas"] for r in first) > 0, records  # host 0's replica read
  (restored,) = [r for r in records if r.get("restored") == 1]
  assert restored["restart"] == 1, records
  assert restored.get("rank1") == [21.0] * 3, restored  # save 2's, not rank 1's of save 1
  assert restored["same"] is True, records
  # Rank 1's part was on the lost host alone: from storage, the stale replica skipped.
  assert restored["stats"]["from_storage"] > 0, records


def test_a_save_whose_write_fails_fails_at_once_and_the_next_save_is_durable(tmp_path):
  p, records = launch(tmp_path, "enospc", fault="enospc@2")
  assert p.returncode == 0, p.stdout + p.stderr
  (failed,) = [r for r in records if "save2" in r]
  assert failed["save2"] == "CheckpointException CheckpointWriteError ENOSPC", records
  assert failed["seconds"] < 10, records  # before: no outcome (its wait was 3,600 s)
  assert failed["listing"] == ["1"], records  # no partial file of step 2 left
  # The failure is said at once; the next save goes on and commits (issue 79 item 2).
  assert "the save of step 2 into" in p.stdout + p.stderr, p.stdout + p.stderr
  assert "after the failed save of step 2 (" in p.stdout + p.stderr, p.stdout + p.stderr
  (next_save,) = [r for r in records if "save3" in r]
  assert next_save["save3"] is True and next_save["same"] is True, records
  assert next_save["steps"] == [1, 3], records
  assert entries(tmp_path) == ["1", "3"]


def test_a_sidecar_killed_mid_overwrite_leaves_a_whole_checkpoint_at_the_path(tmp_path):
  p, records = launch(tmp_path, "swap", fault="swap@1")
  # The commit's sidecar died: DCP raises its CheckpointException on the trainer.
  assert [r.get("error") for r in records] == [None, "CheckpointException"], p.stdout + p.stderr
  # The path holds one complete checkpoint, the old or the new, read by stock DCP alone.
  assert os.path.isdir(tmp_path / "1"), entries(tmp_path)
  got = []
  for step in (1, 2):
    target = zeros_like(state(0, 1, step))
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "1")), no_dist=True)
    got.append(same(target, state(0, 1, step)))
  assert got.count(True) == 1, got
  # A new job lists it and restores it; its Checkpointer refuses to save step 1 again, a
  # StorageWriter saves over the path (as DCP's FileSystemWriter).
  p, records = launch(tmp_path, "restore")
  assert p.returncode == 0, p.stdout + p.stderr
  (r,) = records
  assert r["steps"] == [1] and list(r["got"].values()) == got and r["resaved"], records
  assert entries(tmp_path) == ["1"]


def test_empty_numbered_directories_are_not_steps_and_a_failure_is_raised_once(tmp_path):
  p, records = launch(tmp_path, "listing")
  assert p.returncode == 0, p.stdout + p.stderr
  assert records[0]["latest"] is None, records
  (r,) = [r for r in records if "saves" in r]
  assert r["saves"] == {"1": "durable", "2": "durable"}, records  # and `replicated` set
  assert r["restored"] is True and r["steps"] == [2], records
  assert r["listing"] == ["0", "2", "999"], records  # not steps: never deleted


def test_a_save_while_the_previous_is_in_flight_is_skipped_by_every_rank(tmp_path):
  # issue 36 item 1: the torch Checkpointer's busy/skip, as ctl.checkpointer's
  p, records = launch(tmp_path, "skip", hosts=2, fault="slow@2")
  assert p.returncode == 0, p.stdout + p.stderr
  assert [r["refused"] for r in records if "refused" in r] == [
      "if_busy must be 'wait' or 'skip', got 'later'"] * 2, records
  done = [r for r in records if "skipped" in r]
  assert [(r["skipped"], r["busy"], r["steps"]) for r in done] == [
      ([None] * 3, True, [1, 2, 4])] * 2, records
  assert entries(tmp_path) == ["1", "2", "4", "r"]
  # One CheckpointOptions for both frameworks; `replicated` apart from `durable`, every rank.
  assert [r["both"] for r in records if "both" in r] == [
      "give either options=CheckpointOptions(...) or ram_steps, replicas, not both"] * 2
  assert [(r["durable"], r["replicated"]) for r in records if "durable" in r] == [(5, 5)] * 2
  assert entries(tmp_path / "r") == ["5"]


def test_a_committed_step_is_never_replaced_by_a_save_as_under_jax(tmp_path):
  # issue 55 item 2: a relaunch that forgot to resume replaced step 5 (ones became twos)
  # and then step 3; ctl.checkpointer refused both. One rule whatever the framework.
  p, records = launch(tmp_path, "relaunch", hosts=2)
  assert p.returncode == 0, p.stdout + p.stderr
  done = [r for r in records if "refused" in r]
  assert len(done) == 2, records
  for r in done:  # every rank refuses, with the error ctl.checkpointer raises
    for step, latest in (("5", 5), ("3", 5)):
      assert r["refused"][step] is not None, records
      assert r["refused"][step].startswith(
          f"InvalidArgumentError: step {step} is already saved in {tmp_path} "
          "(committed steps: [3, 5]); a save never replaces a committed step: to resume, "
          f"restore the latest (latest_step() is {latest})"), records
    assert (r["lower"], r["steps"], r["restored5"]) == (4, [3, 4, 5], True), records
  # The steps on disk are the first saves', read by stock DCP alone.
  for step in (3, 5):
    for rank in (0, 1):
      target = zeros_like(state(rank, 2, step))
      dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / str(step))),
               no_dist=True)
      assert same(target, state(rank, 2, step)), (step, rank)
  assert entries(tmp_path) == ["3", "4", "5"]
