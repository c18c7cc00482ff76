"""DCP through the sidecars, 2 ranks under ``sidecar launch --torch``: ``dcp.save`` and
``dcp.async_save`` with ``sidecar.torch.StorageWriter`` write DCP's own layout that stock
``dcp.load`` + ``FileSystemReader`` restores bit-exact with no sidecar; ``StorageReader``
restores from the RAM tier with the ``.distcp`` files corrupted, and a new job from storage."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed.checkpoint as dcp

from tests.support.paths import ROOT
from tests.support.torch_ckpt import same, state, zeros_like

pytestmark = [pytest.mark.processes, pytest.mark.timeout(400),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def launch(directory, mode):
  p = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--torch", "--hosts", "2", "--shm-size",
       "32MiB", "--", sys.executable, "-m", "tests.support.torch_ckpt", str(directory), mode],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stdout + p.stderr
  return [json.loads(line.split("] ", 1)[1]) for line in p.stdout.splitlines() if "] {" in line]


def test_dcp_saves_through_the_sidecars_restore_from_ram_stock_dcp_and_storage(tmp_path):
  records = launch(tmp_path, "save")
  restored = [r for r in records if r.get("restored") == 2]
  assert len(restored) == 2 and all(r["same"] for r in restored), records
  assert all(r["stats"]["items"] > 0 for r in restored)
  # DCP's own layout, committed: the rank files, the metadata, our manifest.
  assert sorted(os.listdir(tmp_path / "1")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                "sidecar_manifest.json"]
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # no tmp directory left
  # Stock DCP, no sidecar, no process group: every rank's part, bit-exact.
  for rank in (0, 1):
    target = zeros_like(state(rank, 2, 1))
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "1")), no_dist=True)
    assert same(target, state(rank, 2, 1))
  # A new job, new sidecars (empty RAM tiers): from storage, through the sidecars.
  records = launch(tmp_path, "restore")
  assert [r["same"] for r in records if r.get("restored") == 1] == [True, True], records
