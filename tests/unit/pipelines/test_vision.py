"""pipelines.images (decode and augment, no sidecar) and pipelines.vision (the records,
the pipeline's elements, the data's identity), on JPEGs made here."""

import hashlib
import io

import numpy as np
import pytest

from pipelines import images, vision
from sidecar._src.user.pipeline_context import PipelineContext

pytestmark = pytest.mark.unit


def picture(h=96, w=128, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def jpeg():
  return images.encode(picture())


def test_decode_augment_makes_a_uint8_square_of_size(jpeg):
  out = images.decode_augment(jpeg, np.random.default_rng(0), size=24)
  assert out.shape == (24, 24, 3) and out.dtype == np.uint8 and out.flags.c_contiguous


def test_the_same_generator_makes_the_same_crop_and_another_another(jpeg):
  a, b, c = (images.decode_augment(jpeg, np.random.default_rng(s), size=24) for s in (1, 1, 2))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_without_train_it_is_the_centre_square_resized(jpeg):
  decoded = images.decode_augment(jpeg, np.random.default_rng(0), size=96, train=False)
  from PIL import Image
  whole = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
  # the centre 96x96 of 96x128, at the same size: the decoder's pixels themselves
  np.testing.assert_array_equal(decoded, whole[:, 16:112])


@pytest.mark.parametrize("w,h", [(128, 96), (40, 400), (400, 40), (3, 3)],
                         ids=["landscape", "tall", "wide", "tiny"])
def test_crop_boxes_lie_in_the_image_within_the_scale_and_ratio(w, h):
  rng = np.random.default_rng(0)
  for _ in range(200):
    left, top, right, bottom = images.random_resized_crop_box(w, h, rng)
    assert 0 <= left < right <= w and 0 <= top < bottom <= h
    cw, ch = right - left, bottom - top
    if (w, h) == (128, 96):  # room for every ratio: each box within both bounds
      assert images.SCALE[0] * w * h * 0.8 <= cw * ch <= w * h
      assert images.RATIO[0] * 0.9 <= cw / ch <= images.RATIO[1] * 1.1


def test_the_decoder_scales_down_where_the_crop_allows(monkeypatch):
  big = images.encode(picture(512, 512))
  from PIL import JpegImagePlugin
  drafts = []
  real = JpegImagePlugin.JpegImageFile.draft
  monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft",
                      lambda self, mode, size: drafts.append(size) or real(self, mode, size))
  out = images.decode_augment(big, np.random.default_rng(0), size=32, train=False)
  assert drafts == [(64, 64)] and out.shape == (32, 32, 3)  # 1/8: 64 >= 32 a side


def test_a_record_that_is_no_jpeg_is_a_value_error():
  with pytest.raises(ValueError, match=r"not an image Pillow can decode \(5 bytes\)"):
    images.decode_augment(b"hello", np.random.default_rng(0), size=8)


def test_normalize_is_imagenets():
  out = images.normalize(np.full((1, 1, 3), 255, np.uint8))
  np.testing.assert_allclose(out[0, 0], (255 - np.array(images.MEAN)) / np.array(images.STD),
                             rtol=1e-6)


@pytest.fixture
def data(tmp_path):
  pairs = [(images.encode(picture(40, 40, seed=i)), i % 3) for i in range(7)]
  vision.write_images(tmp_path / "d", pairs, num_classes=3, image_size=40, per_shard=3)
  return tmp_path / "d", pairs


def test_records_read_back_what_was_written_over_shards(data):
  directory, pairs = data
  records = vision.Records(directory)
  assert len(records) == 7 and records.manifest.shards == (
      "images-00000.array_record", "images-00001.array_record", "images-00002.array_record")
  assert [records[i] for i in range(7)] == pairs


def test_an_element_is_a_function_of_seed_and_index(data):
  directory, pairs = data
  records = vision.Records(directory)
  one = vision.example(records[3], index=3, seed=5, image_size=16, train=True)
  again = vision.example(records[3], index=3, seed=5, image_size=16, train=True)
  other = vision.example(records[3], index=3, seed=6, image_size=16, train=True)
  np.testing.assert_array_equal(one["image"], again["image"])
  assert not np.array_equal(one["image"], other["image"])
  assert one["label"] == pairs[3][1] and one["label"].dtype == np.int32


def test_the_pipeline_is_a_map_dataset_of_decoded_elements(data):
  directory, _ = data
  ctx = PipelineContext(shard_index=0, shard_count=1, seed=5, epoch=0, position=0)
  ds = vision.vision(ctx, data=str(directory), image_size=16)
  assert len(ds) == 7
  np.testing.assert_array_equal(
      ds[3]["image"], vision.example(vision.Records(directory)[3], index=3, seed=5,
                                     image_size=16, train=True)["image"])


def test_the_identity_names_the_manifest_and_changes_with_the_data(data, tmp_path):
  directory, pairs = data
  ctx = PipelineContext(shard_index=0, shard_count=1, seed=0, epoch=0, position=0)
  digest = hashlib.sha256((directory / "manifest.json").read_bytes()).hexdigest()[:16]
  assert vision.images_identity(ctx, data=str(directory), image_size=8) == (
      f"images sha256:{digest} (7 images)")
  vision.write_images(directory, pairs[:5], num_classes=3, image_size=40)
  assert vision.images_identity(ctx, data=str(directory), image_size=8).endswith("(5 images)")


def test_no_prepared_images_names_the_script(tmp_path):
  import sidecar
  with pytest.raises(sidecar.NotFoundError, match="run examples/vision/prepare.py --out"):
    vision.Records(tmp_path)
