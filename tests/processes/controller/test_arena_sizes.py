"""Tier 3: a request that can never fit the arena fails at once, naming the --shm-size (or
LocalCluster's shm_size=) that would fit it (issue 55 item 5)."""

import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors

pytestmark = pytest.mark.processes


def test_a_state_larger_than_the_arena_names_the_shm_size_a_save_needs(tmp_path):
  # It said "Raise the sidecars' --shm-size (it must hold a save plus the RAM tier and
  # prefetched batches)", and no figure.
  state = {"w": np.ones(3 << 20, np.float32)}  # 12 MiB on the one host
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      with pytest.raises(errors.ResourceExhaustedError, match=(
          r"the state does not fit the arenas \(host 0 needs 12\.0 MiB, its arena is 8\.0 "
          r"MiB\); nothing was copied\. This save alone needs --shm-size 12MiB \(LocalCluster's "
          r"shm_size=\"12MiB\"\); saving on while training needs about --shm-size 24MiB: 2 x "
          r"12\.0 MiB, assuming the default ram_steps=1 .*, plus the bytes of the batches your "
          r"feeds prefetch$")):
        ckpt.save(0, state)
      assert ckpt.all_steps() == []
