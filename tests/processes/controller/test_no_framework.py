"""The controller core with no JAX: a call, a stream and a save through a fake adapter.

The sidecar is an in-process server of this test; the trainer is a subprocess in which
``jax`` (and every other framework) cannot be imported. It drives the core
``controller.Controller`` through a fake framework adapter whose "arrays" are split
by rows over two devices of the sidecar's host, so a save stages two shards and a
restore fills two blocks: what a PyTorch adapter does, with no PyTorch either.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

_TRAINER = r'''
import json, sys
for name in ("jax", "jaxlib", "orbax", "tensorstore", "grain", "torch"):
  sys.modules[name] = None  # importing any of them raises ImportError

import numpy as np

from sidecar._src.controller.controller import Controller
from sidecar._src.controller import framework as fw
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec


class RowArray:
  """The fake framework's array: rows split evenly over devices 0 and 1."""

  def __init__(self, parts):
    self.parts = [np.asarray(p) for p in parts]
    self.shape = (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])
    self.dtype = self.parts[0].dtype


class Fake(fw.Framework):
  name = "fake"

  def to_device(self, tree, device):
    return {"on": device, "value": tree}

  def save_leaves(self, tree):
    out = []
    for leaf, key in enumerate(sorted(tree)):
      value = tree[key]
      if not isinstance(value, RowArray):
        data = np.asarray(value)
        record = ShardRecord.of(ShardId((key,), fw.whole(data.shape)), leaf, data)
        out.append(fw.SaveLeaf(LeafSpec.from_value((key,), value),
                               (fw.LocalShard(record, data, None),)))
        continue
      rows = value.parts[0].shape[0]
      spec = LeafSpec(key_path=(key,), shape=value.shape, dtype=value.dtype,
                      kind=LeafKind.NUMPY, write_shape=(rows, *value.shape[1:]))
      shards = []
      for d, part in enumerate(value.parts):  # the record made here, its host left to the core
        index = ((d * rows, (d + 1) * rows), *fw.whole(value.shape[1:]))
        record = ShardRecord.of(ShardId((key,), index), leaf, part)
        shards.append(fw.LocalShard(record, part, d))
      out.append(fw.SaveLeaf(spec, tuple(shards)))
    return out

  def restore_target(self, target):
    keys = sorted(target)
    leaves = []
    for key in keys:
      shape, dtype = target[key]
      half = shape[0] // 2
      leaves.append(fw.RestoreLeaf((key,), shape, np.dtype(dtype), tuple(
          (((d * half, (d + 1) * half), *fw.whole(shape[1:])), d) for d in (0, 1))))
    return fw.RestoreTarget(tuple(leaves), lambda blocks: {
        k: RowArray([np.array(b) for b in bs]) for k, bs in zip(keys, blocks)})


address, directory = sys.argv[1], sys.argv[2]
out = {}
with Controller([address], framework=Fake()) as ctl:
  big = np.arange(1 << 16, dtype=np.float32)
  out["mapped"] = ctl.worker(0) is not None
  out["call"] = float(ctl.call("echo", args=(big,))[0].sum()) == float(big.sum())
  with ctl.stream("count", args=(3,), device="fake:0") as s:
    out["stream"] = [(item["on"], item["value"]) for item in s]
  ckpt = ctl.checkpointer(directory)
  w = RowArray([np.arange(12.0).reshape(2, 6), np.arange(12.0, 24.0).reshape(2, 6)])
  handle = ckpt.save(1, {"w": w, "n": np.int32(7)})
  out["durable"] = handle.durable.result(60)
  ckpt.close()
  ckpt = ctl.checkpointer(directory)  # lists the committed step anew
  out["steps"] = ckpt.all_steps()
  back = ckpt.restore(1, target={"w": ((4, 6), "float64")})
  out["restored"] = np.concatenate(back["w"].parts).tolist() == list(
      np.arange(24.0).reshape(4, 6).tolist())
  out["sources"] = sorted(ckpt.last_restore_stats().shards)
  ckpt.close()
out["frameworks"] = sorted(m for m in sys.modules if m.split(".")[0] in (
    "jax", "jaxlib", "orbax", "tensorstore", "grain", "torch") and sys.modules[m] is not None)
print(json.dumps(out))
'''


def test_a_call_a_stream_and_a_save_need_no_framework(make_server, tmp_path):
  server = make_server(device_ids=(0, 1), shm_size=16 << 20)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  run = subprocess.run(
      [sys.executable, "-c", _TRAINER, f"127.0.0.1:{server.port}", str(tmp_path / "ckpt")],
      env=env, capture_output=True, text=True, timeout=180)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.splitlines()[-1])
  assert out == {
      "mapped": True, "call": True,
      "stream": [["fake:0", 0], ["fake:0", 1], ["fake:0", 2]],
      "durable": 1, "steps": [1], "restored": True, "sources": ["ram:host0"],
      "frameworks": []}
