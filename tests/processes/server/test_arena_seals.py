"""Isolation, round 5, attacks 1 and 2 (issue 54): a tenant resizes the arena memfd its
Worker was handed. A pool sidecar in its own process, two tenants, each with its own Worker.

Before: bob's ``ftruncate(fd, 0)`` then a call naming an arena array of his killed the pool
sidecar with SIGBUS (alice's next call: HostLostError), and growing the memfd by 256 MiB held
memory no quota counted. Now every arena memfd is sealed (F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL) before its fd leaves the sidecar: both syscalls fail in bob's process.
"""

import errno
import fcntl
import os

import numpy as np
import pytest

import sidecar
from tests.support.pool_files import ALICE, BOB, write_pool

pytestmark = pytest.mark.processes

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, arena: 2MiB, arena_ceiling: 4MiB}
  - {name: bob, token_file: bob.token, arena: 2MiB, arena_ceiling: 4MiB}
"""


def _refused(syscall) -> int:
  with pytest.raises(OSError) as e:
    syscall()
  return e.value.errno


@pytest.mark.timeout(180)
def test_a_tenant_cannot_resize_its_arena_memfd_and_the_pool_keeps_serving(tmp_path):
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=["tests.support.sidecar_fns"],
                                    pool=write_pool(tmp_path, POOL)) as cluster:
    with cluster.controller(token=BOB) as bob_ctl:
      bob = bob_ctl.worker(0)
      assert bob is not None
      fd, size = bob.arena.fd, bob.arena.size
      seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
      assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
      assert seals & fcntl.F_SEAL_SEAL  # and no one can lift them
      assert _refused(lambda: os.ftruncate(fd, 0)) == errno.EPERM  # attack 1
      assert _refused(lambda: os.ftruncate(fd, size + (256 << 20))) == errno.EPERM  # attack 2
      assert _refused(lambda: os.posix_fallocate(fd, size, 256 << 20)) == errno.EPERM
      assert _refused(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)) == errno.EPERM
      assert os.fstat(fd).st_size == size
      # Then an arena array of his through a call (what read the lost pages before).
      array, _ = bob.put(np.arange(1 << 18, dtype=np.float32))
      (out,) = bob_ctl.call("echo", args=(array,))
      np.testing.assert_array_equal(out, np.arange(1 << 18, dtype=np.float32))
    # The sidecar lives on for alice.
    with cluster.controller(token=ALICE) as ctl:
      (out,) = ctl.call("echo", args=(np.arange(4.0),))
      np.testing.assert_array_equal(out, np.arange(4.0))
    assert cluster._procs[0].poll() is None
