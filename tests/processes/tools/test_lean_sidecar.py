"""A sidecar whose registered code needs no framework loads none (issue 22, item 7).

`sidecar serve` imports only what its start needs: jax and Grain load when a registered
function or a feed needs them, so an elastic job's restarted sidecar is up in a fraction of a
second with a fraction of the memory. Orbax and TensorStore (and jax through them) load at
the start of a sidecar that serves checkpoints (one with checkpoint roots), on its main
thread before it serves, where they are installed: a burst of saves must never import them
from many threads at once (issue 76; tests/processes/ckptfmt/test_import_burst.py). A
sidecar that serves no checkpoints loads none of them.
"""

import numpy as np
import pytest

import sidecar

pytestmark = pytest.mark.processes

LEAN = ["tests.support.lean_fns"]


def test_a_sidecar_serving_framework_free_code_loads_no_framework():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB",
                                    imports=LEAN, checkpoint_roots=[]) as cluster, \
      cluster.controller() as ctl:
    assert ctl.call("frameworks_loaded") == [[]]  # started, handshaken
    # A call and a stream, inline and through the arena, still load nothing.
    x = np.arange(1 << 17, dtype=np.float32)
    np.testing.assert_array_equal(ctl.call("scale", args=(x,))[0], 2 * x)
    with ctl.stream("arrays", args=(3, 1 << 17), host=0) as items:
      assert [int(a[0]) for a in items] == [0, 1, 2]
    ctl.status()  # with the RAM tier's steps: no checkpoint code needed
    assert ctl.call("frameworks_loaded") == [[]]
    # The probe sees a framework once registered code loads it.
    ctl.call("load_jax")
    assert ctl.call("frameworks_loaded") == [["jax", "jaxlib"]]
