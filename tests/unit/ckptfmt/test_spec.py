"""ckptfmt.spec: Orbax's names, without importing Orbax
(shardings: tests/unit/jax/test_checkpoint.py)."""

import pytest
from orbax.checkpoint._src.path import atomicity_types

from sidecar._src.ckptfmt import spec as spec_lib

pytestmark = pytest.mark.unit


def test_the_names_are_orbaxs():
  assert spec_lib.TMP_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
  assert spec_lib.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE


