"""The benchmark's pipeline, shared by Grain and the sidecars (``--import benchmarks.feed_fns``)."""

import grain
import numpy as np

import sidecar

N = 100_000
_BASE = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)


def noop_element(i):
  return {"image": _BASE, "label": np.int32(i % 10)}


def light_element(i):
  """Make a 224x224x3 uint8 image and lightly augment it (flip, brightness)."""
  img = np.flip(_BASE, axis=int(i) % 2)
  img = np.clip(img.astype(np.int16) + int(i) % 7, 0, 255).astype(np.uint8)
  return {"image": img, "label": np.int32(i % 10)}


ELEMENTS = {"noop": noop_element, "light": light_element}


def dataset(kind: str) -> grain.MapDataset:
  return grain.MapDataset.range(N).map(ELEMENTS[kind])


@sidecar.pipeline
def bench_images(ctx: sidecar.PipelineContext, kind: str = "noop"):
  return dataset(kind)
