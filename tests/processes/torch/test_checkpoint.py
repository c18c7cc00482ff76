"""DCP through the sidecars, 2 ranks under ``sidecar launch --torch``: ``dcp.save`` and
``dcp.async_save`` with ``sidecar.torch.StorageWriter`` write DCP's own layout that stock
``dcp.load`` + ``FileSystemReader`` restores bit-exact with no sidecar; ``StorageReader``
restores from the RAM tier with the ``.distcp`` files corrupted; a new job of another world
size (4 ranks, two per sidecar) restores from storage, the DTensor resharded, refuses a
state dict with a key the checkpoint lacks, and saves with ranks sharing a sidecar; a rank
killed mid-save leaves no step listed, and the job before it loads; ranks restarted in place
(``--elastic --in-place``) restore from the RAM tiers with the files gone; a job shrunk by a
lost sidecar restores that sidecar's part from a peer's replica (``replicas=1``)."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed.checkpoint as dcp

from tests.support.paths import ROOT, entries
from tests.support.torch_ckpt import same, state, zeros_like

pytestmark = [pytest.mark.processes, pytest.mark.timeout(400),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def launch(directory, mode, *, hosts, procs, code=0, flags=()):
  p = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--torch", *flags, "--hosts", str(hosts),
       "--procs-per-host", str(procs), "--shm-size", "32MiB", "--", sys.executable, "-m",
       "tests.support.torch_ckpt", str(directory), mode],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == code, p.stdout + p.stderr
  if "--in-place" in flags:
    assert "restart 1: host 1's trainer exited with code 3" in p.stderr, p.stderr
  elif flags:
    assert "restart 1: host 1 lost (its sidecar was killed by SIGKILL)" in p.stderr, p.stderr
  return [json.loads(line.split("] ", 1)[1]) for line in p.stdout.splitlines() if "] {" in line]


def stock_load(directory, rank, world, step):
  """Rank ``rank``'s part of ``directory``, read by stock DCP alone: no sidecar, no group."""
  target = zeros_like(state(rank, world, step))  # the sharded entry whole
  dcp.load(target, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
  return same(target, state(rank, world, step))


def test_dcp_saves_through_the_sidecars_restore_from_ram_stock_dcp_and_storage(tmp_path):
  records = launch(tmp_path, "save", hosts=2, procs=1)
  restored = [r for r in records if r.get("restored") == 2]
  assert len(restored) == 2 and all(r["same"] for r in restored), records
  assert all(r["stats"]["items"] > 0 for r in restored)
  # DCP's own layout, committed: the rank files, the metadata, our manifest.
  assert sorted(os.listdir(tmp_path / "1")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                "sidecar_manifest.json"]
  assert entries(tmp_path) == ["1", "2"]  # no tmp directory left
  for rank in (0, 1):  # every rank's part, bit-exact, the DTensor's rows whole
    assert stock_load(tmp_path / "1", rank, 2, 1)
  # Rank 1 killed mid-save (its part staged, no commit): the job ends with its code.
  records = launch(tmp_path, "die", hosts=2, procs=1, code=9)
  assert not any("saved" in r for r in records), records
  assert "4" not in os.listdir(tmp_path)
  # A new job of 4 ranks, two beside each of 2 new sidecars (empty RAM tiers).
  records = launch(tmp_path, "restore", hosts=2, procs=2)
  assert [r["steps"] for r in records if "steps" in r] == [[1, 2]] * 4, records  # not 4
  assert not any(n.endswith("-tmp") for n in os.listdir(tmp_path))  # swept
  mismatch = [r["mismatch"] for r in records if "mismatch" in r]
  assert len(mismatch) == 4, records
  assert all("Missing key in checkpoint state_dict: model.missing" in m for m in mismatch)
  # From storage, through the sidecars, the DTensor resharded from 2 ranks' rows to 4's.
  assert [r["same"] for r in records if r.get("restored") == 1] == [True] * 4, records
  # Saved by 2 ranks per sidecar, restored from the RAM tier with the files corrupt.
  restored = [r for r in records if r.get("restored") == 3]
  assert [r["same"] for r in restored] == [True] * 4, records
  assert sorted(os.listdir(tmp_path / "3")) == [
      ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
      "sidecar_manifest.json"]
  for rank in range(4):
    assert stock_load(tmp_path / "3.copy", rank, 4, 3)


def test_ranks_restarted_in_place_restore_from_the_ram_tiers_with_the_files_gone(tmp_path):
  records = launch(tmp_path, "elastic", hosts=2, procs=1, flags=("--elastic", "--in-place"))
  restored = [r for r in records if r.get("restored") == 1]
  assert [(r["restart"], r["same"]) for r in restored] == [(1, True), (1, True)], records
  assert all(r["stats"]["items"] > 0 for r in restored)
  assert not (tmp_path / "1").exists()  # no storage read: there was nothing to read


def test_a_job_shrunk_by_a_lost_sidecar_restores_its_part_from_a_peers_replica(tmp_path):
  records = launch(tmp_path, "shrink", hosts=2, procs=1, flags=("--elastic",))
  assert [r["replicated"] for r in records if "replicated" in r][0] > 0, records
  (restored,) = [r for r in records if r.get("restored") == 1]
  assert (restored["restart"], restored["world"], restored["same"]) == (1, 1, True), records
  # Rank 1's items from host 0's replica of host 1's part; none from storage (it is gone).
  assert restored["stats"]["from_replicas"] > 0 and restored["stats"]["from_storage"] == 0
  assert not (tmp_path / "1").exists()
