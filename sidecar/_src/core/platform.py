"""Which JAX platform each process gets: the sidecar never takes an accelerator, the
trainer keeps its own.

libtpu lets one process open a TPU chip, for that process's whole life; a second process
that opens JAX with ``JAX_PLATFORMS`` unset fails (``RuntimeError: ... libtpu multi-process
lockfile``) and does not fall back to the CPU. So:

- The sidecar, and every process it starts (feed workers), runs JAX on the CPU and sees no
  accelerator, whatever the user set: :func:`sidecar_env` for a process about to start,
  :func:`apply_to_sidecar` for this one (``sidecar serve`` calls it before anything
  imports JAX). :data:`CPU_ONLY` lists what they set. It sets no ``TPU_*`` variable:
  ``TPU_VISIBLE_CHIPS`` and its kin pick which chips a process opens, and we know of no
  documented value that picks none; ``JAX_PLATFORMS=cpu`` keeps JAX from loading libtpu at
  all (a helper process so started runs beside a trainer holding the chip, measured on the
  lent v5e), and ``PJRT_DEVICE=CPU`` keeps torch_xla off it.
- Trainers get the platform JAX would pick (:func:`for_trainers`): nothing is set where an
  accelerator is here, found without opening it (:func:`find_accelerator`: opening it
  would take the chip); CPU device emulation (``JAX_PLATFORMS=cpu`` and
  ``--xla_force_host_platform_device_count``) only where none is. A ``JAX_PLATFORMS`` the
  user set is kept.

Standard library only: the sidecar applies it before it imports anything heavier.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

JAX_PLATFORMS = "JAX_PLATFORMS"
XLA_FLAGS = "XLA_FLAGS"
CPU = "cpu"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# What the sidecar and its processes run with, whatever the user set.
CPU_ONLY: Mapping[str, str] = {
    JAX_PLATFORMS: CPU,          # JAX on the CPU: libtpu, CUDA and ROCm plugins stay unloaded
    "CUDA_VISIBLE_DEVICES": "",  # no GPU for CUDA code in a pipeline (torch, TensorFlow, CuPy)
    "PJRT_DEVICE": "CPU",        # torch_xla on the CPU
}

ROOT = "/"  # where find_accelerator looks by default: tests point it at a fake tree

# The PCI ids of Google's TPU chips, as JAX's own hardware_utils.py lists them.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027": "v3", "0x0056": "plc", "0x005e": "v4", "0x0062": "v5p",
                    "0x0063": "v5e", "0x006f": "v6e", "0x0076": "tpu7x"}
# Variables a Cloud TPU VM or a GKE TPU pod sets for the process that owns the chips.
_TPU_VARS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
             "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS")
_LOOKED_FOR = "/dev/accel*, /dev/vfio/N, a TPU on PCI, TPU_* variables or /dev/nvidiaN"


@dataclasses.dataclass(frozen=True, slots=True)
class Accelerator:
  """An accelerator found here: its kind (``tpu``, ``gpu``) and what showed it."""
  kind: str
  evidence: str


@dataclasses.dataclass(frozen=True, slots=True)
class TrainerPlatform:
  """What a launcher gives its trainers: ``env``, set over their environment, and
  ``summary``, the line it prints first."""
  env: Mapping[str, str]
  summary: str


def sidecar_env(base: Mapping[str, str]) -> dict[str, str]:
  """``base`` with :data:`CPU_ONLY` set over it: the environment of a process the
  sidecar starts, or of a sidecar about to start."""
  return {**base, **CPU_ONLY}


def apply_to_sidecar(environ: MutableMapping[str, str] | None = None) -> None:
  """Sets :data:`CPU_ONLY` in ``environ`` (default ``os.environ``): call it before
  anything imports JAX. A value the user had set otherwise is logged at debug.

  Where JAX is imported already (too late for the variable), sets its ``jax_platforms``
  too, and warns if that cannot be done.
  """
  environ = os.environ if environ is None else environ
  for name, value in CPU_ONLY.items():
    old = environ.get(name)
    if old is not None and old != value:
      log.debug("%s was %r; the sidecar sets %r: it never takes an accelerator, the trainer "
                "keeps it", name, old, value)
    environ[name] = value
  jax = sys.modules.get("jax")
  if jax is not None and environ is os.environ:
    try:
      jax.config.update("jax_platforms", CPU)
    except Exception as e:  # a half-imported or stubbed jax: say so, go on
      log.warning("JAX was imported before the sidecar set JAX_PLATFORMS=cpu, and its "
                  "platform could not be set (%s): it may open an accelerator", e)


def find_accelerator(*, root: str | None = None, environ: Mapping[str, str] | None = None
                     ) -> Accelerator | None:
  """The accelerator this machine shows, found without opening it, or None.

  Looks for TPU device files (``/dev/accel*``, ``/dev/vfio/N``), a TPU chip on the PCI bus
  (``/sys/bus/pci/devices``), the variables a TPU VM or pod sets (``TPU_WORKER_ID``, ...),
  and NVIDIA device files (``/dev/nvidiaN``, unless ``CUDA_VISIBLE_DEVICES`` hides them),
  under ``root`` (default :data:`ROOT`).
  """
  root = ROOT if root is None else root
  environ = os.environ if environ is None else environ
  for pattern in ("dev/accel[0-9]*", "dev/vfio/[0-9]*"):
    found = sorted(glob.glob(os.path.join(root, pattern)))
    if found:
      return Accelerator("tpu", "/" + os.path.relpath(found[0], root))
  chip = _tpu_on_pci(root)
  if chip:
    return Accelerator("tpu", chip)
  for name in _TPU_VARS:
    if environ.get(name):
      return Accelerator("tpu", f"{name}={environ[name]}")
  cuda = environ.get("CUDA_VISIBLE_DEVICES")
  if cuda is None or cuda.strip() not in ("", "-1"):  # "" and -1 hide every GPU
    found = sorted(p for p in glob.glob(os.path.join(root, "dev/nvidia[0-9]*"))
                   if re.fullmatch(r"nvidia\d+", os.path.basename(p)))
    if found:
      return Accelerator("gpu", "/" + os.path.relpath(found[0], root))
  return None


def _tpu_on_pci(root: str) -> str | None:
  """``PCI ADDRESS (TPU VERSION)`` of the first TPU chip on the PCI bus, or None."""
  for vendor in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor"))):
    device = os.path.join(os.path.dirname(vendor), "device")
    try:
      with open(vendor) as v, open(device) as d:
        ids = v.read().strip(), d.read().strip()
    except OSError:
      continue
    if ids[0] == _GOOGLE_PCI_VENDOR and ids[1] in _TPU_PCI_DEVICES:
      return f"PCI {os.path.basename(os.path.dirname(vendor))} (TPU {_TPU_PCI_DEVICES[ids[1]]})"
  return None


def for_trainers(environ: Mapping[str, str], *, devices: int | None,
                 accelerator: Accelerator | None = None, root: str | None = None
                 ) -> TrainerPlatform:
  """The platform trainers started with ``environ`` get.

  Args:
    environ: the launcher's environment, which the trainers inherit.
    devices: CPU devices per trainer where they run on the CPU (None: JAX's own count).
    accelerator: what :func:`find_accelerator` found; default: look now, under ``root``.
    root: where to look (default :data:`ROOT`).
  """
  chosen = environ.get(JAX_PLATFORMS, "").strip()
  if chosen and chosen != CPU:
    return TrainerPlatform({}, f"trainers get JAX_PLATFORMS={chosen}, as set here")
  if not chosen:
    accelerator = accelerator or find_accelerator(root=root, environ=environ)
    if accelerator is not None:
      return TrainerPlatform({}, (
          f"trainers get the platform JAX picks (JAX_PLATFORMS unset): a {accelerator.kind} "
          f"is here ({accelerator.evidence}); the sidecars run JAX on the CPU"))
  env = {} if chosen else {JAX_PLATFORMS: CPU}
  flags = environ.get(XLA_FLAGS, "")
  if devices is not None and DEVICE_COUNT_FLAG not in flags:
    env[XLA_FLAGS] = f"{flags} {DEVICE_COUNT_FLAG}={devices}".strip()
  each = "JAX's own count of CPU devices" if devices is None else f"{devices} CPU devices each"
  why = "as set here" if chosen else f"no accelerator here (none of {_LOOKED_FOR})"
  return TrainerPlatform(env, f"trainers get JAX_PLATFORMS=cpu with {each}: {why}")
