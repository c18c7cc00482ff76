"""pipelines.images' made-up photos: real JPEGs of their size, the same for the same seed."""

import io

import numpy as np
import pytest
from PIL import Image

from pipelines import images

pytestmark = pytest.mark.unit


def test_a_synthetic_jpeg_is_a_jpeg_of_its_size_and_the_same_for_the_same_seed():
  a = images.synthetic_jpeg(np.random.default_rng(1), width=200, height=150)
  with Image.open(io.BytesIO(a)) as img:
    assert (img.format, img.size) == ("JPEG", (200, 150))
  assert a == images.synthetic_jpeg(np.random.default_rng(1), width=200, height=150)
  assert a != images.synthetic_jpeg(np.random.default_rng(2), width=200, height=150)
  # decoded and augmented as the heavy transform does: uint8 at the size asked
  out = images.decode_augment(a, np.random.default_rng(0), size=64)
  assert out.shape == (64, 64, 3) and out.dtype == np.uint8
