"""ctl.call_async against an in-process sidecar: its results hold their blocks no longer
than the caller does."""
import gc

import numpy as np
import pytest

import sidecar
from tests.conftest import eventually

pytestmark = pytest.mark.server


def test_call_async_results_give_their_blocks_back_at_their_last_reference(make_server):
  # The garbage collector off: a cycle holding a result (callbacks calling one another)
  # would keep its arena block, and a 4 MiB arena fills after a few 1 MiB results.
  server = make_server(shm_size=4 << 20)
  gc.disable()
  try:
    with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
      for value in range(12):
        (f,) = ctl.call_async("full", args=(1 << 20, value), timeout=20)
        a = f.result()
        assert isinstance(a, np.ndarray) and int(a[0]) == value
        del a, f
      assert eventually(lambda: ctl.worker(0).live_blocks == 0)
  finally:
    gc.enable()
