"""Stock Orbax's on-disk layout (Zarr v2 without OCDBT), written by N sidecars.

* ``format``: :class:`~sidecar._src.ckptfmt.orbax.format.OrbaxFormat`, the format seam's
  implementation (``ckptfmt/format.py``).
* ``write``: the write engine (idle-class threads, ``O_DIRECT`` chunk files).
* ``commit``: the tmp step, the checks, the metadata files, fsync and rename.
* ``read``: leaves and shards of a committed step, ours or stock Orbax's.
* ``files``: what they share (item directory, write specs, chunk names).

None imports Orbax or TensorStore at import time: their functions do.
"""
