"""A checkpoint step in stock Orbax's on-disk layout, written by N sidecars.

Stock Orbax (0.12) saves with ``StandardCheckpointHandler(use_ocdbt=False)`` (Zarr v2
without OCDBT, POSIX atomic rename) a step laid out as::

  <directory>/<step>.orbax-checkpoint-tmp/   while writing; renamed to <step> to commit
    _CHECKPOINT_METADATA        step metadata: item handlers, init/commit timestamps
    commit_success.txt          written just before the rename
    default/                    the one item, "default"
      _METADATA                 tree metadata: key paths, value types, write shapes
      _sharding                 {base64url(param name): serialized NamedSharding}
      array_metadatas/process_<i>   per-process write and chunk shapes of jax.Array leaves
      <param>/.zarray           each array's Zarr metadata, written by process 0
      <param>/<i>.<j>           one file per chunk, written by the process that owns it
      commit_success.txt

That is the layout written here. Orbax's default (OCDBT) packs chunks into a few
database files, which suits object stores; plain files let a sidecar write each
uncompressed chunk straight from the arena with O_DIRECT (``direct_io``): no copy
through the page cache, almost no CPU taken from the training step, and the disk
busy from the first byte. Stock Orbax restores either (it looks for
``manifest.ocdbt``), and :func:`read_leaf` reads both.

A sidecar is not part of a ``jax.distributed`` job, so Orbax's own barriers and
``jax.process_index()`` cannot place its part. Each sidecar instead plays the Orbax
process ``host_index``: ``write.write_item_part`` writes the shards its host owns with
Orbax's own TensorStore specs (and file names), and once every host is done one
caller runs ``commit.finalize``, which checks every chunk is there, writes the metadata
files and commits with one atomic rename.

Chunks are stored uncompressed by default: Orbax's default zstd makes a save CPU-bound,
and stock Orbax reads whatever compressor ``.zarray`` names.

Typical flow (``orbax/format.py``, driven by server/checkpoint/save.py)::

  tmp = commit.create_tmp_step(directory, step)
  # on every host h, concurrently, with that host's shards as they are staged:
  sums = write.write_item_part(tmp / "default", h, specs, shards)
  # once all hosts reported:
  final = commit.finalize(tmp, specs, num_hosts=n)

One module per concern, no RPC in any:

* ``records``: what crosses the Checkpoint service, frozen (``ShardId``, ``StagedShard``,
  ``ShardChecksum``, ``ReplicaTarget``, ``Replicated``, ``Held``, ``Manifest`` with its file).
* ``format``: the format seam (``Format``, ``Numbering``); ``registry``: the formats by name.
* ``orbax/``: stock Orbax's layout (``format``, ``write``, ``commit``, ``read``, ``files``).
* ``dcp/``: PyTorch DCP's layout (``format``, ``parts``, ``distcp``, ``record``).
* ``spec``: :class:`LeafSpec` (a leaf's key path, shape, dtype, write shape), step paths.
* ``shards``: the crc32c of a shard.
* ``direct_io``: ``O_DIRECT`` writes where they pay, fsync of files and directories.
* ``feed_state``: a feed's position, stored beside the state.
* ``read``, ``write``, ``commit``, ``manifest``: the old homes of ``orbax/*`` and of
  ``records``, kept until their importers outside ``ckptfmt`` name the new ones.
"""
