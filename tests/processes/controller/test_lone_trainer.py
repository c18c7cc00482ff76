"""Tier 3: one trainer process beside a sidecar that declares no devices, as the manifests
for one host start it (no --device-ids) with a trainer that does not use jax.distributed:
its first save used to fail (issue 35 item 10)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import sidecar
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

_TRAINER = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import sidecar
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    state = {"w": jax.device_put(jnp.arange(4096, dtype=jnp.float32), rows)}
    with sidecar.jax.Worker() as w, sidecar.jax.Controller([sys.argv[1]], workers={0: w}) as ctl:
      with ctl.checkpointer(sys.argv[2]) as ckpt:
        ckpt.save(1, state).durable.result(60)
        back = ckpt.restore(1, target=state)
      print("RESULT " + json.dumps({"devices": sorted(ctl.device_hosts),
                                    "same": bool((back["w"] == state["w"]).all())}))
""")


def test_a_lone_trainer_without_jax_distributed_saves_beside_a_sidecar_without_device_ids(
    tmp_path):
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=2, shm_size="16MiB",
                                    configure_jax=False, assign_device_ids=False) as c:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    environ.update(JAX_PLATFORMS="cpu", SIDECAR_ADDRESS=f"unix://{c.socket(0)}")
    done = subprocess.run([sys.executable, "-c", _TRAINER, c.addresses[0], str(tmp_path / "ck")],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
  # Before: InvalidArgumentError: leaf 'w' has a shard on device 0, which no sidecar host
  # declares (sidecar serve --device-ids).
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
  assert json.loads(line[len("RESULT "):]) == {"devices": [0, 1], "same": True}
