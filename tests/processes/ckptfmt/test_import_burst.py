"""Isolation, round 8, attack 2 (issue 76): a burst of saves on a fresh sidecar.

~240 Stages that begin steps in Orbax's layout, from 4 threads of one client, reach a
sidecar that has not imported Orbax yet. Before: each step's writer thread imported
``orbax.checkpoint`` on its own, at once; Python's imports are not safe to race, the import
ended half done ("partially initialized module ... circular import"), and every later save
of every tenant failed with ``UNKNOWN: builtins.KeyError: 'orbax.checkpoint'`` until a
restart (8 of 9 fresh sidecars). Now everything a format needs is imported once, under one
lock (``ckptfmt/orbax/libs.py``): a pool's sidecar does so at its start, before it serves;
a one-job sidecar, as here, at its first save, the burst's other writers waiting for that
one import.

A real ``sidecar serve`` (LocalCluster), whose registered code imports no framework, so
nothing has imported Orbax in it before the burst.
"""

import concurrent.futures

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.save_values import Begin, Prepared, Stage
from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec
from tests.support.staged import staged

pytestmark = pytest.mark.processes

LEAN = ["tests.support.lean_fns"]
THREADS, EACH = 4, 60
W = np.arange(8, dtype=np.float32)
LEAF = LeafSpec(key_path=("w",), shape=W.shape, dtype=W.dtype, kind=LeafKind.NUMPY)


@pytest.mark.timeout(240)
def test_a_burst_of_stages_on_a_fresh_sidecar_leaves_every_later_save_working(tmp_path):
  burst, later = tmp_path / "burst", tmp_path / "later"
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="32MiB",
                                    imports=LEAN, checkpoint_roots=[str(tmp_path)]) as cluster:
    with cluster.controller(attach=False) as ctl:
      # Fresh: nothing imported Orbax before the burst (its registered code imports no
      # framework, and a one-job sidecar imports it at its first save).
      assert not {"orbax", "tensorstore"} & set(ctl.call("frameworks_loaded")[0])
      client = ctl.checkpoint_client()
      client.open(0, str(burst), ram_steps=0, ram_budget=None, sweep=True).result(30)

      def stage(step: int) -> str:
        tmp = f"{burst}/{step}.orbax-checkpoint-tmp"
        try:
          client.send(0, Stage(
              directory=str(burst), step=step, tmp_dir=f"{tmp}/default",
              final_dir=f"{burst}/{step}/default", leaves=[LEAF],
              shards=[staged(("w",), 0, ((0, 8),), W)], last=True,
              begin=Begin(str(burst), step, "orbax"))).result(30)
        except sidecar.SidecarError as e:
          return f"{type(e).__name__}: {e}"
        return ""

      def written(step: int) -> str:
        try:
          client.send(0, Prepared(f"{burst}/{step}/default", 60), timeout=60).result(90)
        except sidecar.SidecarError as e:
          return f"{type(e).__name__}: {e}"
        return ""

      with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        failed = [f for f in pool.map(stage, range(1, THREADS * EACH + 1)) if f]
        # The first steps' writers raced each other's imports: each was written.
        failed += [f for f in pool.map(written, range(1, 2 * THREADS + 1)) if f]
      assert not failed, (len(failed), failed[:3])
      # And a save after the burst, as any tenant's: it found Orbax whole.
      with ctl.checkpointer(str(later)) as ck:
        assert ck.save(1, {"w": W}).durable.result(60) == 1
        np.testing.assert_array_equal(ck.restore(1, target={"w": np.zeros_like(W)})["w"], W)
