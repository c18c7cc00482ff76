"""Who gives way when a port anyone may reach is full (server/ports/peers.py): a new
connection gets in unless every one is a different peer's only one."""

import pytest

from sidecar._src.server.ports import peers

pytestmark = pytest.mark.unit


def table(per_peer: int = 3, total: int = 6) -> peers.PeerTable:
  return peers.PeerTable(peers.Bounds(per_peer=per_peer, total=total))


def test_a_peer_past_its_bound_gives_its_own_oldest():
  t = table()
  assert [t.add("a", i) for i in range(3)] == [[], [], []]
  assert t.add("a", 3) == [0] and t.add("a", 4) == [1]
  assert t.held("a") == 3 and len(t) == 3


def test_a_full_port_makes_room_from_the_peer_holding_the_most():
  t = table(per_peer=4, total=6)
  for i in range(4):
    t.add("flood", i)
  t.add("b", "b0")
  t.add("c", "c0")
  assert t.add("kubelet", "k0") == [0]  # the flood's oldest, not b's nor c's
  assert t.add("kubelet", "k1") == [1]
  # flood 2, kubelet 2: the flood holds no more than the kubelet would, which gives its own
  assert t.add("kubelet", "k2") == ["k0"]
  assert t.held("flood") == 2 and t.held("kubelet") == 2 and t.held("b") == t.held("c") == 1


def test_a_new_peer_is_refused_only_where_each_holds_one():
  t = table(per_peer=2, total=3)
  for peer in "abc":
    t.add(peer, peer)
  with pytest.raises(peers.Full, match="each by a different peer"):
    t.add("d", "d")
  assert len(t) == 3 and t.held("d") == 0
  assert t.add("a", "a2") == ["a"]  # a peer that holds one gives its own


def test_removed_connections_are_forgotten():
  t = table()
  t.add("a", 1)
  assert t.remove("a", 1) and not t.remove("a", 1) and len(t) == 0 and t.held("a") == 0


@pytest.mark.parametrize("per_peer,total", [(0, 4), (5, 4)], ids=["zero", "above-total"])
def test_bounds_are_checked(per_peer, total):
  with pytest.raises(ValueError, match="per_peer <= total"):
    peers.Bounds(per_peer=per_peer, total=total)
