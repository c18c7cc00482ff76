"""Tier 2: who may drop which RAM-tier copies (the DropRamTier rpc) in a pool: a tenant its
own directories and itself, the pool's operator (its operator token) anyone's, the peer
token none."""

import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors
from sidecar._src.tools import cli
from tests.conftest import PEER_TOKEN, eventually
from tests.support import pool_files
from tests.support.pool_files import ALICE, BOB, OPERATOR, controller, write_pool

pytestmark = pytest.mark.server

STEP = np.arange(1 << 16, dtype=np.float32)  # 256 KiB


def _ram_steps(server) -> dict[str, list[int]]:
  return {c.directory: list(c.ram_steps) for c in server.checkpoints.tier.status()
          if c.ram_steps}


def test_a_tenant_drops_its_own_copies_and_the_operator_anyones(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, pool_files.POOL + pool_files.OPERATOR_LINE))
  a, b = str(tmp_path / "alice" / "a"), str(tmp_path / "bob" / "b")
  with controller(server, ALICE) as alice, controller(server, BOB) as bob:
    with alice.checkpointer(a, ram_steps=2) as ck:
      for step in (1, 2):
        ck.save(step, {"w": STEP + step}).durable.result(30)
    with bob.checkpointer(b) as ck:
      ck.save(1, {"w": STEP}).durable.result(30)
    assert _ram_steps(server) == {a: [1, 2], b: [1]}
    with pytest.raises(errors.PermissionDeniedError, match="in no checkpoint directory client"):
      bob.drop_ram_tier(a)
    with pytest.raises(errors.PermissionDeniedError,
                       match="tenant 'bob' may drop only its own RAM-tier copies"):
      bob.drop_ram_tier(tenant="alice")
    with pytest.raises(sidecar.InvalidArgumentError, match="one of them"):
      bob.drop_ram_tier(b, tenant="bob")
    assert _ram_steps(server) == {a: [1, 2], b: [1]}
    dropped = alice.drop_ram_tier(a)
    assert [(s.directory, s.steps, s.nbytes) for s in dropped.dropped] == [
        (a, (1, 2), 2 * STEP.nbytes)]
    assert _ram_steps(server) == {b: [1]}
  with controller(server, PEER_TOKEN) as peer:  # the sidecars' own: no operator
    with pytest.raises(errors.PermissionDeniedError, match="the peer token is the sidecars'"):
      peer.drop_ram_tier(tenant="bob")
  assert _ram_steps(server) == {b: [1]}
  with controller(server, OPERATOR) as operator:
    assert operator.drop_ram_tier(tenant="bob").dropped[0].steps == (1,)
  assert _ram_steps(server) == {}


def test_a_tenants_durable_copies_give_way_within_its_arena_ceiling(make_server, tmp_path):
  """alice's arena_ceiling is 3 MiB: her step 1's 2 MiB copy gives way to step 2's save
  (the admission queue asks the RAM tier), with the default ram_steps and with more."""
  server = make_server(pool=write_pool(tmp_path))
  big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB
  with controller(server, ALICE, attach=True) as alice:  # her worker stages: her arena
    for ram_steps, directory in ((1, "a"), (3, "b")):
      path = str(tmp_path / "alice" / directory)
      with alice.checkpointer(path, ram_steps=ram_steps) as ck:
        for step in (1, 2, 3):
          # Her worker's frees of the last step's blocks wait behind a queued alloc on its
          # connection (arena/worker.py): let them arrive first, as a training step would.
          assert eventually(lambda: not server.leases.held_bytes()[0])
          assert ck.save(step, {"w": big + step}).durable.result(30) == step
        assert _ram_steps(server)[path] == [3]
        got = ck.restore(2, target={"w": np.zeros_like(big)})  # from storage
        np.testing.assert_array_equal(got["w"], big + 2)
        del got  # its arena block counts against her ceiling while she holds it


def test_the_operator_drops_a_tenants_copies_with_the_cli(make_server, tmp_path, capsys):
  """sidecar ram-tier drop --tenant, with the operator token file (a tenant's token file
  drops only its own): the CLI's door to what the API test above does."""
  server = make_server(pool=write_pool(tmp_path, pool_files.POOL + pool_files.OPERATOR_LINE))
  a = str(tmp_path / "alice" / "a")
  with controller(server, ALICE) as alice, alice.checkpointer(a) as ck:
    ck.save(1, {"w": STEP}).durable.result(30)
  assert _ram_steps(server) == {a: [1]}
  address = f"127.0.0.1:{server.port}"
  drop = ["ram-tier", "drop", "--tenant", "alice", address, "--token-file"]
  assert cli.main([*drop, str(tmp_path / "bob.token")]) != 0
  assert "tenant 'bob' may drop only its own RAM-tier copies" in capsys.readouterr().err
  assert _ram_steps(server) == {a: [1]}
  assert cli.main([*drop, str(tmp_path / "operator.token")]) == 0
  assert capsys.readouterr().out == f"host 0: dropped {a} step 1 (256.0 KiB)\n"
  assert _ram_steps(server) == {}
