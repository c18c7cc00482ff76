"""Checkpoint formats on disk, written by N sidecars: the format seam and its formats.

No RPC in any module here, and no framework (Orbax, TensorStore, JAX, torch) imported
when a module is: a format imports its libraries inside the functions that use them, so
the registry, which imports every format, loads none (tests/unit/test_layers.py).

A save goes through the same sequence whatever its format (``server/checkpoint/save.py``
drives them): a tmp directory, each host's shards written as they are staged, a
manifest, one commit. What differs between formats is a :class:`~.format.Format`, found
by its one name in :mod:`.registry`: the name a trainer chooses
(``CheckpointOptions(format=...)``), Begin carries and the step's manifest records. A
restore names no format: a committed directory's is the one its manifest names.

* ``format``: the seam (``Format``: directories, numbering of staged shards, write,
  commit, read; ``Numbering``, ``Uncommitted``).
* ``registry``: the formats by name (``DEFAULT``: ``"orbax"``, ``"dcp"``); a committed
  directory's format from its manifest.
* ``orbax/``: stock Orbax's layout (Zarr v2 without OCDBT): ``format``, ``write``,
  ``commit``, ``read``, ``files``.
* ``dcp/``: PyTorch DCP's layout (``.metadata``, ``__<rank>_0.distcp``): ``format``,
  ``distcp``, ``record``, ``parts`` (the typed parts a DCP save carries).
* ``records``: what crosses the Checkpoint service, frozen (``ShardId``, ``ShardRecord``
  and ``Staged``, its bytes beside it, ``ReplicaTarget``, ``Replicated``, ``Held``,
  ``Manifest`` with its file and JSON).
* ``tiers``: :class:`~.tiers.Tier`, where a read takes a shard's copy (RAM, a replica,
  storage).
* ``spec``: :class:`~.spec.LeafSpec` (a leaf's key path, shape, dtype, write shape) and
  Orbax's file and directory names.
* ``names``: what a client may call a file; opening it beneath its directory.
* ``dir_fd``: a directory opened once (``DirFd``), and what a step operation makes,
  renames or removes relative to it.
* ``direct_io``: ``O_DIRECT`` writes where they pay, fsync of files and directories.

Adding a format is one sub-package ``ckptfmt/<name>/`` whose ``Format`` subclass
implements the seam, and one line in ``registry.py``; tests/unit/ckptfmt/test_conformance.py
runs every registered format through the sidecar's save, list, read, retention and
corruption checks.
"""
