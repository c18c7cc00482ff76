"""The benchmark's pipeline, shared by Grain and the sidecars (``--import benchmarks.feed_fns``):
the elements of ``feed_elements`` as a Grain ``MapDataset``."""

import grain

import sidecar
from benchmarks import feed_elements


def dataset(kind: str, jpegs: str | None = None) -> grain.MapDataset:
  return grain.MapDataset.range(feed_elements.N).map(feed_elements.element_fn(kind, jpegs))


@sidecar.pipeline
def bench_images(ctx: sidecar.PipelineContext, kind: str = "noop", jpegs: str | None = None):
  return dataset(kind, jpegs)
