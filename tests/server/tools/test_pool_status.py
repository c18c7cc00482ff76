"""Tier 2: ``sidecar pool status`` against a live pool (issue 37): a tenant's token shows its
own row; the table, --json and --watch agree with what the tenant holds."""

import io
import json

import numpy as np
import pytest

from sidecar._src.arena.worker import Worker
from sidecar._src.tools import pool_status
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.server


@pytest.fixture
def pool_server(make_server, tmp_path):
  return make_server(pool=write_pool(tmp_path))


def test_a_tenant_sees_its_own_sessions_workers_and_arena(pool_server):
  address = f"127.0.0.1:{pool_server.port}"
  alice_worker = Worker(pool_server.options.socket_path, token=ALICE)
  try:
    block = alice_worker.put(np.ones(1 << 20, np.uint8), timeout=10)
    with controller(pool_server, ALICE), controller(pool_server, BOB):
      out = io.StringIO()
      assert pool_status.print_status([address], timeout=5, token=ALICE, as_json=True,
                                      out=out) == 0
      (alice,) = json.loads(out.getvalue())["tenants"]  # bob's row is not alice's to see
      assert (alice["tenant"], alice["sessions"], alice["workers"]) == ("alice", 1, 1)
      assert alice["arena_bytes"] >= 1 << 20
      assert alice["arena_ceiling"] == 3 << 20  # POOL's arena_ceiling: 3MiB
      out = io.StringIO()
      assert pool_status.watch([address], interval=0.05, timeout=5, token=BOB, out=out,
                               refreshes=2) == 0
      screens = out.getvalue().split("sidecar pool status")[1:]
      assert len(screens) == 2
      assert all("\nbob " in s and "\nalice " not in s for s in screens)
    del block
  finally:
    alice_worker.close()


def test_an_unreachable_sidecar_is_named_and_the_exit_status_is_1(pool_server):
  out = io.StringIO()
  assert pool_status.print_status([f"127.0.0.1:{pool_server.port}", "127.0.0.1:1"],
                                  timeout=2, token=ALICE, out=out) == 1
  text = out.getvalue()
  assert text.splitlines()[1].startswith("alice ")
  assert "unreachable: 127.0.0.1:1: HostLostError" in text
