"""Tier 2: a full arena's error says what holds it without naming another client's
checkpoint directories (--client-tokens, where each client sees only its own)."""

import numpy as np
import pytest

import sidecar
from sidecar._src.core import env as env_lib

pytestmark = pytest.mark.server

MiB = 1 << 20
HELD = 7  # bob's step whose write waits for the gate file
TOKENS = (("alice", "alice-secret"), ("bob", "bob-secret"))


def controller(server, token):
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], token=token, timeout=10)


def test_a_full_arena_names_the_callers_own_directories_only(make_server, tmp_path,
                                                             monkeypatch):
  gate = tmp_path / "go"
  monkeypatch.setenv(env_lib.CKPT_FAULT, f"slow@{HELD}:{gate}")
  server = make_server(client_tokens=TOKENS, shm_size=8 * MiB)
  state = lambda fill: {"w": np.full(5 * MiB // 4, fill, np.float32)}
  bobs, alices = tmp_path / "bob-private-run", tmp_path / "alice-run"
  with controller(server, "bob-secret") as bob, bob.checkpointer(bobs) as held:
    try:
      first = held.save(HELD, state(7.0))
      assert first.staged.result(30) == HELD  # in the RAM tier, not durable yet
      with controller(server, "alice-secret") as alice, alice.checkpointer(alices) as ckpt:
        with pytest.raises(sidecar.ResourceExhaustedError) as e:
          ckpt.save(1, state(1.0))
    finally:
      gate.touch()  # bob's write goes on
    assert first.durable.result(30) == HELD
  message = str(e.value)
  # Before: "tenant 'alice' holds 0 B of the arena; 5.0 MiB more would take from the
  # guaranteed arena of other tenants (0 B they are guaranteed ...) ... in the pool file",
  # with no pool and nothing guaranteed, and not a word on what holds the arena.
  assert "the arena is full, 3.0 MiB free of 8.0 MiB" in message, message
  assert "other clients' steps (5.0 MiB, not durable yet, kept)" in message, message
  assert "bob-private-run" not in message, message  # bob's directories are his own
