"""--log-format json: one JSON object a line, with host id, session and step."""

import json
import logging
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
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


@pytest.mark.processes
def test_sidecar_serve_logs_json_with_host_session_and_step(tmp_path):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    extra_args=["--log-format", "json", "--host-id", "0"]) as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      ckpt.save(4, {"w": jax.device_put(np.ones(1024, np.float32), sharding)})
      ckpt.wait()
    text = c.log(0)
  records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
  assert all({"time", "level", "logger", "message"} <= r.keys() and r["host_id"] == 0
             for r in records)
  assert any(r.get("session", "").startswith("w-") and "attached" in r["message"]
             for r in records), records
  assert any(r.get("step") == 4 and "wrote" in r["message"] for r in records), records
  assert sum(r["message"].startswith("sidecar host 0 serving on 127.0.0.1:") for r in records) == 1
