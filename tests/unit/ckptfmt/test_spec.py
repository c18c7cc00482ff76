"""layout_spec: Orbax's names and serialized shardings, without importing Orbax."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.path import atomicity_types

from sidecar._src.ckptfmt import spec as layout_spec

pytestmark = pytest.mark.unit


def test_the_names_are_orbaxs():
  assert layout_spec.TMP_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
  assert layout_spec.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@pytest.mark.parametrize("sharding", [
    lambda: NamedSharding(_mesh((4,), ("data",)), P("data")),
    lambda: NamedSharding(_mesh((2, 2), ("a", "b")), P(("a", "b"))),
    lambda: NamedSharding(_mesh((2, 2), ("a", "b")), P(None, "b")),
    lambda: NamedSharding(_mesh((2, 2), ("a", "b")), P()),
    lambda: NamedSharding(Mesh(np.array(jax.devices()[3:1:-1]), ("x",)), P("x")),
    lambda: SingleDeviceSharding(jax.devices()[1]),
], ids=["1d", "2d-tuple", "2d-none", "replicated", "reversed-devices", "single-device"])
def test_serialized_sharding_is_orbaxs_byte_for_byte(sharding):
  s = sharding()
  want = sharding_metadata.from_jax_sharding(s).to_serialized_string()
  assert layout_spec.serialized_sharding(s) == want
  # And Orbax reads it back as the same sharding.
  back = sharding_metadata.from_serialized_string(want).to_jax_sharding()
  assert back == s or back.device_set == s.device_set
