"""The platform of real processes: the sidecar and its feed workers run JAX on the CPU
whatever they were given, and `sidecar launch` gives trainers the platform JAX would pick,
CPU devices only where no accelerator is (here there is none: one is faked)."""

import io
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.core import platform
from sidecar._src.tools import launch
from tests.support import platform_fns

pytestmark = pytest.mark.processes

# What a user on an accelerator host may have exported: the sidecar must not take it.
USERS = {"JAX_PLATFORMS": "tpu", "CUDA_VISIBLE_DEVICES": "0", "PJRT_DEVICE": "TPU",
         "SIDECAR_LOG_LEVEL": "DEBUG"}
CPU_ONLY = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "", "PJRT_DEVICE": "CPU"}


def test_the_sidecar_and_its_feed_workers_run_jax_on_the_cpu_whatever_they_were_given():
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with sidecar.testing.LocalCluster(
      num_hosts=1, devices_per_host=1, shm_size="16MiB", imports=["tests.support.platform_fns"],
      host_env={0: USERS}) as cluster, cluster.controller() as ctl:
    # The module that registered it imported jax at the sidecar's start.
    (own,) = [json.loads(r) for r in ctl.call("platform_here")]
    with ctl.feed("platform_rows", global_batch_size=2, sharding=sharding, num_epochs=1,
                  options=sidecar.FeedOptions(workers=1)) as feed:
      workers = [platform_fns.decode(row) for batch in feed for row in np.asarray(batch["report"])]
    log, pid = cluster.log(0), cluster.pid(0)
  assert own["pid"] == pid
  assert (own["env"], own["platforms"]) == (CPU_ONLY, ["cpu"])
  assert len(workers) == 8 and own["pid"] not in {w["pid"] for w in workers}
  assert all((w["env"], w["platforms"]) == (CPU_ONLY, ["cpu"]) for w in workers), workers
  assert "JAX_PLATFORMS was 'tpu'; the sidecar sets 'cpu'" in log


def _without_platform(**extra: str) -> dict[str, str]:
  """This environment as a user's shell on a machine without accelerators, plus ``extra``."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES")
         and not k.startswith("TPU_")}
  return {**env, **extra}


TRAINER = textwrap.dedent("""
    import json, os
    e = os.environ
    got = {n: e.get(n) for n in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if got["JAX_PLATFORMS"] == "cpu":
      import jax
      got["devices"] = [d.platform for d in jax.devices()]
    print("TRAINER " + json.dumps(got), flush=True)
""")


def _trainers(stdout: str) -> list[dict]:
  return [json.loads(line.split("TRAINER ", 1)[1]) for line in stdout.splitlines()
          if "TRAINER " in line]


def test_launch_without_an_accelerator_gives_trainers_cpu_devices_and_says_so_first():
  env = _without_platform()
  if platform.find_accelerator(environ=env) is not None:
    pytest.skip(f"this machine has an accelerator: {platform.find_accelerator(environ=env)}")
  p = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "2",
                      "--devices-per-host", "3", "--shm-size", "8MiB", "--",
                      sys.executable, "-c", TRAINER], env=env, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stderr
  assert p.stderr.splitlines()[0] == (
      "sidecar launch: trainers get JAX_PLATFORMS=cpu with 3 CPU devices each: no accelerator "
      "here (none of /dev/accel*, /dev/vfio/N, a TPU on PCI, TPU_* variables or /dev/nvidiaN)")
  assert _trainers(p.stdout) == [{"JAX_PLATFORMS": "cpu", "XLA_FLAGS":
                                  "--xla_force_host_platform_device_count=3",
                                  "devices": ["cpu"] * 3}] * 2


@pytest.mark.parametrize("extra, first, seen", [
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"},
     "trainers get the platform JAX picks (JAX_PLATFORMS unset): a tpu is here "
     "(TPU_ACCELERATOR_TYPE=v5litepod-1); the sidecars run JAX on the CPU",
     {"JAX_PLATFORMS": None, "XLA_FLAGS": None}),
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-1", "JAX_PLATFORMS": "cuda"},
     "trainers get JAX_PLATFORMS=cuda, as set here", {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": None}),
], ids=["tpu-variables", "users-own"])
def test_launch_on_a_tpu_host_sets_no_platform_for_trainers_unless_the_user_did(extra, first,
                                                                                seen):
  p = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size",
                      "8MiB", "--", sys.executable, "-c", TRAINER], env=_without_platform(**extra),
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert p.stderr.splitlines()[0] == f"sidecar launch: {first}"
  assert _trainers(p.stdout) == [seen]


def test_launch_finds_a_tpu_by_its_device_files(tmp_path, monkeypatch):
  (tmp_path / "dev" / "vfio").mkdir(parents=True)
  (tmp_path / "dev" / "vfio" / "0").touch()  # a v5e host's chip, bound to vfio
  monkeypatch.setattr(platform, "ROOT", str(tmp_path))
  for name in ("JAX_PLATFORMS", "XLA_FLAGS"):
    monkeypatch.delenv(name, raising=False)
  out, err = io.BytesIO(), io.StringIO()
  code = launch.run([sys.executable, "-c", TRAINER], hosts=1, shm_size="8MiB", stdout=out,
                    stderr=err)
  assert code == 0, err.getvalue()
  assert err.getvalue().splitlines()[0] == (
      "sidecar launch: trainers get the platform JAX picks (JAX_PLATFORMS unset): a tpu is here "
      "(/dev/vfio/0); the sidecars run JAX on the CPU")
  assert _trainers(out.getvalue().decode()) == [{"JAX_PLATFORMS": None, "XLA_FLAGS": None}]
