"""Tier 2: a pool's jobs over time (issue 37, item 4): a tenant's RAM-tier steps stay while
its job is there and for its ``ram_keep`` after it left, then go back to the arena; its
durable steps stay and restore bit-exact; another tenant's RAM-tier steps are untouched."""

import time

import numpy as np
import pytest

from sidecar._src.arena.worker import Worker
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.server

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice], ram_keep: 1s}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""


def _ram_steps(server) -> dict[str, list[int]]:
  return {c.directory.rsplit("/", 2)[-2]: list(c.ram_steps)
          for c in server.checkpoints.tier.status() if c.ram_steps}


def test_a_departed_tenants_ram_steps_go_after_ram_keep(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, POOL))
  want = np.arange(1 << 16, dtype=np.float32)
  for token, name in ((ALICE, "alice"), (BOB, "bob")):
    with controller(server, token) as ctl, ctl.checkpointer(str(tmp_path / name / "ck")) as ck:
      assert ck.save(1, {"w": want}).durable.result(30) == 1
  assert _ram_steps(server) == {"alice": [1], "bob": [1]}
  worker = Worker(server.options.socket_path, token=ALICE)  # alice's job is back meanwhile
  try:
    time.sleep(2.5)  # past her ram_keep: she is there, her steps stay
    assert _ram_steps(server) == {"alice": [1], "bob": [1]}
  finally:
    worker.close()
  deadline = time.monotonic() + 10
  while "alice" in _ram_steps(server):  # gone about ram_keep (1 s) after she left
    assert time.monotonic() < deadline, _ram_steps(server)
    time.sleep(0.05)
  assert _ram_steps(server) == {"bob": [1]}  # bob has no ram_keep: his stay
  with controller(server, ALICE) as ctl, ctl.checkpointer(str(tmp_path / "alice" / "ck")) as ck:
    assert ck.all_steps() == [1]
    got = ck.restore(1, target={"w": np.zeros_like(want)})
    np.testing.assert_array_equal(got["w"], want)  # from its durable copy
