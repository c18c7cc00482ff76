"""JPEG decoding and training augmentation for image pipelines, with no sidecar in sight.

What a vision pipeline does to each record on the host's CPUs: decode a JPEG (Pillow's
libjpeg-turbo; with ``draft`` the decoder itself scales by 1/2, 1/4 or 1/8 where the crop
allows, which is most of a small crop's cost saved), take a random-resized crop (area
8-100% of the image, aspect 3/4-4/3, as Inception and torchvision do), resize it to
``size`` x ``size`` (bilinear), flip it left-right half the time. The result stays uint8:
the trainer normalizes on its device (:data:`MEAN`, :data:`STD`, :func:`normalize`), so a
batch crosses to the accelerator in a quarter of float32's bytes.

Nothing here imports the sidecar: ``pipelines.vision`` (the registered pipeline), the
vision example's Grain baseline and ``benchmarks.feed``'s heavy transform call the same
:func:`decode_augment` (the benchmark on :func:`synthetic_jpeg`'s photo-sized images).
The randomness is an argument: a ``numpy.random.Generator`` made from (seed, image index)
gives the same crop for the same image on any host, in any worker, before and after a
restart.

Example::

  rng = np.random.default_rng([seed, index])
  image = decode_augment(jpeg_bytes, rng, size=224)  # uint8[224, 224, 3]
"""

from __future__ import annotations

import io
import math

import numpy as np

try:
  from PIL import Image
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError("pipelines.images needs Pillow: pip install 'colocated-sidecar[vision]'"
                    ) from e

# ImageNet's per-channel mean and standard deviation, of pixels in [0, 255].
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
SCALE = (0.08, 1.0)  # the crop's share of the image's area
RATIO = (3 / 4, 4 / 3)  # the crop's aspect, width / height


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator
                            ) -> tuple[int, int, int, int]:
  """A crop ``(left, top, right, bottom)`` of a ``width`` x ``height`` image: area a random
  share of :data:`SCALE`, aspect in :data:`RATIO` (log-uniform), placed at random; after ten
  tries that do not fit, the centre crop of the nearest aspect (torchvision's rule)."""
  area = width * height
  log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
  for _ in range(10):
    target = area * rng.uniform(*SCALE)
    aspect = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target * aspect)))
    h = int(round(math.sqrt(target / aspect)))
    if 0 < w <= width and 0 < h <= height:
      left = int(rng.integers(0, width - w + 1))
      top = int(rng.integers(0, height - h + 1))
      return left, top, left + w, top + h
  aspect = width / height
  if aspect < RATIO[0]:
    w, h = width, int(round(width / RATIO[0]))
  elif aspect > RATIO[1]:
    w, h = int(round(height * RATIO[1])), height
  else:
    w, h = width, height
  left, top = (width - w) // 2, (height - h) // 2
  return left, top, left + w, top + h


def decode_augment(jpeg: bytes, rng: np.random.Generator, *, size: int,
                   train: bool = True) -> np.ndarray:
  """``jpeg`` decoded, cropped at random (``train``; else its centre square), resized to
  ``size`` x ``size`` and flipped left-right half the time (``train``): uint8[size, size, 3].

  Raises:
    ValueError: ``jpeg`` is not an image Pillow can read, or ``size`` below 1.
  """
  if size < 1:
    raise ValueError(f"size must be at least 1, got {size!r}")
  try:
    image = Image.open(io.BytesIO(jpeg))
  except Exception as e:  # Pillow's UnidentifiedImageError and friends
    raise ValueError(f"not an image Pillow can decode ({len(jpeg)} bytes): {e}") from None
  width, height = image.size
  if train:
    box = random_resized_crop_box(width, height, rng)
    flip = bool(rng.integers(0, 2))
  else:
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    box, flip = (left, top, left + side, top + side), False
  # Decode at 1/2, 1/4 or 1/8 where the crop keeps at least ``size`` pixels a side: the
  # decoder's own DCT scaling, far cheaper than decoding whole and resizing after.
  crop_w, crop_h = box[2] - box[0], box[3] - box[1]
  scale = 1
  while scale < 8 and min(crop_w, crop_h) // (2 * scale) >= size:
    scale *= 2
  if scale > 1:
    image.draft("RGB", (width // scale, height // scale))
    got = image.size[0] / width
    box = tuple(int(round(v * got)) for v in box)  # type: ignore[assignment]
  resized = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=box)
  out = np.asarray(resized, dtype=np.uint8)
  return np.ascontiguousarray(out[:, ::-1]) if flip else out


def encode(image: np.ndarray, *, quality: int = 90) -> bytes:
  """``image`` (uint8[h, w, 3]) as JPEG bytes, ``quality`` 1-95."""
  out = io.BytesIO()
  Image.fromarray(np.asarray(image, np.uint8), "RGB").save(out, format="JPEG", quality=quality)
  return out.getvalue()


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


def normalize(images, xp=np):
  """uint8 ``images`` [..., 3] as float32 ``(x - MEAN) / STD``; ``xp``: numpy or jax.numpy
  (on the device, where the trainer does it)."""
  mean = xp.asarray(MEAN, dtype=xp.float32)
  std = xp.asarray(STD, dtype=xp.float32)
  return (images.astype(xp.float32) - mean) / std
