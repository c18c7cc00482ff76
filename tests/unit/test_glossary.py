"""ARCHITECTURE.md's "Words with one meaning" is what the code's class names keep: a class
of sidecar/_src whose name holds one of its words (host, peer, pool, part, lot) is named
in that word's entry, so a new meaning of a word fails here until the glossary says it
(or the class is renamed). The classes that still carry an older meaning are listed below,
each with its reason; the list may only shrink."""

import ast
import re

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

SRC = ROOT / "sidecar" / "_src"
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
WORDS = ("host", "peer", "pool", "part", "lot")
# Still named for another meaning: (word, class) -> why it is not renamed yet.
KNOWN = {
    ("host", "HostArrays"): "the numpy framework (host memory); a public-facing rename",
    ("host", "DeviceToHost"): "JAX's DeviceCopy; named for the copy's direction",
    ("part", "ArenaPart"): "a quota's share of the arena (server/pool/, issue 56's server/ "
                           "bullet, another engineer's)",
}


def _entries() -> dict[str, str]:
  """Each word's glossary entry, by word."""
  section = TEXT.split("## Words with one meaning", 1)[1].split("\n## ", 1)[0]
  return {m.group(1): m.group(2) for m in re.finditer(
      r"^- \*\*([a-z]+)\*\*:(.*?)(?=^- \*\*|\Z)", section, re.M | re.S)}


def _classes() -> dict[str, str]:
  """Every class defined in sidecar/_src, by name: its module."""
  out = {}
  for path in SRC.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef):
        out[node.name] = str(path.relative_to(SRC))
  return out


def _words(name: str) -> set[str]:
  """The words of a CamelCase name, lower case, plurals as one: ``JaxPeers`` -> jax, peer."""
  return {w.lower().removesuffix("s") for w in re.findall(r"[A-Z][a-z]*|[a-z]+", name)}


def test_the_glossary_has_an_entry_for_each_word_it_keeps():
  assert set(WORDS) - {"lot"} <= set(_entries())  # a lot is defined in part's entry


def test_every_class_named_for_a_glossary_word_is_named_in_its_entry():
  entries, classes = _entries(), _classes()
  assert len(classes) > 200  # the walk sees the code's classes
  entries["lot"] = entries["part"]
  unexplained = sorted(
      f"{module}: {name} uses {word!r}" for name, module in classes.items()
      for word in WORDS if word in _words(name)
      and f"`{name}`" not in entries[word] and not re.search(rf"\.{name}`", entries[word])
      and (word, name) not in KNOWN)
  assert unexplained == [], (
      "a class is named for a word of ARCHITECTURE.md's glossary without the meaning that "
      "entry gives: name it in the entry (a meaning the word has) or rename it")


def test_the_known_exceptions_still_exist():
  classes = _classes()
  gone = sorted(name for _, name in KNOWN if name not in classes)
  assert gone == [], "renamed: drop them from KNOWN"


def test_a_retired_name_stays_retired():
  # The review's words with two meanings, renamed by issue 56: a shard's copy from a
  # device is not a host's (DeviceCopy), the shards handed on together are a lot.
  classes = _classes()
  assert "HostCopy" not in classes and classes.get("DeviceCopy") == "controller/framework.py"
  assert "Part" not in classes and classes.get("Lot") == "controller/checkpoint/staging.py"
