"""Tier 2: a pool tenant's calls through its arena (issue 79 item 4), against an in-process
pool sidecar: calls in a row whose room is the last call's, given back, never wait; a call
that must wait for arena room says so while it waits, and how long it may."""

import logging

import numpy as np
import pytest

import sidecar
from tests.support.pool_files import BOB, write_pool

pytestmark = pytest.mark.server

# 16 MiB of arena: bob may hold his 40% and the 20% no one is guaranteed, 9.6 MiB; a call
# of a 4 MiB array holds 8 MiB while it runs (the array and its result).
POOL = """\
tenants:
  - {name: alice, token_file: alice.token, arena: 0.4}
  - {name: bob, token_file: bob.token, arena: 0.4}
"""
MIB4 = np.ones(1 << 20, np.float32)


@pytest.fixture
def bob(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, POOL), shm_size=16 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=BOB) as ctl:
    yield ctl


def test_calls_in_a_row_never_wait_for_the_room_the_last_one_gave_back(bob):
  """The docs/pool.md walk-through: three calls went through, then one sat its whole
  timeout. The last call's argument and result were given back by the Worker's release
  thread, which waited for the lock the next call's argument held through its wait in
  the admission queue: the room it waited for was its own process's, never sent back."""
  for _ in range(4):
    (out,) = bob.call("add", args=(MIB4, 1.0), hosts=[0], timeout=10)
    assert out.nbytes == MIB4.nbytes
    del out


def test_a_call_that_waits_for_arena_room_says_so_and_how_long_it_may(bob, caplog):
  caplog.set_level(logging.WARNING)
  kept = bob.call("add", args=(MIB4, 1.0), hosts=[0])  # 4 MiB held: the next needs 12
  with pytest.raises(sidecar.ResourceExhaustedError,
                     match=r"tenant 'bob' holds 8.0 MiB of the arena; 4.0 MiB more would take "
                           r"from the guaranteed arena of other tenants"):
    bob.call("add", args=(MIB4, 1.0), hosts=[0], timeout=3)
  said = [r.getMessage() for r in caplog.records if "arena queue" in r.getMessage()]
  assert any("call 'add' on host 0: tenant 'bob' waits in the sidecar's arena queue" in m
             and "it gives up in" in m and "(its timeout, 3 s)" in m for m in said), said
  del kept
  bob.call("add", args=(MIB4, 1.0), hosts=[0], timeout=10)  # the room is back
