"""A sidecar's DCP save and read with no JAX, Grain, Orbax, TensorStore nor torch importable
(issue 36, item 2: a PyTorch-only sidecar serves DCP checkpoints).

The save runs the sidecar's own calls (``server/checkpoint/save.StepWriter``: begin,
stage, prepared, commit) and its read from storage (``read.Reader``) on real files, in a
child process whose import system refuses those packages, as where they are not installed.
"""

import json
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

BLOCKED = ("jax", "jaxlib", "grain", "orbax", "tensorstore", "torch")

_CHILD = r'''
import importlib.abc, json, sys, tempfile, threading

BLOCKED = %r

class _NotInstalled(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None

sys.meta_path.insert(0, _NotInstalled())

import numpy as np

from sidecar._src.ckptfmt import records, save_values
from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart, Item, distcp
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import ram_tier, read, roots as roots_lib, save
from sidecar._src.server.checkpoint.caller import Caller
from sidecar._src.ckptfmt.save_values import Prepared

root = tempfile.mkdtemp(dir=sys.argv[1])
threads = []

def spawn(target, *args, name):
  threads.append(threading.Thread(target=target, args=args, name=name))
  threads[-1].start()

tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
writer = save.StepWriter(0, tier=tier, roots=roots_lib.Roots(0, (root,)), spawn=spawn,
                         metrics=metrics_lib.Recorder())
path = f"{root}/ck"
writer.open(root)
tmp = writer.begin(save_values.Begin(path, 3, "dcp"), Caller(owner="a"))
w = np.arange(12, dtype=np.float32).reshape(4, 3)
item = Item(fqn="w", kind="tensor", nbytes=w.nbytes, dtype="float32", sizes=w.shape,
            offsets=(0, 0))
writer.stage(save_values.Stage(root, 3, tmp, path, [], [records.Staged(item.record(0, 0, w), w)],
                          last=True, extra=DcpPart(0, 1)), Caller(owner="a"))
sums = writer.prepared(Prepared(path), Caller(wait_s=30))
(where,), size = distcp.layout(0, [item])
plan = {"storage": [{"fqn": "w", "offset": [0, 0], "path": where.relative_path,
                     "at": where.offset, "length": where.length}],
        "state": {"w": {"kind": "tensor", "dtype": "float32",
                        "chunks": [{"offsets": [0, 0], "sizes": [4, 3]}]}}}
committed = writer.commit(save_values.Commit(
    tmp_dir=tmp, step=3, num_hosts=1, shards=sums, data_state_json='{"epoch": 2}',
    extra=DcpCommit(b"\x80\x04N.", {0: size}, json.dumps(plan))), Caller(owner="a"))
manifest = read.info(committed)
got = read.Reader(tier, metrics_lib.Recorder()).read(committed, manifest.shards[0], tier="disk")
for t in threads:
  t.join(30)
print(json.dumps({
    "loaded": sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED),
    "committed": committed == path, "equal": bool((got == w).all()),
    "format": manifest.format, "plan": manifest.dcp_plan == plan,
    "data_state": manifest.data_state, "step": manifest.step}))
'''


def test_a_dcp_save_and_read_need_no_jax_orbax_tensorstore_nor_torch(tmp_path):
  run = subprocess.run([sys.executable, "-c", _CHILD % (BLOCKED,), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out == {"loaded": [], "committed": True, "equal": True, "format": "dcp", "plan": True,
                 "data_state": {"epoch": 2}, "step": 3}
