"""Built-in pipelines for ``ctl.feed(...)``, written against the public API only.

Each module registers one pipeline when imported; import the ones a job uses in
the sidecar (``sidecar serve --import pipelines.parquet``). They are kept small
so that they can be copied and adapted:

- ``pipelines.digits``: scikit-learn's bundled 8x8 handwritten digits (MapDataset).
- ``pipelines.digits_iterable``: the same digits, as ``digits``, without Grain (and so
  without JAX: for PyTorch jobs), sharded and positioned by itself (iterable).
- ``pipelines.arrayrecord``: ArrayRecord files of ``encode_example`` records (MapDataset).
- ``pipelines.tfds``: a TFDS dataset prepared in ``array_record`` format (MapDataset).
- ``pipelines.parquet``: Parquet files streamed by row group (sharded iterable).

This package deliberately imports none of them, so that importing one does not
pull in the dependencies of the others.
"""
