"""Kubernetes quantities as byte counts: exact decimal arithmetic, rounded down.

The parse of the common forms (``4608Mi``, ``5G``, ``1e3``, ...) and of bad text is
pinned here too; the memory check that relies on it is in test_checks.py.
"""

import re

import pytest

from sidecar._src.tools.k8s import quantity

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "expected"), [
    ("2.01k", 2010), ("2.01G", 2_010_000_000), ("0.1Ki", 102), ("1.5Gi", 3 * 2**29),
    (".5Mi", 2**19), ("3.", 3), ("2e-3k", 2), ("1E", 10**18), ("1Ei", 2**60),
    ("123456789123456789", 123456789123456789), ("1500m", 1), (" 7Mi ", 7 * 2**20),
], ids=["decimal-fraction", "decimal-fraction-2", "binary-fraction", "binary-half",
        "leading-dot", "trailing-dot", "negative-exponent", "exa-not-exponent", "exbi",
        "18-digits", "milli", "whitespace"])
def test_quantities_are_exact_and_rounded_down(text, expected):
  """A decimal fraction of a unit is the exact integer Kubernetes means: float
  arithmetic makes 2.01k 2009 bytes."""
  assert quantity.parse_quantity(text) == expected


@pytest.mark.parametrize(("value", "expected"), [(4096, 4096), (2.9, 2)], ids=["int", "float"])
def test_numbers_are_bytes_already(value, expected):
  assert quantity.parse_quantity(value) == expected


@pytest.mark.parametrize("bad", [True, False], ids=["true", "false"])
def test_a_bool_is_not_a_quantity(bad):
  with pytest.raises(ValueError, match=rf"not a quantity: {bad}"):
    quantity.parse_quantity(bad)


@pytest.mark.parametrize("bad", ["1Mb", "1mi", "Mi", "1e", "1.2.3", "0x10"],
                         ids=["bits", "lower-mebi", "no-number", "bare-e", "two-dots", "hex"])
def test_bad_text_says_how_to_write_one(bad):
  with pytest.raises(ValueError, match=rf"not a Kubernetes quantity: '{bad}'; write e\.g\. 4608Mi"):
    quantity.parse_quantity(bad)


@pytest.mark.parametrize(("num_bytes", "expected"), [
    (0, "0Mi"), (1, "1Mi"), (2**20, "1Mi"), (2**20 + 1, "2Mi"), (4608 * 2**20, "4608Mi"),
], ids=["zero", "one-byte", "exact", "one-over", "arena"])
def test_format_mebibytes_rounds_up(num_bytes, expected):
  assert quantity.format_mebibytes(num_bytes) == expected
  assert quantity.parse_quantity(expected) >= num_bytes


@pytest.mark.parametrize("bad", ["1e999999", "1e-999999999", "5e31Mi"],
                         ids=["huge", "tiny", "suffix"])
def test_an_exponent_out_of_range_is_refused_at_once(bad):
  with pytest.raises(ValueError, match=r"exponent of quantity .* is out of range: at most e30"):
    quantity.parse_quantity(bad)


@pytest.mark.parametrize("text, expected", [
    ("4608Mi", 4608 * 2**20), ("5Gi", 5 * 2**30), ("1G", 10**9), ("1e3", 1000), ("500m", 0),
    ("1.5Ki", 1536), (1024, 1024),
], ids=["Mi", "Gi", "G", "exponent", "milli", "fraction", "int"])
def test_parse_quantity(text, expected):
  assert quantity.parse_quantity(text) == expected


@pytest.mark.parametrize("bad", ["lots", "4 GiBs", "-1Gi", "", "4GiB"])
def test_bad_quantities_name_the_value(bad):
  with pytest.raises(ValueError, match=re.escape(repr(bad))):
    quantity.parse_quantity(bad)
