"""The HealthWatch on fake Status rpcs: lost after silence, watched again on rejoin,
threads joined on stop.

A fake rpc answers or fails as the test says, as a grpc future would; no channel, no
server. Nothing here asserts on time: waits are for effects, with ``eventually``.
"""

import threading

import grpc
import pytest

from sidecar._src.controller import health
from sidecar._src.wire.protocol import pb
from tests.conftest import eventually

pytestmark = pytest.mark.unit


class FakeRpcError(grpc.RpcError):
  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(details)
    self._code, self._details = code, details

  def code(self):
    return self._code

  def details(self):
    return self._details


class _Answer:
  def __init__(self, error, hang_s):
    self._error, self._hang_s = error, hang_s

  def result(self):
    if self._hang_s is not None:  # a hung sidecar: the poll's deadline passes
      threading.Event().wait(self._hang_s)
    if self._error is not None:
      raise self._error
    return pb.StatusResponse()


class FakeStatus:
  """A host's Status rpc: answers until ``fail()``, then fails until ``answer()``."""

  def __init__(self):
    self._lock = threading.Lock()
    self._error: grpc.RpcError | None = None
    self._hang = False
    self.calls: list[tuple[float, tuple]] = []

  def future(self, request, *, timeout, metadata):
    assert isinstance(request, pb.StatusRequest)
    with self._lock:
      self.calls.append((timeout, metadata))
      error, hang = self._error, self._hang
    return _Answer(error, timeout if hang else None)

  def fail(self, code=grpc.StatusCode.UNAVAILABLE, details="connection refused", *, hang=False):
    with self._lock:
      self._error = FakeRpcError(code, details)
      self._hang = hang

  def answer(self):
    with self._lock:
      self._error, self._hang = None, False

  @property
  def polls(self) -> int:
    with self._lock:
      return len(self.calls)


class Lost:
  """on_lost: records each call."""

  def __init__(self):
    self.calls: list[tuple[int, str]] = []
    self._lock = threading.Lock()

  def __call__(self, host_id, reason):
    with self._lock:
      self.calls.append((host_id, reason))

  def hosts(self):
    with self._lock:
      return [h for h, _ in self.calls]


def watch_threads():
  return [t for t in threading.enumerate() if t.name.startswith("sidecar-health")]


@pytest.fixture
def watches():
  made = []

  def make(rpcs, **kw):
    kw.setdefault("interval", 0.005)
    kw.setdefault("lost_after", 0.02)
    watch = health.HealthWatch(rpcs, **kw)
    made.append(watch)
    return watch.start()

  yield make
  for watch in made:
    watch.stop()
  assert watch_threads() == []


def test_a_silent_host_is_lost_once_and_the_others_are_still_watched(watches):
  rpcs = {0: FakeStatus(), 1: FakeStatus()}
  lost = Lost()
  watch = watches({h: (rpc, (("authorization", f"t{h}"),)) for h, rpc in rpcs.items()},
                  on_lost=lost)
  assert eventually(lambda: rpcs[1].polls >= 2)
  rpcs[1].fail()
  assert eventually(lambda: lost.calls)
  assert lost.calls == [(1, "UNAVAILABLE: connection refused")]
  assert watch.watching == [0]
  polled = rpcs[1].polls
  before = rpcs[0].polls
  assert eventually(lambda: rpcs[0].polls >= before + 5)  # polls go on, for host 0 only
  assert rpcs[1].polls == polled and lost.calls == [(1, "UNAVAILABLE: connection refused")]
  # Each poll carries the host's metadata and the lost_after deadline.
  assert set(rpcs[0].calls) == {(0.02, (("authorization", "t0"),))}


def test_a_hung_host_is_lost_when_its_deadline_passes(watches):
  rpc = FakeStatus()
  rpc.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", hang=True)
  lost = Lost()
  watches({3: (rpc, ())}, on_lost=lost)
  assert eventually(lambda: lost.calls)
  assert lost.calls == [(3, "DEADLINE_EXCEEDED: Deadline Exceeded")]


def test_a_failure_shorter_than_lost_after_loses_nothing(watches):
  rpc = FakeStatus()
  lost = Lost()
  watch = watches({0: (rpc, ())}, lost_after=3600.0, on_lost=lost)
  rpc.fail()
  assert eventually(lambda: rpc.polls >= 5)
  rpc.answer()
  polled = rpc.polls
  assert eventually(lambda: rpc.polls >= polled + 3)
  assert lost.calls == [] and watch.watching == [0]


def test_a_lost_host_whose_sidecar_is_back_is_watched_again(watches, monkeypatch):
  monkeypatch.setattr(health, "PROBE_S", 0.005)
  old, new = FakeStatus(), FakeStatus()
  old.fail()
  asked, back = [], threading.Event()
  lost = Lost()

  def rejoin(host_id):
    asked.append(host_id)
    return (new, (("k", "v"),)) if back.is_set() else None

  watch = watches({0: (FakeStatus(), ()), 2: (old, ())}, on_lost=lost, rejoin=rejoin)
  assert eventually(lambda: lost.calls) and watch.watching == [0]
  assert eventually(lambda: len(asked) >= 3)  # asked, still gone
  assert set(asked) == {2} and watch.watching == [0] and new.polls == 0
  back.set()
  assert eventually(lambda: watch.watching == [0, 2])
  assert eventually(lambda: new.polls >= 2) and new.calls[0][1] == (("k", "v"),)
  asked.clear()
  new.fail(details="gone again")
  assert eventually(lambda: len(lost.calls) == 2)  # lost again, rejoin asked again
  assert lost.calls[1] == (2, "UNAVAILABLE: gone again")
  assert eventually(lambda: asked)


def test_stop_joins_the_threads_and_is_idempotent():
  watch = health.HealthWatch({0: (FakeStatus(), ())}, on_lost=Lost(), interval=0.005,
                             rejoin=lambda h: None)
  assert watch.start() is watch and watch.start() is watch  # one set of threads
  assert sorted(t.name for t in watch_threads()) == ["sidecar-health", "sidecar-health-rejoin"]
  watch.stop()
  assert watch_threads() == []
  watch.stop()


def test_on_lost_may_stop_the_watch_from_its_own_thread(watches):
  rpc = FakeStatus()
  rpc.fail()
  stopped = threading.Event()
  watch = None

  def on_lost(host_id, reason):
    watch.stop()  # the Controller's handler closes things; it must not join itself
    stopped.set()

  watch = watches({0: (rpc, ())}, on_lost=on_lost)
  assert stopped.wait(10)
  assert eventually(lambda: watch_threads() == [])


@pytest.mark.parametrize(("interval", "lost_after"), [(0, 1.0), (0.2, -1.0)],
                         ids=["interval", "lost_after"])
def test_periods_must_be_positive(interval, lost_after):
  with pytest.raises(ValueError, match=rf"^interval and lost_after must be positive seconds, got "
                                       rf"{interval!r} and {lost_after!r}$"):
    health.HealthWatch({}, on_lost=Lost(), interval=interval, lost_after=lost_after)
