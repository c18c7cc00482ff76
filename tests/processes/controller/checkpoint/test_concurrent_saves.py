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


def test_two_checkpointers_saving_one_step_in_one_directory_name_the_save_in_flight(tmp_path):
  # Issue 55 item 6: the second save used to wipe the first's files ("staged already", then
  # the first failed to write); it is refused at its begin, and the first is durable.
  state = {"w": np.ones((1024, 1024, 4), np.float32)}
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path) as a, \
        ctl.checkpointer(tmp_path) as b:
      first = a.save(1, state)
      assert first.staged.result(60) == 1
      with pytest.raises(sidecar.PermissionDeniedError,
                         match="step 1 of .* is being saved by another checkpointer of this "
                               "directory in the same process on host 0: another save of step "
                               "1 into this directory is in flight; wait for that save to end, "
                               "or save each step from one checkpointer"):
        b.save(1, state).durable.result(60)
      assert first.durable.result(60) == 1 and a.all_steps() == [1]
