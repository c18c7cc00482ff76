"""The benchmark pipeline's elements, with numpy (and Pillow, for ``heavy``) alone.

By ``kind``: ``noop`` (one fixed 224x224x3 uint8 image: transport alone), ``light`` (the
image flipped and brightened: numpy only) and ``heavy`` (a JPEG read from a directory of
:func:`write_jpegs`, decoded, random-resized-cropped and flipped, uint8: the vision
example's transform, ``pipelines.images``, which normalizes on the device). Grain is not
imported here, so a process that only makes elements (``benchmarks.feed``'s processes with
no transport) starts in a fraction of a second; ``feed_fns`` makes the Grain dataset of them.
"""

import os

import numpy as np

N = 100_000
_BASE = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
JPEGS = 32  # distinct images the heavy transform cycles through


def noop_element(i):
  return {"image": _BASE, "label": np.int32(i % 10)}


def light_element(i):
  """Make a 224x224x3 uint8 image and lightly augment it (flip, brightness)."""
  img = np.flip(_BASE, axis=int(i) % 2)
  img = np.clip(img.astype(np.int16) + int(i) % 7, 0, 255).astype(np.uint8)
  return {"image": img, "label": np.int32(i % 10)}


class HeavyElement:
  """Reads JPEG ``i % JPEGS`` of ``jpegs`` and makes a training image of it (uint8
  224x224x3), its random choices seeded by ``i``: the same image each time ``i`` is read."""

  def __init__(self, jpegs: str):
    self.jpegs = jpegs

  def __call__(self, i):
    from pipelines import images  # Pillow: only where the heavy transform runs

    with open(os.path.join(self.jpegs, f"{int(i) % JPEGS}.jpg"), "rb") as f:
      data = f.read()
    image = images.decode_augment(data, np.random.default_rng(int(i)), size=224)
    return {"image": image, "label": np.int32(i % 10)}


def write_jpegs(directory: str, count: int = JPEGS) -> str:
  """``count`` made-up photo-sized JPEGs in ``directory`` (``0.jpg``...): the heavy
  transform's input. Returns ``directory``."""
  from pipelines import images

  rng = np.random.default_rng(0)
  for i in range(count):
    with open(os.path.join(directory, f"{i}.jpg"), "wb") as f:
      f.write(images.synthetic_jpeg(rng))
  return directory


def element_fn(kind: str, jpegs: str | None = None):
  """Element ``i`` of the pipeline of ``kind``, as a function of ``i``."""
  if kind == "heavy":
    if not jpegs:
      raise ValueError("the heavy transform reads JPEGs: pass jpegs=<a directory of "
                       "write_jpegs()>")
    return HeavyElement(jpegs)
  return {"noop": noop_element, "light": light_element}[kind]


def batch_of(elements):
  """The batch of ``elements`` as a sidecar worker makes it: each leaf stacked."""
  return {k: np.stack([e[k] for e in elements]) for k in elements[0]}
