"""``sidecar serve --log-format json``: every line JSON, with host id, session and step."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar

pytestmark = pytest.mark.processes


def test_sidecar_serve_logs_json_with_host_session_and_step(tmp_path):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    extra_args=["--log-format", "json", "--host-id", "0"]) as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      ckpt.save(4, {"w": jax.device_put(np.ones(1024, np.float32), sharding)})
      ckpt.wait()
    text, address = c.log(0), c.addresses[0]
  records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
  assert all({"time", "level", "logger", "message"} <= r.keys() and r["host_id"] == 0
             for r in records)
  assert any(r.get("session", "").startswith("w-") and "attached" in r["message"]
             for r in records), records
  assert any(r.get("step") == 4 and "wrote" in r["message"] for r in records), records
  assert sum(r["message"].startswith(f"sidecar host 0 serving on {address} ")
             for r in records) == 1
