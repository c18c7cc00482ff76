"""Writes the vision example's images: synthetic JPEGs whose label a model can learn.

  python examples/vision/prepare.py --out /tmp/vision-data [--images 8192] [--size 320]

Class ``c`` of ``--classes`` is a colour (``c % 8`` picks one of a palette) and a shape
(``c // 8``: disc, square, triangle, cross, ring), drawn at a random place and size (a fifth
to a half of the image) over a noisy two-colour gradient, then encoded as a JPEG of
``--size`` x ``--size`` pixels at ``--quality``: real files for a real decoder. The same
``--seed`` writes the same images (image ``i`` from ``default_rng([seed, i])``); ``--jobs``
processes draw and encode them. ArrayRecord shards with a manifest
(``pipelines.vision.write_images``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import pathlib
import sys
import time
from collections.abc import Iterator

import numpy as np

# Run as a script from the repository root: the repository's pipelines package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from pipelines import images, vision  # noqa: E402

SHAPES = ("disc", "square", "triangle", "cross", "ring")
PALETTE = ((220, 40, 40), (40, 170, 60), (50, 80, 220), (230, 200, 30), (200, 60, 200),
           (30, 200, 200), (240, 130, 20), (250, 250, 250))
MAX_CLASSES = len(SHAPES) * len(PALETTE)


def draw(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
  """Image of class ``label``: uint8[size, size, 3]."""
  shape, colour = SHAPES[label // len(PALETTE)], np.array(PALETTE[label % len(PALETTE)])
  yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
  a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
  angle = rng.uniform(0, 2 * np.pi)
  t = (np.cos(angle) * xx + np.sin(angle) * yy)[..., None]
  t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
  image = a * (1 - t) + b * t + rng.normal(0, 18, (size, size, 3))
  r = rng.uniform(0.1, 0.25)
  cx, cy = rng.uniform(r, 1 - r, 2)
  dx, dy = xx - cx, yy - cy
  if shape == "disc":
    mask = dx * dx + dy * dy < r * r
  elif shape == "square":
    mask = (np.abs(dx) < r) & (np.abs(dy) < r)
  elif shape == "triangle":
    mask = (dy > -r) & (dy < r) & (np.abs(dx) < (dy + r) / 2)
  elif shape == "cross":
    mask = ((np.abs(dx) < r / 3) & (np.abs(dy) < r)) | ((np.abs(dy) < r / 3) & (np.abs(dx) < r))
  else:
    d = dx * dx + dy * dy
    mask = (d < r * r) & (d > (r / 2) ** 2)
  shade = colour * rng.uniform(0.8, 1.0) + rng.normal(0, 8, (size, size, 3))
  image[mask] = shade[mask]
  return np.clip(image, 0, 255).astype(np.uint8)


def make(i: int, *, seed: int, classes: int, size: int, quality: int) -> tuple[bytes, int]:
  """Image ``i``: its JPEG bytes and label."""
  rng = np.random.default_rng([seed, i])
  label = int(rng.integers(0, classes))
  return images.encode(draw(label, size, rng), quality=quality), label


def _chunk(start: int, stop: int, **kw) -> list[tuple[bytes, int]]:
  return [make(i, **kw) for i in range(start, stop)]


def generate(count: int, *, jobs: int, **kw) -> Iterator[tuple[bytes, int]]:
  """Images ``0 .. count - 1`` in order, made by ``jobs`` processes (1: this one)."""
  if jobs <= 1:
    for i in range(count):
      yield make(i, **kw)
    return
  step = 256
  with concurrent.futures.ProcessPoolExecutor(
      jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
    parts = [pool.submit(_chunk, s, min(s + step, count), **kw) for s in range(0, count, step)]
    for part in parts:
      yield from part.result()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="directory to write the images in")
  parser.add_argument("--images", type=int, default=8192, help="how many")
  parser.add_argument("--classes", type=int, default=10,
                      help=f"how many classes (at most {MAX_CLASSES})")
  parser.add_argument("--size", type=int, default=320, help="pixels a side of each JPEG")
  parser.add_argument("--quality", type=int, default=90, help="JPEG quality, 1-95")
  parser.add_argument("--seed", type=int, default=0, help="what the images are drawn from")
  parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                      help="processes drawing and encoding")
  args = parser.parse_args(argv)
  if not 2 <= args.classes <= MAX_CLASSES:
    parser.error(f"--classes must be in [2, {MAX_CLASSES}], got {args.classes}")
  if args.images < 1 or args.size < 8:
    parser.error("--images must be at least 1 and --size at least 8")
  t0 = time.perf_counter()
  kw = {"seed": args.seed, "classes": args.classes, "size": args.size,
        "quality": args.quality}
  manifest = vision.write_images(args.out, generate(args.images, jobs=args.jobs, **kw),
                                 num_classes=args.classes, image_size=args.size)
  print(f"wrote {manifest.count:,} JPEGs of {args.size}x{args.size} ({args.classes} classes, "
        f"{manifest.jpeg_bytes / manifest.count / 1024:.1f} KiB each) in "
        f"{len(manifest.shards)} shard(s) to {args.out} in {time.perf_counter() - t0:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
