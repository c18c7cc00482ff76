"""The accelerator tier: tests that need the machine's TPU or GPU, run alone, in one process.

Run on an accelerator host (docs/tpu.md): ``pytest -m accelerator tests/accelerator``
(no ``-n``: only one process may open a TPU). The suite's default command never collects
this folder (``testpaths`` in pyproject.toml), and CI has no accelerator.

The other tiers hide every accelerator (tests/conftest.py sets ``JAX_PLATFORMS=cpu`` for the
test process); a run of this tier alone drops that ``cpu``, so the test process gets the
platform JAX picks, as a user's trainer does. Where JAX sees no accelerator, the collection
fails, saying so: these tests on CPU devices would prove nothing about the chip.
``SIDECAR_ACCELERATOR_DRY_RUN=1`` runs them on the CPU all the same, only to check their
code against LocalCluster (``SIDECAR_ACCELERATOR_DRY_RUN=1 pytest -m accelerator
tests/accelerator``).

Order matters, and the tier sets it: the tests whose subprocesses open the chip (the README's
quick start) run first, then the one that opens it in this process only after the
sidecars ran JAX (test_platform.py), then the rest, which use it in this process.
"""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
DRY_RUN = os.environ.get("SIDECAR_ACCELERATOR_DRY_RUN") == "1"
FIRST = ("test_readme.py", "test_launch.py", "test_platform.py")  # before this opens the chip
RUN_ALONE = ("tests/accelerator runs alone, in a pytest process of its own (the other tiers "
             "hide the accelerator with JAX_PLATFORMS=cpu, and only one process may open a "
             "TPU): pytest -m accelerator tests/accelerator")
_alone = False  # this run collects nothing but this folder
DEVICE = pytest.StashKey[dict]()  # what the probe found


def _only_this_folder(config) -> bool:
  where = config.invocation_params.dir
  paths = [pathlib.Path(where, a.split("::")[0]).resolve() for a in config.args]
  return bool(paths) and all(p == HERE or HERE in p.parents for p in paths)


def pytest_configure(config):
  """Runs before any test module is imported (and with it JAX): alone, and not a dry run,
  the test process gets the platform JAX picks."""
  global _alone
  _alone = _only_this_folder(config)
  if _alone and not DRY_RUN and os.environ.get("JAX_PLATFORMS") == "cpu":
    if "jax" in sys.modules:
      raise pytest.UsageError("tests/accelerator: JAX was imported before its conftest could "
                              "drop JAX_PLATFORMS=cpu; " + RUN_ALONE)
    del os.environ["JAX_PLATFORMS"]  # tests/conftest.py set it, for the other tiers


def probe() -> dict[str, str]:
  """The platform JAX picks here, asked in a subprocess: this process must not open the
  chip yet (the README's trainers, in subprocesses, need it first)."""
  code = ("import jax; d = jax.devices()[0]; "
          "print(d.platform, len(jax.devices()), d.device_kind, sep='|')")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  try:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
  except subprocess.TimeoutExpired:
    raise pytest.UsageError("tests/accelerator: asking JAX for its devices took over 300 s "
                            "(another process holding the chip?)") from None
  if done.returncode != 0:
    raise pytest.UsageError(f"tests/accelerator: JAX could not open this machine's devices "
                            f"(another process holding the chip?):\n{done.stderr[-2000:]}")
  platform, count, kind = done.stdout.strip().splitlines()[-1].split("|")
  return {"platform": platform, "count": count, "kind": kind}


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what they do
def pytest_collection_modifyitems(config, items):
  mine = [i for i in items if HERE in i.path.parents]
  if not mine:
    return
  if DRY_RUN:
    config.stash[DEVICE] = {"platform": "cpu", "count": "-", "kind": "dry run"}
  elif not _alone:
    raise pytest.UsageError(RUN_ALONE)
  else:
    found = config.stash[DEVICE] = probe()
    if found["platform"] == "cpu":
      raise pytest.UsageError(
          "tests/accelerator needs an accelerator, and JAX sees none here "
          "(jax.devices()[0].platform is 'cpu'): run it on a TPU or GPU host (docs/tpu.md). "
          "To check its code on this machine all the same: SIDECAR_ACCELERATOR_DRY_RUN=1 "
          "pytest -m accelerator tests/accelerator")
  rank = {name: n for n, name in enumerate(FIRST)}
  items.sort(key=lambda i: rank.get(i.path.name, len(FIRST)) if i in mine else -1)


def pytest_report_collectionfinish(config, start_path, items):
  if DRY_RUN:
    return ["tests/accelerator: a DRY RUN on the CPU (SIDECAR_ACCELERATOR_DRY_RUN=1): it "
            "proves nothing about an accelerator"]
  if (found := config.stash.get(DEVICE, None)) is not None:
    return [f"tests/accelerator on {found['count']} x {found['kind']} ({found['platform']})"]
  return []


@pytest.fixture(scope="session")
def accelerator(request) -> dict[str, str]:
  """What the tier runs on: platform, device count and kind (from the collection's probe)."""
  return request.config.stash[DEVICE]


@pytest.fixture(scope="session", autouse=True)
def copy_pool_started():
  """The process-wide pool of arena copy threads (``shm.copy``), started once before the
  tests: it lives as long as the process, and a 1 GiB save is the first to need it here."""
  import numpy as np

  from sidecar._src.arena import shm
  src = np.ones(2 * shm.COPY_PIECE, np.uint8)
  shm.copy(np.empty_like(src), src)
