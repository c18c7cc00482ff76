"""Functions of the pool attacks on resources (issue 70; ``--import tests.support.resource_fns``):
one a tenant may run, and one of the operator's that reads the sidecar's environment."""

import os

import numpy as np

import sidecar

SECRET_ENV = "SIDECAR_TEST_OPERATOR_SECRET"


@sidecar.function
def total(record: bytes):
  """A record's size: what bob's allowlist lets him run."""
  return {"size": np.int64(len(record))}


@sidecar.function
def operator_secret(record: bytes):
  """The operator's: a value from the sidecar's environment, no tenant's to read."""
  return {"secret": np.frombuffer(os.environ.get(SECRET_ENV, "").encode(), np.uint8)}
