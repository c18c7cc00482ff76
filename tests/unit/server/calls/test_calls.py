"""Tier 1: how a call, stream or feed is counted (server/calls/calls.measured), with a Recorder
that keeps what it was told."""

import pytest

from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.calls import calls

pytestmark = pytest.mark.unit


class Kept(metrics_lib.Recorder):
  enabled = True

  def __init__(self):
    self.done: list[tuple[str, str, str]] = []

  def call_done(self, kind, name, code, seconds):
    self.done.append((kind, name, code))


def _items(recorder: Kept, kind: str):
  with calls.measured(recorder, kind, "ids"):
    yield from range(100)


@pytest.mark.parametrize("kind,code", [("feed", "OK"), ("stream", "CANCELLED")],
                         ids=["feed", "stream"])
def test_a_consumer_that_closes_mid_way_ends_a_feed_ok_and_cancels_a_stream(kind, code):
  # Before: a feed its trainer closed (the end of its `with`) counted as
  # sidecar_calls_total{code="CANCELLED"}, as if something had gone wrong.
  recorder = Kept()
  items = _items(recorder, kind)
  assert [next(items), next(items)] == [0, 1]
  items.close()
  assert recorder.done == [(kind, "ids", code)]


def test_an_error_counts_under_its_code():
  recorder = Kept()
  with pytest.raises(errors.NotRegisteredError):
    with calls.measured(recorder, "feed", "ids"):
      raise errors.NotRegisteredError("no pipeline ids")
  assert recorder.done == [("feed", "ids", "NOT_FOUND")]
