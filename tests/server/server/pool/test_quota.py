"""Tier 2: one client cannot starve another of the arena (issue 23, item 6): a worker
session holds at most its quota, and a stream that finds no room says so in time."""

import gc

import numpy as np
import pytest

import sidecar
from sidecar._src.server.arenas import arena_io, leases as leases_lib

pytestmark = pytest.mark.server


def fill(worker: sidecar.jax.Worker) -> list:
  """Allocates 512 KiB blocks until the sidecar refuses; returns them (held)."""
  held = []
  with pytest.raises(sidecar.ResourceExhaustedError) as info:
    for _ in range(100):
      held.append(worker.empty((512 << 10,), np.uint8)[0])
  return held, str(info.value)


def test_a_worker_session_holds_at_most_its_quota(make_server):
  server = make_server(shm_size=8 << 20)  # the default quota: 0.9 of it
  with sidecar.jax.Worker(server.options.socket_path) as hog, \
       sidecar.jax.Worker(server.options.socket_path) as other:
    held, error = fill(hog)
    assert "would pass its quota of 7.2 MiB" in error and leases_lib.QUOTA_FLAG in error, error
    assert len(held) * (512 << 10) <= 0.9 * (8 << 20)  # before: all 8 MiB
    mine = other.put(np.ones(512 << 10, np.uint8))[0]  # room left for another client
    assert (mine == 1).all()
    del mine, held


def test_a_stream_that_finds_no_room_says_so_within_its_wait(make_server, monkeypatch):
  """The arena held by one client: another's stream of 1 MiB items used to block for ever
  (a feed: 150 s and on); now it ends with ResourceExhaustedError giving the sizes."""
  monkeypatch.setattr(arena_io, "ARENA_WAIT_S", 2.0)
  server = make_server(shm_size=8 << 20, session_quota=1.0)  # no quota: one client takes all
  with sidecar.jax.Worker(server.options.socket_path) as hog:
    held, _ = fill(hog)
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=30) as ctl:
      with pytest.raises(sidecar.ResourceExhaustedError) as info:
        with ctl.stream("count", args=(3,), kwargs={"nbytes": 1 << 20}, timeout=30) as s:
          list(s)
      message = str(info.value)
      assert "the arena is full: 1.0 MiB asked" in message, message
      assert "other worker sessions" in message and "--session-quota" in message
      del held
      gc.collect()  # fill()'s refusal, in a cycle with its frame, held the list too
      with ctl.stream("count", args=(3,), kwargs={"nbytes": 1 << 20}, timeout=30) as s:
        assert [item["i"] for item in s] == [0, 1, 2]  # room again once the hog let go


@pytest.mark.parametrize("auth", [{"token": "shared-secret"},
                                  {"client_tokens": (("alice", "alice-secret"),)}],
                         ids=["shared-token", "client-tokens"])
def test_the_older_modes_refuse_past_the_quota_at_once_with_no_queue(make_server, auth):
  # The shared token and --client-tokens are pools of no quotas: a worker past its session
  # quota is refused at once, as before pools. (With the pool's admission queue their
  # requests waited on the quota for ever: a Slurm job's ranks that share a sidecar hung.)
  server = make_server(shm_size=8 << 20, **auth)
  token = auth.get("token") or auth["client_tokens"][0][1]
  with sidecar.jax.Worker(server.options.socket_path, token=token) as hog:
    held, error = fill(hog)
    assert "would pass its quota of 7.2 MiB" in error, error
    assert len(held) * (512 << 10) <= 0.9 * (8 << 20)
    del held
