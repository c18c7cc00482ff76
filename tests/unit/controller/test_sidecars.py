"""``controller.hosts.Sidecars`` with no process: its connections are in-process fakes.

Hosts reaches sidecars through one seam, ``connect(address, timeout)``; tests/support's
FakeSidecars answers it from a table of addresses, with a :class:`FakeConnection` (what a
handshake told: host id, registry fingerprint) or the error that connecting raised.
"""

import logging
import re

import pytest

from sidecar._src.controller import peers as peers_lib
from sidecar._src.controller.sidecars import Sidecars
from sidecar._src.core import errors
from tests.support.fake_sidecars import FakeConnection, FakeSidecars

pytestmark = pytest.mark.unit


def _hosts(answers, **kwargs):
  sidecars = FakeSidecars(answers=answers)
  cancelled = []
  hosts = Sidecars(sidecars.connect, peers=peers_lib.LocalPeers(), silence_timeout=1.0,
                map_arenas=False, cancel=lambda: cancelled.append(True), **kwargs)
  return hosts, sidecars, cancelled


def _opened(n: int = 3):
  answers = {f"h{i}:1": FakeConnection(f"h{i}:1", i, device_ids=(2 * i, 2 * i + 1))
             for i in range(n)}
  hosts, sidecars, cancelled = _hosts(answers)
  hosts.open(list(answers), timeout=1.0, workers={})
  return hosts, sidecars, cancelled


def test_open_learns_every_host_and_its_devices():
  hosts, sidecars, _ = _opened(3)
  assert [h.host_id for h in hosts.live()] == [0, 1, 2]
  assert hosts.local_hosts == [0, 1, 2]
  assert hosts.device_hosts == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
  hosts.close()
  hosts.close()  # idempotent
  assert all(c.closed for c in sidecars.made)


def test_one_failure_is_raised_as_it_came_and_the_others_are_closed():
  gone = errors.HostLostError("sidecar b:1 did not answer")
  hosts, sidecars, _ = _hosts({"a:1": FakeConnection("a:1", 0), "b:1": gone})
  with pytest.raises(errors.HostLostError) as caught:
    hosts.connect(["a:1", "b:1"], 1.0)
  assert caught.value is gone
  assert sidecars.made[0].closed and hosts.conns == {}


def test_every_failure_is_named_in_one_error():
  hosts, _, _ = _hosts({"a:1": errors.HostLostError("a:1 did not answer"),
                        "b:1": errors.HostLostError("b:1 did not answer")})
  with pytest.raises(errors.HostLostError,
                     match=r"^a:1 did not answer; b:1 did not answer$"):
    hosts.connect(["a:1", "b:1"], 1.0)


def test_a_token_some_sidecars_refuse_means_two_jobs():
  hosts, sidecars, _ = _hosts({"a:1": FakeConnection("a:1", 0),
                               "b:1": errors.AuthenticationError("bad token")})
  with pytest.raises(errors.AuthenticationError,
                     match=r"not of one job: a:1 accepted this controller's token, b:1 "
                           r"refused it\. List only one job's sidecars"):
    hosts.connect(["a:1", "b:1"], 1.0)
  assert sidecars.made[0].closed


def test_two_sidecars_with_one_host_id_are_refused_and_closed():
  hosts, sidecars, _ = _hosts({a: FakeConnection(a, 0) for a in ("a:1", "b:1", "c:1")})
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"sidecars a:1 and b:1 both say they are host 0; give each "
                           r"sidecar its own --host-id"):
    hosts.connect(["a:1", "b:1", "c:1"], 1.0)
  hosts.close()
  assert [c.closed for c in sidecars.made] == [True, True, True]


def test_sidecars_that_registered_different_code_are_listed():
  hosts, _, _ = _hosts({"a:1": FakeConnection("a:1", 0, fingerprint="f1"),
                        "b:1": FakeConnection("b:1", 1, fingerprint="f2")})
  with pytest.raises(errors.VersionMismatchError,
                     match=r"registered different code(.|\n)*host 0 \(a:1\): functions "
                           r"\['double'\], pipelines \[\], fingerprint f1\n  host 1 \(b:1\)"
                           r".*fingerprint f2"):
    hosts.connect(["a:1", "b:1"], 1.0)


def test_workers_must_name_a_known_host():
  hosts, _, _ = _hosts({"a:1": FakeConnection("a:1", 0)})
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"workers names host 3, but the sidecars are hosts \[0\]"):
    hosts.open(["a:1"], timeout=1.0, workers={3: object()})


@pytest.mark.parametrize("chosen, expected", [
    (None, [0, 1, 2]), (1, [1]), ([2, 0], [2, 0]),
], ids=["default-every-local-host", "one-int", "a-list-in-its-order"])
def test_select_picks_the_named_hosts(chosen, expected):
  hosts, _, _ = _opened(3)
  assert hosts.select(chosen) == expected


@pytest.mark.parametrize("chosen, message", [
    ([5], r"hosts=\[5\] is not a valid placement: hosts must be distinct ids among "
          r"\[0, 1, 2\]; unknown: \[5\]$"),
    ([1, 1], r"hosts=\[1, 1\] is not a valid placement: hosts must be distinct ids among "
             r"\[0, 1, 2\]$"),
    ([], r"hosts=\[\] is not a valid placement"),
], ids=["unknown", "repeated", "empty"])
def test_select_names_a_bad_placement(chosen, message):
  hosts, _, _ = _opened(3)
  with pytest.raises(errors.InvalidArgumentError, match=message):
    hosts.select(chosen)


def test_a_lost_host_leaves_and_is_told_once():
  hosts, _, cancelled = _opened(3)
  heard = []
  hosts.lost_listeners.append(lambda h, why: heard.append((h, why)))
  hosts.host_lost(1, "silent for 3 s")
  hosts.host_lost(1, "silent again")
  assert heard == [(1, "silent for 3 s")] and cancelled == [True]
  assert hosts.lost_hosts() == {1: "silent for 3 s"}
  assert [h.host_id for h in hosts.live()] == [0, 2] and hosts.local_hosts == [0, 2]
  assert hosts.select(None) == [0, 2]
  assert list(hosts.health_rpcs()) == [0, 2]
  with pytest.raises(errors.HostLostError,
                     match=r"hosts \[1\] are lost \(silent for 3 s\); live hosts: \[0, 2\]"):
    hosts.select([0, 1])


def test_nothing_is_lost_once_closed():
  hosts, _, cancelled = _opened(2)
  hosts.close()
  hosts.host_lost(0, "silent")
  assert hosts.lost_hosts() == {} and cancelled == []


def test_a_lost_host_is_not_asked_back_unless_rejoin_is_on():
  hosts, sidecars, _ = _opened(2)
  hosts.host_lost(1, "silent")
  assert hosts.host_back(1) is None
  assert sidecars.asked == ["h0:1", "h1:1"]  # not asked again
  hosts.rejoin = True
  sidecars.answers["h1:1"] = errors.HostLostError("still gone")
  assert hosts.host_back(1) is None and hosts.lost_hosts() == {1: "silent"}


@pytest.mark.parametrize("returned, reason", [
    (FakeConnection("h1:1", 7, device_ids=(2, 3)), r"the sidecar at h1:1 is now host 7"),
    (FakeConnection("h1:1", 1, fingerprint="f9"),
     r"its sidecar registered different code \(fingerprint f9, was f1\); deploy the same "
     r"modules to every host"),
], ids=["another-host-id", "other-code"])
def test_a_returned_sidecar_that_does_not_match_stays_lost(caplog, returned, reason):
  hosts, sidecars, _ = _opened(2)
  hosts.rejoin = True
  hosts.host_lost(1, "silent")
  sidecars.answers["h1:1"] = returned
  with caplog.at_level(logging.WARNING, logger="sidecar._src.controller.sidecars"):
    assert hosts.host_back(1) is None
    assert hosts.host_back(1) is None
  warned = [r.getMessage() for r in caplog.records]
  assert len(warned) == 1  # the same reason is logged once
  assert warned[0].startswith("host 1 answers again but stays lost: ")
  assert re.search(reason, warned[0])
  assert hosts.refused == {1: warned[0].split("stays lost: ", 1)[1]}
  assert returned.closed and hosts.lost_hosts() == {1: "silent"}


def test_a_returned_sidecar_rejoins_and_listeners_hear():
  hosts, sidecars, _ = _opened(2)
  hosts.rejoin = True
  heard = []
  hosts.back_listeners.append(heard.append)
  hosts.host_lost(1, "silent")
  old = hosts.conns[1]
  new = FakeConnection("h1:1", 1, device_ids=(2, 3))
  sidecars.answers["h1:1"] = new
  assert hosts.host_back(1) == (new.status_rpc, new.metadata)
  assert heard == [1] and hosts.lost_hosts() == {} and hosts.conns[1] is new
  assert old.closed and not new.closed
  assert hosts.local_hosts == [0, 1] and hosts.device_hosts[3] == 1


def test_a_returned_sidecar_is_not_taken_once_closed():
  hosts, sidecars, _ = _opened(2)
  hosts.rejoin = True
  hosts.host_lost(1, "silent")
  hosts.close()
  sidecars.answers["h1:1"] = FakeConnection("h1:1", 1)
  assert hosts.host_back(1) is None
  assert sidecars.asked == ["h0:1", "h1:1"]
