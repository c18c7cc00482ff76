"""controller.peers: agreement between trainer processes, over any store.

No sockets: DictPeers (tests/support, the store of the Peers docstring) stands for a framework's
key-value store, shared by threads that stand for the processes.
"""


import pytest

from sidecar._src.controller import peers as peers_lib
from sidecar._src.core import errors
from tests.support.fake_sidecars import DictPeers
from tests.support.processes_as_threads import run_as_processes

pytestmark = pytest.mark.unit


def run(count, body):
  store: dict = {}
  return run_as_processes(count, lambda p: body(DictPeers(store, p, count)))


def test_any_store_with_publish_and_read_gathers_broadcasts_and_agrees():
  def body(peers):
    gathered = peers.all_gather("g", f"v{peers.index}")
    told = peers.broadcast("b", "from-0" if peers.index == 0 else None)
    peers.check_same("a", {"step": 3}, what="the step")
    return gathered, told
  assert run(3, body) == [(["v0", "v1", "v2"], "from-0")] * 3
  outcomes = run(2, lambda peers: peers.check_same("a", {"step": peers.index}, what="the step"))
  assert all(isinstance(e, errors.InvalidArgumentError) and "process 1: step=1" in str(e)
             for e in outcomes)


def test_the_interface_needs_both_methods():
  with pytest.raises(TypeError, match="abstract"):
    type("OnlyPublish", (peers_lib.Peers,), {"publish": lambda self, k, v: None})()


def test_sync_timeout_from_env():
  assert peers_lib.sync_timeout({}) == peers_lib.DEFAULT_SYNC_TIMEOUT_S
  assert peers_lib.sync_timeout({"SIDECAR_SYNC_TIMEOUT": "2.5"}) == 2.5
  with pytest.raises(errors.InvalidArgumentError, match="SIDECAR_SYNC_TIMEOUT"):
    peers_lib.sync_timeout({"SIDECAR_SYNC_TIMEOUT": "0"})


def test_local_peers_agree_with_themselves():
  peers = peers_lib.LocalPeers()
  assert peers.all_gather("k", "v") == ["v"]
  assert peers.broadcast("b", "x") == "x"
  peers.check_same("a", 1, what="anything")


def test_processes_may_share_a_host_but_not_a_device():
  shared = [{"host_id": 0, "device_ids": [0]}, {"host_id": 0, "device_ids": [2048]},
            {"host_id": 1, "device_ids": [4096]}]
  assert peers_lib.hosts_by_process(shared) == {0: 0, 2048: 0, 4096: 1}
  assert peers_lib.processes_by_host(shared) == {0: [0, 1], 1: [2]}
  with pytest.raises(errors.InvalidArgumentError, match="processes 0 and 1 both say they own "
                                                        "device 7"):
    peers_lib.hosts_by_process([{"host_id": 0, "device_ids": [7]},
                                {"host_id": 1, "device_ids": [7]}])
  assert peers_lib.hosts_by_process([{"host_id": 1, "device_ids": [0, 1]},
                                     {"host_id": 0, "device_ids": [2048]}]) == {
                                         0: 1, 1: 1, 2048: 0}


def test_check_same_is_the_new_spelling_and_agree_warns_until_0_4():
  # Issue 72: an agreement is the sidecars' commit; the processes check their values.
  peers = peers_lib.LocalPeers()
  peers.check_same("a", {"step": 1}, what="the step")
  with pytest.warns(DeprecationWarning, match=r"^sidecar.distributed.Peers.agree is deprecated "
                                              r"since 0.3.0 and goes in 0.4.0: use "
                                              r"sidecar.distributed.Peers.check_same"):
    peers.agree("b", {"step": 1}, what="the step")
  outcomes = run(2, lambda peers: peers.check_same("c", peers.index, what="the index"))
  assert all(isinstance(e, errors.InvalidArgumentError) and "disagree on the index" in str(e)
             for e in outcomes)
