"""Tier 2: isolation, round 8, attack 9 (issue 76): steps begun from one session.

bob's one session sends Stages that each begin a step (``begin_format``) with no shard and
more parts to come. Before: each step's writer thread started at once and waited 60 s for
its next part: ~190 threads in 5 s (here 40 for 40 Stages), counted by nothing. Now a step
holds no thread until a part gives it something to write, and a tenant holds at most
``BEGUN_STEPS`` steps begun and not staged whole: the next is RESOURCE_EXHAUSTED naming
the bound and the tenant, and alice's saves go on.
"""

import threading

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.save_values import Begin, Prepared, Stage
from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec
from tests.support.pool_files import ALICE, BOB, controller, write_pool
from tests.support.staged import staged

pytestmark = pytest.mark.server

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""
W = np.arange(4, dtype=np.float32)
BEGUN_STEPS = 16  # write.BEGUN_STEPS
LEAF = LeafSpec(key_path=("w",), shape=W.shape, dtype=W.dtype, kind=LeafKind.NUMPY)


def _writers() -> list[str]:
  """The step writer threads of this process (``sidecar-ckpt-<step>``)."""
  return [t.name for t in threading.enumerate()
          if t.name.startswith("sidecar-ckpt-") and t.name[13:].isdigit()]


def _stage(client, run, step: int, *, shards=(), last=False):
  tmp = f"{run}/{step}.orbax-checkpoint-tmp"
  return client.send(0, Stage(
      directory=str(run), step=step, tmp_dir=f"{tmp}/default", final_dir=f"{run}/{step}/default",
      leaves=[LEAF], shards=list(shards), last=last,
      begin=Begin(str(run), step, "orbax") if not shards else None)).result(10)


def test_steps_begun_with_nothing_staged_hold_no_thread_and_are_bounded(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, POOL))
  bob_run, alice_run = tmp_path / "bob" / "run", tmp_path / "alice" / "run"
  before = len(_writers())
  with controller(server, BOB) as bob:
    client = bob.checkpoint_client()
    client.open(0, str(bob_run), ram_steps=1, ram_budget=None, sweep=True).result(10)
    begun, refused = [], []
    for step in range(1, 41):
      try:
        _stage(client, bob_run, step)
        begun.append(step)
      except sidecar.ResourceExhaustedError as e:
        refused.append(str(e))
    assert len(_writers()) - before == 0  # begun, nothing to write: no thread each
    assert begun == list(range(1, BEGUN_STEPS + 1)), (begun, refused[:1])
    assert len(refused) == 40 - BEGUN_STEPS
    assert ("tenant 'bob' holds 16 steps begun and not staged whole on host 0, the most one "
            "may (BEGUN_STEPS = 16)") in refused[0], refused[0]
    # alice is not held up by bob's steps.
    with controller(server, ALICE) as alice, alice.checkpointer(str(alice_run)) as ck:
      assert ck.save(1, {"w": W}).durable.result(30) == 1
    # A step of his given its part is written; and then he may begin another.
    _stage(client, bob_run, 1, shards=[staged(("w",), 0, ((0, 4),), W)], last=True)
    assert client.send(0, Prepared(f"{bob_run}/1/default", 30), timeout=30).result(40)
    _stage(client, bob_run, 41)
