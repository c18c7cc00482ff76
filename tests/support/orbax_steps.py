"""A small tree, two hosts' parts of it, and a step written from them: what the
``test_orbax_*`` unit tests share. Numpy only: no devices, no sharding.

``w`` is a 2 x 2 grid of whole chunks, two per host; ``opt.0.e`` has an edge chunk
(``4:5`` of write shape 2), which goes through TensorStore; ``s`` is a scalar that
the last host writes.
"""

import numpy as np

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.orbax import commit as orbax_commit, write as orbax_write
from sidecar._src.ckptfmt.records import Staged
from tests.support.staged import staged

W = np.arange(48, dtype=np.float32).reshape(8, 6)
E = np.arange(10, 15, dtype=np.int32)
S = np.float64(0.5)
VALUES = {("w",): W, ("opt", 0, "e"): E, ("s",): S}

SPECS = [
    spec_lib.LeafSpec(key_path=("w",), shape=(8, 6), dtype=np.float32, kind="np.ndarray",
                         write_shape=(4, 3)),
    spec_lib.LeafSpec(key_path=("opt", 0, "e"), shape=(5,), dtype=np.int32,
                         kind="np.ndarray", write_shape=(2,)),
    spec_lib.LeafSpec(key_path=("s",), shape=(), dtype=np.float64, kind="scalar"),
]


def host_parts() -> list[list[Staged]]:
  """Each host's shards of SPECS (w 0, e 1, s 2). Host 0: w's top row of chunks, e's first
  and edge chunks. Host 1: the rest."""
  w, e, s = (spec.key_path for spec in SPECS)
  return [
      [staged(w, 0, (slice(0, 4), slice(0, 3)), W[:4, :3], host=0),
       staged(w, 0, ((0, 4), (3, 6)), W[:4, 3:], host=0),
       staged(e, 1, ((0, 2),), E[:2], host=0), staged(e, 1, ((4, 5),), E[4:], host=0)],
      [staged(w, 0, ((4, 8), (0, 3)), W[4:, :3], host=1),
       staged(w, 0, ((4, 8), (3, 6)), W[4:, 3:], host=1),
       staged(e, 1, ((2, 4),), E[2:4], host=1),
       staged(s, 2, (), np.asarray(S), host=1)],
  ]


def write_step(directory, step: int = 5, **finalize_kw):
  """The step written by both hosts (host 1 first) and committed; returns its directory."""
  tmp = orbax_commit.create_tmp_step(directory, step)
  for host, part in reversed(list(enumerate(host_parts()))):
    orbax_write.write_host_part(tmp, host, SPECS, part)
  return orbax_commit.finalize(tmp, SPECS, num_hosts=2, **finalize_kw)


def assert_bit_exact(expected, got):
  expected, got = np.asarray(expected), np.asarray(got)
  assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
  assert got.tobytes() == expected.tobytes()
