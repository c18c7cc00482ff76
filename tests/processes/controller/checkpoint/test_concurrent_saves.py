"""Tier 3: two saves of one step from one trainer at once (issue 35 item 11)."""

import concurrent.futures
import threading

import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors

pytestmark = pytest.mark.processes


def test_a_second_save_of_a_step_in_flight_is_refused_at_once_and_the_first_is_durable(
    tmp_path):
  state = {"w": np.arange(1 << 20, dtype=np.float32), "b": np.ones(8, np.int32)}
  start = threading.Barrier(2)

  def save(ckpt):
    start.wait(10)
    return ckpt.save(3, state).durable.result(60)

  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = [f.exception(90) or f.result() for f in
                    [pool.submit(save, ckpt) for _ in range(2)]]
      assert sorted(map(type, outcomes), key=str) == [int, errors.InvalidArgumentError], outcomes
      refused = next(o for o in outcomes if isinstance(o, Exception))
      assert "step 3 is being saved already" in str(refused)
      assert ckpt.all_steps() == [3]
      restored = ckpt.restore(3, target=state)
      np.testing.assert_array_equal(restored["w"], state["w"])
