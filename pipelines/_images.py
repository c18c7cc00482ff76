"""Image classification input on the host's CPUs: JPEG decode, random-resized crop, flip, normalize.

What an ImageNet-style training pipeline does to each example, in one place, for every
pipeline that trains on images (the vision example's) and for ``benchmarks.feed``'s
``heavy`` transform: the two measure the same work. Pillow decodes (libjpeg-turbo, in
its wheels) and crops and resizes in one pass (``Image.resize(box=...)``); numpy flips
and normalizes. Every random choice comes from the seed the caller passes (derive it
from the feed's seed and the example's index), so an example is the same each time it
is read: a feed resumed from its state, or a step re-done, sees the same batch.

Example::

  image = train_example(jpeg_bytes, seed=(feed_seed, index))  # float32 [224, 224, 3]
"""

from __future__ import annotations

import io
import math

import numpy as np

try:
  from PIL import Image
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError("image pipelines need Pillow: pip install 'colocated-sidecar[vision]'") from e

SIZE = 224
# The ImageNet channel statistics torchvision's and Flax's examples normalize with, in 0-255.
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255
SCALE = (0.08, 1.0)  # RandomResizedCrop's: the crop's share of the image's area
RATIO = (3 / 4, 4 / 3)  # and its aspect ratio (width / height), drawn log-uniformly


def crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
  """A random-resized crop of a ``width`` x ``height`` image: (left, top, right, bottom).

  torchvision's ``RandomResizedCrop``: up to 10 draws of an area share in ``SCALE`` and an
  aspect ratio in ``RATIO``; where none fits, the centre crop of the nearest ratio.
  """
  area = width * height
  log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
  for _ in range(10):
    target = area * rng.uniform(*SCALE)
    ratio = math.exp(rng.uniform(*log_ratio))
    w = round(math.sqrt(target * ratio))
    h = round(math.sqrt(target / ratio))
    if 0 < w <= width and 0 < h <= height:
      left = int(rng.integers(0, width - w + 1))
      top = int(rng.integers(0, height - h + 1))
      return left, top, left + w, top + h
  ratio = width / height
  if ratio < RATIO[0]:
    w, h = width, round(width / RATIO[0])
  elif ratio > RATIO[1]:
    w, h = round(height * RATIO[1]), height
  else:
    w, h = width, height
  left, top = (width - w) // 2, (height - h) // 2
  return left, top, left + w, top + h


def normalize(image: np.ndarray) -> np.ndarray:
  """uint8 HWC RGB -> float32, each channel less its ImageNet mean, over its deviation."""
  return (image.astype(np.float32) - MEAN) / STD


def train_example(jpeg: bytes, *, seed: int | tuple[int, ...], size: int = SIZE) -> np.ndarray:
  """One training image: decoded, a random-resized crop resized to ``size`` x ``size``,
  flipped left-right half the time, normalized: float32 ``[size, size, 3]``."""
  rng = np.random.default_rng(seed)
  with Image.open(io.BytesIO(jpeg)) as file:
    img = file.convert("RGB")  # decodes (a greyscale or CMYK JPEG becomes RGB)
  box = crop_box(img.width, img.height, rng)
  out = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=box))
  if rng.random() < 0.5:
    out = out[:, ::-1]
  return normalize(out)


def eval_example(jpeg: bytes, *, size: int = SIZE) -> np.ndarray:
  """One evaluation image: the centre crop of 87.5% of the shorter side, resized to ``size``
  x ``size``, normalized: float32 ``[size, size, 3]``."""
  with Image.open(io.BytesIO(jpeg)) as file:
    img = file.convert("RGB")
  side = round(min(img.width, img.height) * 0.875)
  left, top = (img.width - side) // 2, (img.height - side) // 2
  out = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR,
                              box=(left, top, left + side, top + side)))
  return normalize(out)


def synthetic_jpeg(rng: np.random.Generator, *, width: int = 500, height: int = 375,
                   quality: int = 90) -> bytes:
  """A JPEG of a made-up photo-like image (smooth colour fields, edges, noise), as costly to
  decode as a real one of its size: ImageNet's images average about 500 x 375 at this
  quality."""
  y, x = np.mgrid[0:height, 0:width].astype(np.float32)
  channels = []
  for _ in range(3):
    fx, fy, phase = rng.uniform(0.005, 0.05, 2).tolist() + [rng.uniform(0, 2 * np.pi)]
    channels.append(128 + 90 * np.sin(fx * x + fy * y + phase))
  image = np.stack(channels, axis=-1)
  # A few hard-edged shapes, then noise, so the DCT blocks hold detail as a photo's do.
  for _ in range(6):
    x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
    w, h = int(rng.integers(20, width // 2)), int(rng.integers(20, height // 2))
    image[y0:y0 + h, x0:x0 + w] = rng.uniform(0, 255, 3)
  image += rng.normal(0, 12, image.shape)
  out = io.BytesIO()
  Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=quality)
  return out.getvalue()
