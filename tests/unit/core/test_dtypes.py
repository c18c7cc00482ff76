import ml_dtypes
import numpy as np
import pytest

from sidecar._src.core import dtypes as dtypes_lib

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [np.dtype(np.uint8), np.dtype(">i4"), np.dtype("<i4"),
                                   np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)],
                         ids=["uint8", "int32-big", "int32-little", "float32", "bfloat16"])
def test_name_of_is_the_dtypes_name_asked_again_or_first(dtype):
  assert dtypes_lib.name_of(dtype) == dtype.name
  assert dtypes_lib.name_of(dtype) == dtype.name  # from what it remembered
  assert dtypes_lib.dtype_of(dtypes_lib.name_of(dtype)) == dtype.newbyteorder("=")
