"""Tier 1: the PyTorch checkpoint path (``torch/storage.py``'s StorageWriter and StorageReader
under stock ``dcp.save``/``dcp.load``) against the in-process fake of the sidecars: one
process, no sockets, no arena."""

import os
import signal
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart, Item
from sidecar._src.controller.checkpoint import staging
from sidecar._src.core import interrupts
from sidecar._src.torch import storage
from tests.support.fake_sidecars import FakeSidecars
from tests.support.torch_sidecars import FakeController, Recording

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

PATH = "/ckpt/run/5"


def state() -> dict:
  return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                    "b": torch.full((2,), 1.5, dtype=torch.bfloat16)},
          "step": 7}


def zeros() -> dict:
  return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
          "step": 0}


def test_a_dcp_save_stages_the_rank_items_commits_once_and_restores_from_the_ram_tier():
  fake = Recording(hosts=(0,))
  ctl = FakeController(fake)
  dcp.save(state(), storage_writer=storage.StorageWriter(PATH, controller=ctl))
  (first, *_) = [s for s in fake.sent if s[0] == "stage"]
  part = first[-1]
  assert part == DcpPart(0, 3)  # its items are its records, each staged once
  staged = fake.records[(0, PATH)].values()
  assert sorted(Item.of_record(r).fqn for r in staged) == ["model.b", "model.w", "step"]
  (commit,) = [s for s in fake.sent if s[0] == "commit"]
  assert isinstance(commit[-1], DcpCommit) and set(commit[-1].file_sizes) == {0}
  # The RAM tiers are told the manifest the committing sidecar built, not a second one
  # the trainer built (Manifest.of_save there: its replicas differed, {"0": []}).
  assert fake.told == [(0, PATH, fake.manifests[PATH].to_json())]
  target = zeros()
  reader = storage.StorageReader(PATH, controller=ctl)
  dcp.load(target, storage_reader=reader)
  want = state()
  assert torch.equal(target["model"]["w"], want["model"]["w"])
  assert torch.equal(target["model"]["b"], want["model"]["b"])
  assert target["step"] == 7
  assert reader.last_stats["items"] == 3 and reader.last_stats["from_storage"] == 0


def test_replication_starts_once_staged_before_the_commit_as_ctl_checkpointers():
  """DCP's coordinator started the replication after the commit, JAX's before it."""
  fake = Recording(hosts=(0, 1))
  writer = storage.StorageWriter(PATH, replicas=1, controller=FakeController(fake))
  dcp.save(state(), storage_writer=writer)
  phases = [s[0] for s in fake.sent]
  assert phases.index("replicate") < phases.index("commit")
  assert fake.replicated_to == [(0, [1])]
  assert writer.replicated is not None and writer.replicated.result(30)


def test_async_save_copies_once_into_the_arena_through_the_one_stager(monkeypatch):
  """The async stage and write_data both copy through staging.copy_in; an array the
  stage put in the arena is staged as is, never copied twice."""
  copies = []
  copy = staging.shm.copy
  monkeypatch.setattr(staging.shm, "copy",
                      lambda dst, src, **kw: (copies.append(src.nbytes), copy(dst, src, **kw)))
  fake = Mapped(hosts=(0,))
  ctl = FakeController(fake, worker=fake)
  future = dcp.async_save(state(), storage_writer=storage.StorageWriter(PATH, controller=ctl))
  (future if hasattr(future, "result") else future.upload_completion).result(30)
  # The two tensors once each (the bytes of "step" once too): write_data staged the
  # stage's arena copies as they were.
  assert copies.count(48) == 1 and copies.count(4) == 1 and len(copies) == 3
  target = zeros()
  dcp.load(target, storage_reader=storage.StorageReader(PATH, controller=ctl))
  assert torch.equal(target["model"]["w"], state()["model"]["w"])


class Mapped(Recording):
  """A fake whose blocks this process "maps": it names each by its id (a worker's ref_of)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.blocks: dict[int, np.ndarray] = {}

  def empty_like(self, host, arrays):
    out = []
    for a in arrays:
      block = np.empty(a.shape, a.dtype)
      self.blocks[id(block)] = block
      out.append((block, id(block)))
    return out

  def ref_of(self, array):
    """The block ``array`` lies in (by address, as a Worker finds its arena's), or None."""
    start = array.__array_interface__["data"][0]
    return next((ref for ref, b in self.blocks.items()
                 if b.__array_interface__["data"][0] <= start < b.__array_interface__["data"][0]
                 + max(b.nbytes, 1)), None)


def test_a_stage_interrupted_by_ctrl_c_raises_it_between_two_copies(monkeypatch):
  fake = FakeSidecars(hosts=(0,))
  allocate = staging.allocate

  def interrupted(*args):
    allocate(*args)
    os.kill(os.getpid(), signal.SIGINT)  # noted, raised at the copy loop's next check
  monkeypatch.setattr(storage, "allocate", interrupted)
  writer = storage.StorageWriter(PATH, controller=FakeController(fake))
  threads = set(threading.enumerate())
  with pytest.raises(KeyboardInterrupt), interrupts.deferred():
    writer.stage(state())
  assert set(threading.enumerate()) <= threads  # no stager left copying


def test_a_dcp_save_writes_dcp_unless_told_and_refuses_a_format_it_cannot_write():
  from sidecar._src.controller.checkpoint.options import CheckpointOptions
  from sidecar._src.core import errors
  fake = Recording(hosts=(0,))
  ctl = FakeController(fake)
  dcp.save(state(), storage_writer=storage.StorageWriter(PATH, controller=ctl))
  assert fake.manifests[PATH].format == "dcp"
  with pytest.raises(errors.InvalidArgumentError, match=r"'orbax' is not one a PyTorch save"):
    storage.StorageWriter("/ckpt/run/6", controller=ctl, options=CheckpointOptions(format="orbax"))
