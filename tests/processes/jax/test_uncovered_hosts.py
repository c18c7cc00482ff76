"""Issue 55 item 3: one trainer process against sidecars whose hosts declare more devices
than it has (no ``JAX_NUM_CPU_DEVICES``) trained on one device and never fed host 1,
silently. Now its Controller says so at once, naming the variable."""

import os
import subprocess
import sys

import pytest

import sidecar

pytestmark = pytest.mark.processes

TRAINER = """
import logging, sys
import jax, sidecar
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
with sidecar.jax.Controller(sys.argv[1:]) as ctl:
  print("devices", len(jax.devices()), "hosts", len(ctl.hosts))
"""


def _trainer(addresses: list[str], devices: int | None) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS") and not k.startswith("SIDECAR_")}
  env["JAX_PLATFORMS"] = "cpu"
  if devices is not None:
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
  return subprocess.run([sys.executable, "-c", TRAINER, *addresses], env=env,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_a_trainer_whose_devices_miss_a_hosts_is_told_at_once_how_to_fix_it():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2) as cluster:
    short = _trainer(cluster.addresses, None)
    assert short.returncode == 0, short.stderr
    assert "devices 1 hosts 2" in short.stdout
    assert "host 1 declares devices [2, 3]" in short.stderr, short.stderr
    assert "JAX_NUM_CPU_DEVICES=4" in short.stderr, short.stderr
    whole = _trainer(cluster.addresses, 4)
    assert whole.returncode == 0, whole.stderr
    assert "devices 4 hosts 2" in whole.stdout
    assert "declares devices" not in whole.stderr, whole.stderr
