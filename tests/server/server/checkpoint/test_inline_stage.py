"""Tier 2: a Stage's inline shards are inline bytes, as a call's arrays are (issue 42,
attack 10): within the tenant's ``inline_bytes``, and within the sidecar's budget of
inline bytes decoded at once (``limits.INLINE_BYTES_IN_FLIGHT``).

Before, three of bob's sessions each staged a 96 MiB inline shard at once with
``inline_bytes: 1MiB`` (a 96 MiB inline call is refused): all accepted, the sidecar's
peak RSS +836 to +904 MiB. The attacker speaks the Checkpoint service by hand.
"""

import grpc
import numpy as np
import pytest

from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec
from sidecar._src.server import limits
from sidecar._src.wire import checkpoint_wire as wire
from sidecar._src.wire.protocol import ckpt_pb
from tests.support.pool_files import BOB, POOL, write_pool
from tests.support.raw_client import Raw, rejected
from tests.support.staged import staged

pytestmark = pytest.mark.server

BIG = 4 << 20  # past inline_bytes (1 MiB) and pbscan.BIG_ARRAY: left in the request's bytes


def stage(raw: Raw, directory: str, nbytes: int, *, timeout: float = 30):
  """Opens ``directory``, begins step 1 and stages one inline uint8 leaf of ``nbytes``."""
  raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(directory=directory), metadata=raw.metadata,
                timeout=10)
  tmp = raw.ckpt.Begin(ckpt_pb.CheckpointBeginRequest(directory=directory, step=1,
                                                      format="orbax"),
                       metadata=raw.metadata, timeout=10).tmp_directory
  leaf = LeafSpec(key_path=("w",), shape=(nbytes,), dtype=np.dtype(np.uint8),
                  kind=LeafKind.NUMPY)
  data = np.arange(nbytes, dtype=np.uint8)
  request = ckpt_pb.CheckpointStageRequest(
      directory=directory, step=1, tmp_dir=f"{tmp}/default",
      final_dir=f"{directory}/1/default", leaves=[wire.leaf_to_pb(leaf)], last=True)
  wire.staged_to_pb(request, [staged(("w",), 0, ((0, nbytes),), data)], None)
  return raw.ckpt.Stage(request, metadata=raw.metadata, timeout=timeout)


def test_a_tenants_inline_stage_is_held_to_its_inline_bytes(make_server, tmp_path):
  pool = POOL.replace("    functions: [add, echo, slow_count]\n",
                      "    functions: [add, echo, slow_count]\n    inline_bytes: 1MiB\n")
  server = make_server(pool=write_pool(tmp_path, pool), shm_size=16 << 20)
  bob = Raw(server.port, token=BOB)
  try:
    error = rejected(lambda: stage(bob, str(tmp_path / "bob" / "big"), BIG))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "tenant 'bob' sent an inline request of" in error.details()
    assert "(inline_bytes=1048576" in error.details()
    assert not (tmp_path / "bob" / "big" / "1.orbax-checkpoint-tmp" / "default" / "w").exists()
    # Within it, a Stage is decoded as before (under pbscan.BIG_ARRAY: parsed whole).
    small = stage(bob, str(tmp_path / "bob" / "small"), 512 << 10)
    assert small.staged_bytes == 512 << 10
  finally:
    bob.close()


def test_inline_stages_share_the_sidecars_budget_of_inline_bytes(make_server, tmp_path):
  """The budget held by others (three 96 MiB stages at once would pass it): a Stage that
  finds no room waits, within its deadline, then is refused as busy."""
  server = make_server(token="t", shm_size=16 << 20)
  client = Raw(server.port, token="t")
  directory = str(tmp_path / "ck")
  try:
    with server.inline.hold(limits.INLINE_BYTES_IN_FLIGHT - BIG // 2, None):
      error = rejected(lambda: stage(client, directory, BIG, timeout=1.5))
    assert error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                            grpc.StatusCode.DEADLINE_EXCEEDED), error.details()
    # Room again: the same request is taken (another directory: the refused one's
    # handler may still be ending).
    directory = str(tmp_path / "ck2")
    staged = stage(client, directory, BIG)
    assert staged.staged_bytes == BIG
    final = server.checkpoints.tier.find(f"{directory}/1/default")
    (shard,) = final.shards.values()
    np.testing.assert_array_equal(shard, np.arange(BIG, dtype=np.uint8))
  finally:
    client.close()
