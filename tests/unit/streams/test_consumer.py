"""``streaming.Stream``, the one stream consumer, over an in-process fake transport.

The fake holds the items a sidecar would send and records what the consumer sends
back; the gRPC and Unix-socket transports are tested with real sidecars elsewhere
(tests/server/server/test_server.py, tests/server/arena/test_worker.py).
"""

import collections
import os
import signal
import threading
import time

import numpy as np
import pytest

import sidecar
from sidecar._src.streams import consumer
from sidecar._src.wire import codec, protocol
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


class FakeTransport(consumer.Transport):
  """Items queued by the test; ``receive`` waits (really) when there are none."""

  def __init__(self, *values, end: pb.StreamItem | None = None, lost_after_checks: int = -1):
    self.host, self.host_id, self.poll_s = "fake:0", 7, 0.005
    self.items = collections.deque(
        pb.StreamItem(index=i, value=codec.encode(v)) for i, v in enumerate(values))
    if end is not None:
      self.items.append(end)
    self.credits: list[int] = []
    self.saved: list[str] = []  # each save's state told with a credit
    self.closes: list[int] = []  # each close(owed=...)
    self.checks = 0
    self._lost_after_checks = lost_after_checks
    self._woken = threading.Event()

  def receive(self, wait):
    if self.items:
      return self.items.popleft()
    self._woken.wait(wait)
    if self.closes:  # as a socket shut down by close() on another thread
      raise sidecar.HostLostError("the fake transport was closed", host_id=self.host_id)
    return None

  def check_alive(self, waited):
    self.checks += 1
    if self.checks == self._lost_after_checks:
      raise sidecar.HostLostError("the fake sidecar stopped answering", host_id=self.host_id)

  def credit(self, n, *, wait_s, saved=""):
    assert wait_s >= 0
    self.credits.append(n)
    if saved:
      self.saved.append(saved)

  def close(self, *, owed):
    self.closes.append(owed)
    self._woken.set()


def end_with(error: Exception) -> pb.StreamItem:
  return pb.StreamItem(end=True, error=protocol.error_info(error))


def test_items_then_the_end_close_the_stream_once():
  t = FakeTransport(1, "two", end=pb.StreamItem(end=True))
  with consumer.Stream(t, name="count") as s:
    assert list(s) == [1, "two"] and s.closed
    assert next(s, "none") == "none"
  s.close()
  assert t.closes == [0]  # once, with every item already credited


def test_the_sidecars_error_ends_the_stream_with_its_type_and_host():
  t = FakeTransport(0, end=end_with(sidecar.HostLostError("its pipeline's disk is gone")))
  s = consumer.Stream(t, name="count")
  assert next(s) == 0
  with pytest.raises(sidecar.HostLostError, match="disk is gone") as info:
    next(s)
  assert info.value.host_id == 7 and s.closed and t.closes == [0]
  with pytest.raises(StopIteration):
    next(s)


@pytest.mark.parametrize("kind", ["stream", "pipeline"])
def test_a_remote_exception_arrives_as_the_pipeline_error_naming_it_and_the_host(kind):
  t = FakeTransport(end=end_with(FileNotFoundError("no such file: /d")))
  with pytest.raises(sidecar.PipelineError) as info:
    next(consumer.Stream(t, name="count", kind=kind))
  e = info.value
  assert isinstance(e, sidecar.RemoteError) and (e.pipeline, e.kind, e.host_id) == (
      "count", kind, 7)
  assert str(e).startswith(f"{kind} 'count' on host 7 raised FileNotFoundError: no such file: "
                           "/d\n\nRemote traceback:")


@pytest.mark.parametrize("refusal,kind,caught_as", [
    (sidecar.NotFoundError, sidecar.PipelineNotFoundError, FileNotFoundError),
    (sidecar.PermissionDeniedError, sidecar.PipelinePermissionDeniedError, PermissionError),
    (sidecar.InvalidArgumentError, sidecar.PipelineInvalidArgumentError, ValueError),
    (sidecar.WrongFormatError, sidecar.PipelineInvalidArgumentError, sidecar.InvalidArgumentError),
], ids=["not-found", "permission-denied", "invalid-argument", "a-subclass"])
def test_the_sidecars_refusal_about_a_pipeline_is_its_pipeline_error_and_keeps_its_kind(
    refusal, kind, caught_as):
  # Issue 71 item 2: every error a pipeline raises is one type to catch, with its cause's.
  t = FakeTransport(end=end_with(refusal("no corpus manifest at /d")))
  with pytest.raises(kind) as info:
    next(consumer.Stream(t, name="lm", kind="pipeline"))
  e = info.value
  assert isinstance(e, sidecar.PipelineError) and isinstance(e, caught_as)
  assert (e.pipeline, e.host_id, e.remote_type) == ("lm", 7, refusal.__name__)
  assert str(e) == f"pipeline 'lm' on host 7 raised {refusal.__name__}: no corpus manifest at /d"


def test_the_sidecars_other_errors_keep_their_class_named_with_the_pipeline():
  t = FakeTransport(end=end_with(sidecar.ResourceExhaustedError("the tenant's feed quota")))
  with pytest.raises(sidecar.ResourceExhaustedError) as info:
    next(consumer.Stream(t, name="lm", kind="pipeline"))
  assert not isinstance(info.value, sidecar.PipelineError)
  assert str(info.value) == "pipeline 'lm' on host 7: the tenant's feed quota"


def test_a_timeout_keeps_the_stream_open_and_the_next_wait_gets_the_item():
  t = FakeTransport()
  # A timeout of 100 polls: a sign-of-life check comes before it however loaded the
  # machine (0.02 s, 4 polls, was passed by one late wake-up before any check).
  s = consumer.Stream(t, name="slow", timeout=100 * t.poll_s)
  with pytest.raises(sidecar.DeadlineExceededError,
                     match="no item of 'slow' from host 7 within the timeout of 0.5 s"):
    next(s)
  assert not s.closed and t.closes == [] and t.checks >= 1  # it asked for signs of life
  t.items.append(pb.StreamItem(index=0, value=codec.encode(5)))
  assert next(s) == 5


def test_a_lost_sidecar_ends_the_stream():
  s = consumer.Stream(FakeTransport(lost_after_checks=2), name="count")  # no timeout
  with pytest.raises(sidecar.HostLostError, match="stopped answering"):
    next(s)
  assert s.closed


def test_close_from_another_thread_ends_a_waiting_next():
  t = FakeTransport()
  s = consumer.Stream(t, name="count")
  closer = threading.Timer(0.02, s.close)
  closer.start()
  with pytest.raises(StopIteration):
    next(s)  # woken by close(): the end, not the transport's error
  closer.join()
  assert t.closes == [0]


@pytest.mark.parametrize("every, taken, sent, owed", [
    (1, 5, [1, 1, 1, 1, 1], 0), (2, 5, [2, 2], 1), (4, 3, [], 3)],
    ids=["each-item", "in-pairs", "none-full-yet"])
def test_credits_go_back_in_batches_and_close_returns_the_rest(every, taken, sent, owed):
  t = FakeTransport(*range(10))
  s = consumer.Stream(t, name="count", credit_every=every)
  assert [next(s) for _ in range(taken)] == list(range(taken))
  assert t.credits == sent
  s.close()
  s.close()
  assert t.closes == [owed]  # the sidecar learns of every item taken


def test_values_go_through_the_device_hook_and_are_decoded_naming_the_item():
  # The hook is a framework adapter's (jax/transfer.to_devices: tests/unit/jax/).
  moved = []
  t = FakeTransport({"x": np.arange(4, dtype=np.int32)})
  t.items.append(pb.StreamItem(index=1, value=pb.Value(big_int="nope")))
  s = consumer.Stream(t, name="batches", to_device=lambda tree: moved.append(tree) or "here")
  assert next(s) == "here"
  np.testing.assert_array_equal(moved[0]["x"], np.arange(4))
  with pytest.raises(sidecar.InvalidArgumentError, match="item 1 of 'batches' from host 7"):
    next(s)


def test_ctrl_c_after_an_item_was_read_keeps_it_for_the_next_next():
  # The hook runs after the item left the transport: a Ctrl-C there raised, and lost it.
  t = FakeTransport(0, 1, 2, end=pb.StreamItem(end=True))
  hooked = []

  def to_device(value):
    hooked.append(value)
    if len(hooked) == 2:
      os.kill(os.getpid(), signal.SIGINT)  # in item 1's decoding
    return value

  s = consumer.Stream(t, name="count", to_device=to_device)
  assert next(s) == 0
  with pytest.raises(KeyboardInterrupt):
    next(s)
  assert list(s) == [1, 2]  # item 1 kept, not made again
  assert hooked == [0, 1, 2] and t.credits == [1, 1, 1]
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_the_wait_raises_at_once_and_the_stream_goes_on():
  t = FakeTransport()
  t.poll_s = 10.0  # no sign-of-life checks: the wait's own steps must see the Ctrl-C
  s = consumer.Stream(t, name="count")
  timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
  timer.start()
  t0 = time.monotonic()
  with pytest.raises(KeyboardInterrupt):
    next(s)
  assert time.monotonic() - t0 < t.poll_s / 2 and not s.closed  # not after a poll
  timer.join()
  t.items.append(pb.StreamItem(index=0, value=codec.encode("late")))
  assert next(s) == "late"


def test_a_bad_prefetch_is_refused_naming_it():
  assert consumer.check_prefetch(3) == 3
  with pytest.raises(sidecar.InvalidArgumentError, match="prefetch must be a positive int, got 0"):
    consumer.check_prefetch(0)
  with pytest.raises(sidecar.InvalidArgumentError, match="prefetch must be at most 1024, got 1025"):
    consumer.check_prefetch(1025)  # what a sidecar would refuse, refused before it is asked


def test_the_finalizer_needs_no_module_globals(monkeypatch):
  """At interpreter exit a module's globals may already be None when __del__ runs."""
  stream = consumer.Stream(FakeTransport(), name="count")
  stream._transport = None  # close() then fails, as it would with its modules gone
  for name in ("codec", "errors", "protocol", "time", "pb"):
    monkeypatch.setattr(consumer, name, None)
  stream.__del__()  # raises nothing
  half_made = consumer.Stream.__new__(consumer.Stream)  # as when __init__ failed
  half_made.__del__()
  stream.closed = half_made.closed = True  # the collector's own __del__: nothing to do


def test_a_save_told_goes_with_the_next_credit_once():
  stream = consumer.Stream(FakeTransport(1, 2, 3), name="nums")
  next(stream)
  stream.tell_saved('{"epoch": 0, "position": 4}')
  next(stream)
  next(stream)
  assert stream._transport.credits == [1, 1, 1]
  assert stream._transport.saved == ['{"epoch": 0, "position": 4}']
