"""--log-format json: one JSON object a line, with host id, session and step."""

import json
import logging
import sys

import pytest

from sidecar._src.core import logs

pytestmark = pytest.mark.unit


def record(msg: str, *args, **extra) -> logging.LogRecord:
  r = logging.LogRecord("sidecar.x", logging.WARNING, __file__, 1, msg, args, None)
  r.__dict__.update(extra)
  return r


def test_json_formatter_fields():
  out = json.loads(logs.JsonFormatter(host_id=3).format(record("step %d: %s", 7, "ok", step=7)))
  assert out.pop("time").endswith("Z")
  assert out == {"level": "WARNING", "logger": "sidecar.x", "message": "step 7: ok",
                 "host_id": 3, "step": 7}
  try:
    raise ValueError("boom")
  except ValueError:
    r = logging.LogRecord("a", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
  assert "ValueError: boom" in json.loads(logs.JsonFormatter().format(r))["exception"]


def test_unknown_format_is_refused():
  with pytest.raises(ValueError, match="log format must be one of text, json, got 'xml'"):
    logs.configure("xml")
