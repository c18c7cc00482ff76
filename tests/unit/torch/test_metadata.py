"""Tier 1: DCP's Metadata pickled by the trainer, and carried as plain values and rebuilt."""

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from sidecar._src.core import errors
from sidecar._src.torch import metadata as torch_metadata

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def stock_metadata(tmp_path):
  """What stock DCP writes for a state dict of every kind: nested, bf16, scalar, bytes."""
  state = {"model": {"w": torch.randn(4, 3), "h": torch.ones(5, dtype=torch.bfloat16)},
           "step": torch.tensor(7), "extra": {"epoch": 3, "name": "run"}}
  dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
  return dcp.FileSystemReader(str(tmp_path)).read_metadata()


def test_the_plan_is_json_and_rebuilds_the_same_metadata(tmp_path):
  stock = stock_metadata(tmp_path)
  plan = json.loads(json.dumps(torch_metadata.to_plan(stock)))
  rebuilt = torch_metadata.from_plan(plan)
  assert rebuilt.state_dict_metadata == stock.state_dict_metadata
  assert rebuilt.storage_data == stock.storage_data
  assert {k: v for k, v in rebuilt.storage_data.items()} == stock.storage_data
  assert rebuilt.planner_data == stock.planner_data
  assert rebuilt.version == stock.version
  assert rebuilt.storage_meta.save_id == stock.storage_meta.save_id
  assert isinstance(rebuilt.state_dict_metadata["extra.epoch"], dcp_metadata.BytesStorageMetadata)
  assert rebuilt.state_dict_metadata["model.h"].properties.dtype == torch.bfloat16


def test_the_rebuilt_metadata_loads_the_stock_checkpoint(tmp_path):
  # DCP's own reader restores through metadata rebuilt from the plan: nothing unpickled.
  stock = stock_metadata(tmp_path)
  reader = dcp.FileSystemReader(str(tmp_path))
  plan = torch_metadata.to_plan(reader.read_metadata())
  reader.read_metadata = lambda *a, **k: torch_metadata.from_plan(plan)
  target = {"model": {"w": torch.zeros(4, 3), "h": torch.zeros(5, dtype=torch.bfloat16)},
            "step": torch.tensor(0), "extra": {"epoch": 0, "name": ""}}
  dcp.load(target, storage_reader=reader, no_dist=True)
  assert target["extra"] == {"epoch": 3, "name": "run"} and target["step"].item() == 7
  assert torch.equal(target["model"]["h"], torch.ones(5, dtype=torch.bfloat16))
  assert stock.storage_data  # the test saw real storage entries


def test_finish_pickles_what_filesystem_writer_would(tmp_path):
  stock = stock_metadata(tmp_path)
  results = [[torch_metadata.WriteResult(index=i, size_in_bytes=s.length, storage_data=s)
              for i, s in stock.storage_data.items()]]
  blank = dcp_metadata.Metadata(state_dict_metadata=stock.state_dict_metadata,
                      planner_data=stock.planner_data)
  raw = torch_metadata.finish(blank, results, checkpoint_id="/ckpt/1", save_id="abc")
  again = pickle.loads(raw)
  assert again.storage_data == stock.storage_data and again.version == "1.0.0"
  assert again.storage_meta.checkpoint_id == "/ckpt/1" and again.storage_meta.save_id == "abc"
  assert torch_metadata.file_sizes(results) == {
      "__0_0.distcp": max(s.offset + s.length for s in stock.storage_data.values())}


def test_a_plan_of_another_version_is_refused():
  with pytest.raises(errors.InvalidArgumentError, match="plan version 9, expected 1"):
    torch_metadata.from_plan({"version": 9})
