"""The image transform: the same example for the same seed, crops inside the image, normalized."""

import io

import numpy as np
import pytest
from PIL import Image

from pipelines import _images

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def jpeg():
  return _images.synthetic_jpeg(np.random.default_rng(1), width=200, height=150)


def test_a_training_example_is_the_same_for_its_seed_and_another_for_another(jpeg):
  a = _images.train_example(jpeg, seed=(0, 7), size=64)
  assert a.shape == (64, 64, 3) and a.dtype == np.float32
  np.testing.assert_array_equal(a, _images.train_example(jpeg, seed=(0, 7), size=64))
  assert not np.array_equal(a, _images.train_example(jpeg, seed=(0, 8), size=64))
  # normalized: a uint8 image's channels land within (0 - mean) / std .. (255 - mean) / std
  assert (a >= -_images.MEAN / _images.STD - 1e-5).all()
  assert (a <= (255 - _images.MEAN) / _images.STD + 1e-5).all()


def test_crops_lie_inside_the_image_within_the_scale_and_ratio_or_are_the_centre():
  rng = np.random.default_rng(0)
  for _ in range(200):
    left, top, right, bottom = _images.crop_box(200, 150, rng)
    assert 0 <= left < right <= 200 and 0 <= top < bottom <= 150
    share = (right - left) * (bottom - top) / (200 * 150)
    assert _images.SCALE[0] * 0.9 <= share <= 1.0
  # So thin that no draw fits: the centre crop of the nearest allowed ratio.
  assert _images.crop_box(1000, 10, rng) == (493, 0, 506, 10)


def test_an_eval_example_is_the_centre_crop_normalized(jpeg):
  a = _images.eval_example(jpeg, size=32)
  with Image.open(io.BytesIO(jpeg)) as img:
    rgb = img.convert("RGB")
  side = round(150 * 0.875)
  box = ((200 - side) // 2, (150 - side) // 2, (200 - side) // 2 + side, (150 - side) // 2 + side)
  want = _images.normalize(np.asarray(rgb.resize((32, 32), Image.Resampling.BILINEAR, box=box)))
  np.testing.assert_array_equal(a, want)
  with Image.open(io.BytesIO(jpeg)) as img:
    assert (img.format, img.size) == ("JPEG", (200, 150))
