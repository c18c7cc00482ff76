"""ckptfmt.spec: Orbax's names, without importing Orbax (shardings: tests/unit/jax/test_checkpoint.py)."""

import pytest
from orbax.checkpoint._src.path import atomicity_types

from sidecar._src.ckptfmt import spec as layout_spec

pytestmark = pytest.mark.unit


def test_the_names_are_orbaxs():
  assert layout_spec.TMP_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
  assert layout_spec.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE


