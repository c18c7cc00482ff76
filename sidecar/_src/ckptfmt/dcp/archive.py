"""One tensor as ``torch.save`` stores it, made without torch: the archives of a ``.distcp`` file.

DCP's ``FileSystemReader`` reads each tensor of a ``.distcp`` file with
``torch.load(slice, weights_only=True)``: every tensor is stored as a whole ``torch.save``
archive, a zip of stored (uncompressed) entries::

  archive/data.pkl      the pickle that rebuilds the tensor from storage "0"
  archive/byteorder     "little"
  archive/version       "3\\n"
  archive/data/0        the tensor's C-order bytes, as they are in memory

A sidecar writes these archives without importing torch: :func:`header` and
:func:`trailer` are the bytes before and after the tensor's own bytes, and the
tensor's bytes go to the file straight from the arena. ``data.pkl`` is a fixed pickle
of a few opcodes, the one ``torch.save`` writes (``_rebuild_tensor_v2`` of a typed
storage, or ``_rebuild_tensor_v3`` of an untyped one with its dtype for the dtypes
that have no typed storage class), built here by :func:`tensor_pickle` from the
dtype's name and the shape. Nothing here unpickles anything.

Where the archive starts in its file is known before it is written (the layout is
fixed by the items' sizes), so the header pads the ``data/0`` entry with an extra
field (as ``torch.save`` pads to 64 bytes) until the tensor's bytes start on a 4 KiB
boundary of the file: they then go to disk with ``O_DIRECT``, no copy through the page
cache. Archives over 4 GiB use zip64 entries.

The zip's CRC-32 of ``data/0`` is written as 0, as ``torch.save`` does under
``torch.serialization.set_crc32_options(False)``: ``torch.load`` does not check it, and
each shard's crc32c in the sidecar's manifest is what a restore checks. The small
entries carry their real CRC-32.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

from sidecar._src.core import errors

ARCHIVE = "archive"
DATA_ALIGN = 4096  # tensor bytes start on this boundary of the file (O_DIRECT)
SMALL_ALIGN = 64  # as torch.save aligns storages; for archives under one DATA_ALIGN
_PAD_ID = 0x4246  # the extra field torch.save pads with ("FB", filled with "Z")
_ZIP64_ID = 0x0001
_U32 = 0xFFFFFFFF  # a zip field that says: see the zip64 extra
# Sizes and offsets from here on take zip64 entries (a module constant: tests lower it).
ZIP64_AT = _U32
_U16 = 0xFFFF
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the zip epoch
# numpy (ml_dtypes) dtype name -> the typed storage class torch.save names for it.
TYPED_STORAGES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}
# Dtypes torch.save stores as an untyped storage and the dtype (``_rebuild_tensor_v3``).
UNTYPED_DTYPES = ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                  "float8_e4m3fnuz", "float8_e5m2fnuz")
ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
             "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


def check_dtype(dtype: str) -> int:
  """The item size of ``dtype`` (a numpy/ml_dtypes name); InvalidArgumentError if a
  ``.distcp`` archive cannot hold it."""
  if dtype not in ITEMSIZES:
    raise errors.InvalidArgumentError(
        f"dtype {dtype!r} has no torch.save storage; DCP archives hold "
        f"{', '.join(sorted(ITEMSIZES))}")
  return ITEMSIZES[dtype]


# ---- data.pkl ------------------------------------------------------------------------

def _int(n: int) -> bytes:
  if 0 <= n < 1 << 8:
    return b"K" + bytes([n])
  if 0 <= n < 1 << 16:
    return b"M" + struct.pack("<H", n)
  if -(1 << 31) <= n < 1 << 31:
    return b"J" + struct.pack("<i", n)
  raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
  return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _str(s: str) -> bytes:
  raw = s.encode()
  return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _global(module: str, name: str) -> bytes:
  return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _tuple(items: Sequence[bytes]) -> bytes:
  body = b"".join(items)
  if len(items) <= 3:
    return body + (b")", b"\x85", b"\x86", b"\x87")[len(items)]
  return b"(" + body + b"t"


def tensor_pickle(dtype: str, shape: Sequence[int]) -> bytes:
  """``data.pkl`` of a C-contiguous tensor of ``dtype`` and ``shape`` in storage "0"."""
  itemsize = check_dtype(dtype)
  shape = tuple(int(d) for d in shape)
  numel = math.prod(shape)
  strides, step = [], 1
  for d in reversed(shape):
    strides.append(step)
    step *= max(d, 1)
  strides.reverse()
  typed = dtype in TYPED_STORAGES
  storage = (_global("torch", TYPED_STORAGES[dtype]) if typed
             else _global("torch.storage", "UntypedStorage"))
  location = b"(" + _str("storage") + storage + _str("0") + _str("cpu") + _int(
      numel if typed else numel * itemsize) + b"tQ"  # MARK ... TUPLE, BINPERSID
  args = [location, _int(0), _tuple([_int(d) for d in shape]),
          _tuple([_int(s) for s in strides]), b"\x89",  # NEWFALSE: requires_grad
          _global("collections", "OrderedDict") + b")R"]  # OrderedDict(): no hooks
  if not typed:
    args.append(_global("torch", dtype))
  rebuild = "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3"
  return (b"\x80\x02" + _global("torch._utils", rebuild) + b"(" + b"".join(args) + b"t"
          + b"R.")


# ---- the zip around it ---------------------------------------------------------------

def _local_header(name: bytes, size: int, crc: int, extra: bytes) -> bytes:
  sized = _U32 if size >= ZIP64_AT else size
  return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, _DOS_DATE, crc, sized, sized,
                     len(name), len(extra)) + name + extra


def _zip64_extra(*values: int) -> bytes:
  return struct.pack(f"<HH{len(values)}Q", _ZIP64_ID, 8 * len(values), *values)


def _pad_extra(n: int) -> bytes:
  """An extra field of exactly ``n`` bytes (0, or at least 4)."""
  if n == 0:
    return b""
  return struct.pack("<HH", _PAD_ID, n - 4) + b"Z" * (n - 4)


_SMALL = ((b"byteorder", b"little"), (b"version", b"3\n"))


def _entries(dtype: str, shape: Sequence[int]) -> list[tuple[bytes, bytes]]:
  prefix = ARCHIVE.encode() + b"/"
  return [(prefix + b"data.pkl", tensor_pickle(dtype, shape))] + [
      (prefix + name, data) for name, data in _SMALL]


def data_nbytes(dtype: str, shape: Sequence[int]) -> int:
  return check_dtype(dtype) * math.prod(int(d) for d in shape)


def header(dtype: str, shape: Sequence[int], *, at: int) -> bytes:
  """The bytes of a tensor's archive before its data, for an archive that starts at file
  offset ``at`` (a multiple of 64): the data then starts at ``at + len(header)``, on a
  4 KiB boundary when the data is at least that long, else on 64 bytes."""
  if at % SMALL_ALIGN:
    raise errors.InvalidArgumentError(f"an archive starts on {SMALL_ALIGN} bytes, got offset {at}")
  nbytes = data_nbytes(dtype, shape)
  out = b"".join(_local_header(name, len(data), zlib.crc32(data), b"") + data
                 for name, data in _entries(dtype, shape))
  name = ARCHIVE.encode() + b"/data/0"
  zip64 = _zip64_extra(nbytes, nbytes) if nbytes >= ZIP64_AT else b""
  bare = len(_local_header(name, nbytes, 0, zip64))
  align = DATA_ALIGN if nbytes >= DATA_ALIGN else SMALL_ALIGN
  pad = -(at + len(out) + bare) % align
  if 0 < pad < 4:  # an extra field takes 4 bytes at least
    pad += align
  return out + _local_header(name, nbytes, 0, zip64 + _pad_extra(pad))


def trailer(dtype: str, shape: Sequence[int], *, at: int) -> bytes:
  """The bytes of a tensor's archive after its data: the zip's central directory and its end
  (zip64 where needed). ``at`` as for :func:`header`."""
  head = header(dtype, shape, at=at)
  nbytes = data_nbytes(dtype, shape)
  entries = _entries(dtype, shape) + [(ARCHIVE.encode() + b"/data/0", b"")]
  central, offset = [], 0
  for i, (name, data) in enumerate(entries):
    size = nbytes if i == len(entries) - 1 else len(data)
    crc = 0 if i == len(entries) - 1 else zlib.crc32(data)
    big = size >= ZIP64_AT or offset >= ZIP64_AT
    extra = _zip64_extra(*([size, size] if size >= ZIP64_AT else []),
                         *([offset] if offset >= ZIP64_AT else [])) if big else b""
    central.append(struct.pack(
        "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, _DOS_DATE, crc,
        _U32 if size >= ZIP64_AT else size, _U32 if size >= ZIP64_AT else size, len(name),
        len(extra), 0, 0, 0, 0, _U32 if offset >= ZIP64_AT else offset) + name + extra)
    if i < len(entries) - 1:
      offset += 30 + len(name) + len(data)
  cd = b"".join(central)
  cd_at = len(head) + nbytes
  end = b""
  if cd_at >= ZIP64_AT:
    end = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(entries), len(entries),
                      len(cd), cd_at)
    end += struct.pack("<IIQI", 0x07064B50, 0, cd_at + len(cd), 1)
  end += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(cd),
                     _U32 if cd_at >= ZIP64_AT else cd_at, 0)
  return cd + end


def archive_length(dtype: str, shape: Sequence[int], *, at: int) -> int:
  """The whole archive's length: header, data, trailer."""
  return (len(header(dtype, shape, at=at)) + data_nbytes(dtype, shape)
          + len(trailer(dtype, shape, at=at)))
