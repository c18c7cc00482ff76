"""Byte counts in Kubernetes quantities such as ``4608Mi``.

Sizes in the sidecar's own flags (``--shm-size 4GiB``) are parsed by ``shm.parse_size``.
"""

from __future__ import annotations

import decimal
import re

# Exact, with decimal.Decimal: a float makes 2.01k 2009 bytes.
_UNITS: dict[str, decimal.Decimal | int] = {
    "m": decimal.Decimal("0.001"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_MAX_EXPONENT = 30  # more bytes than any machine has, fewer digits than take time
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?([a-zA-Z]*)$")


def parse_quantity(text: str | int | float) -> int:
  """Bytes in a Kubernetes quantity such as ``4608Mi``, ``5G``, ``1e9`` or ``1024``, rounded down.

  Raises:
    ValueError: ``text`` is not a quantity.
  """
  if isinstance(text, bool):
    raise ValueError(f"not a quantity: {text!r}")
  if isinstance(text, (int, float)):
    return int(text)
  match = _QUANTITY.match(text.strip())
  if not match or match.group(3) not in _UNITS:
    raise ValueError(f"not a Kubernetes quantity: {text!r}; write e.g. 4608Mi or 5Gi")
  number, exponent, unit = match.groups()
  if abs(int(exponent or 0)) > _MAX_EXPONENT:  # 1e999999 would take int() seconds
    raise ValueError(f"the exponent of quantity {text!r} is out of range: at most "
                     f"e{_MAX_EXPONENT}")
  return int(decimal.Decimal(number).scaleb(int(exponent or 0)) * _UNITS[unit])


def format_mebibytes(num_bytes: int) -> str:
  """``num_bytes`` rounded up to a whole ``Mi`` quantity, e.g. ``4608Mi``."""
  return f"{-(-num_bytes // 2**20)}Mi"
