"""Who gives way when a port anyone may reach is full (server/ports/remotes.py): a new
connection gets in unless every one is a different remote's only one."""

import pytest

from sidecar._src.server.ports import remotes

pytestmark = pytest.mark.unit


def table(per_remote: int = 3, total: int = 6) -> remotes.RemoteTable:
  return remotes.RemoteTable(remotes.Bounds(per_remote=per_remote, total=total))


def test_a_remote_past_its_bound_gives_its_own_oldest():
  t = table()
  assert [t.add("a", i) for i in range(3)] == [[], [], []]
  assert t.add("a", 3) == [0] and t.add("a", 4) == [1]
  assert t.held("a") == 3 and len(t) == 3


def test_a_full_port_makes_room_from_the_remote_holding_the_most():
  t = table(per_remote=4, total=6)
  for i in range(4):
    t.add("flood", i)
  t.add("b", "b0")
  t.add("c", "c0")
  assert t.add("kubelet", "k0") == [0]  # the flood's oldest, not b's nor c's
  assert t.add("kubelet", "k1") == [1]
  # flood 2, kubelet 2: the flood holds no more than the kubelet would, which gives its own
  assert t.add("kubelet", "k2") == ["k0"]
  assert t.held("flood") == 2 and t.held("kubelet") == 2 and t.held("b") == t.held("c") == 1


def test_a_new_remote_is_refused_only_where_each_holds_one():
  t = table(per_remote=2, total=3)
  for remote in "abc":
    t.add(remote, remote)
  with pytest.raises(remotes.Full, match="each by a different remote"):
    t.add("d", "d")
  assert len(t) == 3 and t.held("d") == 0
  assert t.add("a", "a2") == ["a"]  # a remote that holds one gives its own


def test_removed_connections_are_forgotten():
  t = table()
  t.add("a", 1)
  assert t.remove("a", 1) and not t.remove("a", 1) and len(t) == 0 and t.held("a") == 0


@pytest.mark.parametrize("per_remote,total", [(0, 4), (5, 4)], ids=["zero", "above-total"])
def test_bounds_are_checked(per_remote, total):
  with pytest.raises(ValueError, match="per_remote <= total"):
    remotes.Bounds(per_remote=per_remote, total=total)
