"""Tier 1: a Retry's events, without sidecars (a controller that only lists its hosts)."""

import types

import pytest

from sidecar._src.controller.elastic import Event, Retry

pytestmark = pytest.mark.unit


def retry() -> Retry:
  ctl = types.SimpleNamespace(hosts=[types.SimpleNamespace(host_id=h) for h in (0, 1)])
  return Retry(lambda hosts: None, ctl, min_hosts=1, max_restarts=0, watch={})


def test_an_event_noted_is_in_events():
  r = retry()
  event = r.note("phase", detail="restore", seconds=0.5)
  assert r.events == [event]
  assert (event.kind, event.hosts, event.detail, event.seconds) == ("phase", (0, 1), "restore",
                                                                   0.5)


def test_record_warns_and_still_notes():
  """Retry.record was renamed Retry.note (a record is a shard's); the old spelling works
  until 0.4.0."""
  r = retry()
  with pytest.warns(DeprecationWarning, match=r"sidecar.elastic.Retry.record is deprecated "
                                              r"since 0.3.0 and goes in 0.4.0: use Retry.note"):
    event = r.record("phase", detail="feed")
  assert isinstance(event, Event) and r.events == [event]
