"""Registered code that reports the platform the sidecar's processes run with
(``--import tests.support.platform_fns``; tests/processes/core/test_platform.py).

It imports JAX when imported, as a user's module may: the sidecar must have put JAX on
the CPU before it loads this."""

import json
import os

import grain
import jax
import numpy as np

import sidecar

NAMES = ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "PJRT_DEVICE")
WIDTH = 512  # bytes of a report row


def report() -> dict:
  """This process: its pid, the variables that pick a platform, and what JAX sees."""
  return {"pid": os.getpid(), "env": {n: os.environ.get(n) for n in NAMES},
          "platforms": sorted({d.platform for d in jax.devices()})}


@sidecar.function
def platform_here() -> str:
  """The sidecar's report, as JSON."""
  return json.dumps(report())


@sidecar.pipeline
def platform_rows(ctx: sidecar.PipelineContext, n: int = 8):
  """Rows of the report of the process that makes them (a feed worker, with workers=N)."""
  def element(i):
    text = json.dumps(report()).encode()
    return {"report": np.frombuffer(text.ljust(WIDTH), np.uint8)}
  return grain.MapDataset.range(n).map(element)


def decode(row: np.ndarray) -> dict:
  return json.loads(bytes(np.asarray(row, np.uint8)).rstrip())
