"""Tier 1: the checkpointer's view of the sidecars (sidecars.py): which hosts hold a host's
replicas."""

import pytest

from sidecar._src.controller.checkpoint.sidecars import replica_hosts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("slices, host, replicas, expected", [
    ({0: 0, 1: 0, 2: 0}, 0, 1, [1]),
    ({0: 0, 1: 0, 2: 0}, 2, 2, [0, 1]),  # wraps
    ({0: 0, 1: 0, 2: 1, 3: 1}, 0, 1, [2]),  # another slice first
    ({0: 0, 1: 0, 2: 1, 3: 1}, 3, 2, [0, 1]),
    ({0: 0, 1: 0, 2: 1, 3: 1}, 1, 3, [2, 3, 0]),  # then its own slice
], ids=["next", "wrap", "other-slice", "other-slice-wrap", "then-same-slice"])
def test_replica_hosts(slices, host, replicas, expected):
  assert replica_hosts(slices, host, replicas) == expected
