"""Tier 1: Checkpointer's logic against an in-process fake of the sidecars, no sockets."""

import logging

import numpy as np
import pytest

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.core import errors
from tests.support import fake_sidecars
from tests.support.fake_sidecars import FakeSidecars

pytestmark = pytest.mark.unit


def checkpointer(fake: FakeSidecars, **kw) -> Checkpointer:
  return fake_sidecars.checkpointer(fake, **kw)


def test_a_failed_delete_is_logged_and_the_step_stays_listed(caplog):
  fake = FakeSidecars(steps=[1, 2], fail={"delete": errors.HostLostError("host 0 is gone",
                                                                         host_id=0)})
  ckpt = checkpointer(fake, max_to_keep=2)
  with (caplog.at_level(logging.WARNING, logger="sidecar._src.controller.checkpoint.retention"),
        ckpt):
    handle = ckpt.save(3, {"x": np.arange(4, dtype=np.int32)})
    ckpt.wait()
  assert handle.durable.result() == 3
  phases = [name for name, _ in fake.calls]
  assert "commit" in phases and "delete" in phases
  assert ckpt.all_steps() == [1, 2, 3]  # step 1 is listed again, to be retried next save
  assert "could not delete step 1 of /ckpt/run: host 0 is gone" in caplog.text


def test_a_save_then_a_restore_from_the_ram_tier_in_phase_order():
  fake = FakeSidecars()
  state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int64(7)}
  with checkpointer(fake) as ckpt:
    assert ckpt.save(5, state, data_state={"position": 8}).durable.result() == 5
    assert ckpt.all_steps() == [5]
    phases = [name for name, _ in fake.calls]
    # The sidecar took the step over at its last stage: it commits it once written (no
    # prepared first), the trainer waits for that (commit), and it tells its RAM tier.
    assert phases[:4] == ["open", "begin", "stage", "commit"]
    assert "prepared" not in phases and "committed" not in phases
    assert fake.told == [(0, "/ckpt/run/5/default", "")]
    restored = ckpt.restore(target={"w": np.zeros((3, 4), np.float32), "step": np.int64(0)})
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert ckpt.data_state() == {"position": 8}
    assert ckpt.last_restore_stats().shards == {"ram:host0": 2}


def test_a_failed_write_aborts_the_save_on_every_host_and_lists_nothing():
  fake = FakeSidecars(hosts=(0, 1), fail={
      "prepared": errors.InvalidArgumentError("host 1 could not write step 4: disk full")})
  ckpt = checkpointer(fake)
  handle = ckpt.save(4, {"x": np.ones(3, np.float32)})
  with pytest.raises(errors.InvalidArgumentError, match="disk full"):
    handle.durable.result()
  assert ckpt.all_steps() == []
  ckpt.close()  # told by its handle: not raised again
  assert "prepared" not in [name for name, _ in fake.calls]  # the sidecars' agreement failed
  assert (0, "/ckpt/run/4/default", "") not in fake.told  # nothing committed
  tmp = "/ckpt/run/4.orbax-checkpoint-tmp"
  # Each host drops its part, then (every host done) the step's tmp directory goes.
  assert sorted(fake.aborted) == [(0, tmp), (0, tmp + "/default"), (1, tmp),
                                  (1, tmp + "/default")]
