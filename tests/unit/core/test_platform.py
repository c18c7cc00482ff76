"""core/platform.py: the sidecar's processes on the CPU, trainers on what JAX would pick,
an accelerator found in a fake machine's /dev, /sys and environment, never opened."""

import logging
import os
import re

import pytest

from sidecar._src.core import platform

pytestmark = pytest.mark.unit

V5E_PCI = {"sys/bus/pci/devices/0000:00:04.0/vendor": "0x1ae0\n",
           "sys/bus/pci/devices/0000:00:04.0/device": "0x0063\n"}
GVNIC_PCI = {"sys/bus/pci/devices/0000:00:05.0/vendor": "0x1ae0\n",  # Google's, not a TPU
             "sys/bus/pci/devices/0000:00:05.0/device": "0x0042\n"}


def machine(tmp_path, files: dict[str, str]) -> str:
  """A fake root holding ``files`` (path under the root: content)."""
  root = tmp_path / "root"
  root.mkdir()
  for path, text in files.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
  return str(root)


@pytest.mark.parametrize("files, environ, found", [
    ({}, {}, None),
    ({"dev/accel0": "", "dev/accel1": ""}, {}, platform.Accelerator("tpu", "/dev/accel0")),
    ({"dev/vfio/0": "", "dev/vfio/vfio": ""}, {}, platform.Accelerator("tpu", "/dev/vfio/0")),
    ({"dev/vfio/vfio": ""}, {}, None),  # the vfio module alone: no device bound to it
    (V5E_PCI, {}, platform.Accelerator("tpu", "PCI 0000:00:04.0 (TPU v5e)")),
    (GVNIC_PCI, {}, None),
    ({}, {"TPU_ACCELERATOR_TYPE": "v5litepod-1"},
     platform.Accelerator("tpu", "TPU_ACCELERATOR_TYPE=v5litepod-1")),
    ({}, {"TPU_WORKER_ID": ""}, None),
    ({"dev/nvidia0": "", "dev/nvidiactl": ""}, {}, platform.Accelerator("gpu", "/dev/nvidia0")),
    ({"dev/nvidiactl": "", "dev/nvidia-uvm": ""}, {}, None),
    ({"dev/nvidia0": ""}, {"CUDA_VISIBLE_DEVICES": ""}, None),
    ({"dev/nvidia0": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"dev/nvidia0": ""}, {"CUDA_VISIBLE_DEVICES": "1"},
     platform.Accelerator("gpu", "/dev/nvidia0")),
], ids=["nothing", "tpu-accel", "tpu-vfio", "vfio-alone", "tpu-pci", "google-nic",
        "tpu-variable", "tpu-variable-empty", "nvidia", "nvidia-control-only",
        "nvidia-hidden", "nvidia-hidden-minus-1", "nvidia-one-visible"])
def test_an_accelerator_is_found_by_its_files_and_variables_without_opening_it(
    tmp_path, files, environ, found):
  assert platform.find_accelerator(root=machine(tmp_path, files), environ=environ) == found


def test_the_default_root_is_the_module_constant(tmp_path, monkeypatch):
  monkeypatch.setattr(platform, "ROOT", machine(tmp_path, {"dev/accel3": ""}))
  assert platform.find_accelerator(environ={}) == platform.Accelerator("tpu", "/dev/accel3")


FLAG = "--xla_force_host_platform_device_count"


@pytest.mark.parametrize("environ, files, devices, env, says", [
    ({}, {}, 2, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{FLAG}=2"},
     r"^trainers get JAX_PLATFORMS=cpu with 2 CPU devices each: no accelerator here \(none "
     r"of /dev/accel\*, /dev/vfio/N, a TPU on PCI, TPU_\* variables or /dev/nvidiaN\)$"),
    ({"JAX_PLATFORMS": " "}, {}, None, {"JAX_PLATFORMS": "cpu"},
     r"JAX_PLATFORMS=cpu with JAX's own count of CPU devices: no accelerator here"),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/d"}, {}, 4,
     {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to=/tmp/d {FLAG}=4"}, "4 CPU devices"),
    ({}, {"dev/accel0": ""}, 2, {},
     r"^trainers get the platform JAX picks \(JAX_PLATFORMS unset\): a tpu is here "
     r"\(/dev/accel0\); the sidecars run JAX on the CPU$"),
    ({}, {"dev/nvidia0": ""}, 2, {}, r"a gpu is here \(/dev/nvidia0\)"),
    ({"JAX_PLATFORMS": "cuda"}, {}, 2, {}, r"^trainers get JAX_PLATFORMS=cuda, as set here$"),
    ({"JAX_PLATFORMS": "tpu"}, {"dev/accel0": ""}, 2, {}, "JAX_PLATFORMS=tpu, as set here"),
    ({"JAX_PLATFORMS": "cpu"}, {"dev/accel0": ""}, 2, {"XLA_FLAGS": f"{FLAG}=2"},
     r"^trainers get JAX_PLATFORMS=cpu with 2 CPU devices each: as set here$"),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{FLAG}=8"}, {}, 2, {}, "as set here"),
], ids=["none", "none-blank-own-count", "none-other-xla-flags", "tpu", "gpu", "users-cuda",
        "users-tpu", "users-cpu-on-a-tpu", "users-cpu-and-count"])
def test_trainers_get_what_jax_would_pick_and_cpu_devices_only_without_an_accelerator(
    tmp_path, environ, files, devices, env, says):
  got = platform.for_trainers(environ, devices=devices, root=machine(tmp_path, files))
  assert dict(got.env) == env
  assert re.search(says, got.summary), got.summary


def test_an_accelerator_found_before_is_used_as_is(tmp_path):
  gpu = platform.Accelerator("gpu", "/dev/nvidia7")
  got = platform.for_trainers({}, devices=1, accelerator=gpu, root=machine(tmp_path, {}))
  assert (dict(got.env), "(/dev/nvidia7)" in got.summary) == ({}, True)


def test_the_sidecar_env_overrides_what_the_user_set_and_keeps_the_rest():
  user = {"JAX_PLATFORMS": "tpu", "CUDA_VISIBLE_DEVICES": "0,1", "PJRT_DEVICE": "TPU",
          "HOME": "/home/u"}
  assert platform.sidecar_env(user) == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "",
                                        "PJRT_DEVICE": "CPU", "HOME": "/home/u"}
  assert user["JAX_PLATFORMS"] == "tpu"  # a copy


def test_applying_it_logs_an_override_at_debug_and_leaves_jax_alone_for_another_mapping(
    caplog):
  environ = {"JAX_PLATFORMS": "tpu", "PJRT_DEVICE": "CPU"}
  before = os.environ.get("JAX_PLATFORMS")
  with caplog.at_level(logging.DEBUG, logger=platform.__name__):
    platform.apply_to_sidecar(environ)
  assert environ == dict(platform.CPU_ONLY)
  messages = [r.getMessage() for r in caplog.records]
  assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # PJRT_DEVICE was CPU already
  assert "JAX_PLATFORMS was 'tpu'; the sidecar sets 'cpu'" in messages[0]
  assert os.environ.get("JAX_PLATFORMS") == before
