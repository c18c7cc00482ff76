"""Writes the LM example's corpus: the Python standard library's own sources, as ArrayRecord.

  python examples/lm/prepare.py --out /tmp/lm-data [--max-mb 2]

The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (no site-packages, no test
suites), sorted by their path relative to it, concatenated byte for byte, each followed
by a newline, cut into 64 KiB records in 16 MiB shards, with ``manifest.json`` beside
them (``pipelines.lm.write_corpus``). Nothing is downloaded; the same Python writes the
same corpus every time.

Beside it, ``heldout.bin`` (``pipelines.lm.HELDOUT``): ``--heldout-kb`` of text the corpus
never holds, for ``train.py --eval-every``: the stdlib's own test suites (left out of the
corpus), sorted the same way; where this Python has none, the sources after the corpus's
``--max-mb`` cut; neither (the whole stdlib, no tests): none is written.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import sysconfig
from collections.abc import Iterator

# Run as a script from the repository root: the repository's pipelines package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from pipelines import lm  # noqa: E402

# Directories left out: installed packages, and the test suites (much generated data).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})


def source_files(root: str | os.PathLike | None = None) -> list[pathlib.Path]:
  """The stdlib's .py files, sorted by their path relative to ``root``."""
  base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  found = [p for p in base.rglob("*.py")
           if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(base).parts[:-1])]
  return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def _contents(paths: list[pathlib.Path]) -> Iterator[bytes]:
  for path in paths:
    yield path.read_bytes() + b"\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="directory to write the corpus in")
  parser.add_argument("--max-mb", type=float, default=None,
                      help="stop after this many MiB (default: the whole standard library)")
  parser.add_argument("--record-kb", type=int, default=64, help="KiB of each record")
  parser.add_argument("--shard-mb", type=int, default=16, help="MiB of each shard file")
  parser.add_argument("--root", default=None,
                      help="directory of .py files to read (default: the stdlib)")
  parser.add_argument("--heldout-kb", type=int, default=256,
                      help="KiB of held-out text to write beside the corpus (0: none)")
  args = parser.parse_args(argv)
  paths = source_files(args.root)
  max_bytes = None if args.max_mb is None else int(args.max_mb * (1 << 20))
  manifest = lm.write_corpus(args.out, _contents(paths), record_bytes=args.record_kb << 10,
                             shard_bytes=args.shard_mb << 20, max_bytes=max_bytes,
                             sources=len(paths))
  print(f"wrote {manifest.total_bytes:,} bytes of {len(paths)} files' sources as "
        f"{sum(manifest.records)} records in {len(manifest.shards)} shard(s) to {args.out}")
  if args.heldout_kb > 0:
    heldout = held_out(args.root, manifest.total_bytes, args.heldout_kb << 10)
    target = pathlib.Path(args.out) / lm.HELDOUT
    if heldout:
      target.write_bytes(heldout)
      print(f"wrote {len(heldout):,} bytes of held-out text to {target}")
    else:
      target.unlink(missing_ok=True)
      print("no held-out text: this Python has no test suites, and the corpus holds every "
            "source (give --max-mb for some to be left out)")
  return 0


def held_out(root: str | None, used: int, size: int) -> bytes:
  """``size`` bytes the corpus does not hold: the test suites' sources (left out of it), or
  the sources after its first ``used`` bytes; b"" where there are none."""
  base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  tests = sorted((p for d in ("test", "tests") for p in base.glob(f"**/{d}/**/*.py")
                  if p.is_file() and "site-packages" not in p.parts),
                 key=lambda p: p.relative_to(base).as_posix())
  if tests:
    return b"".join(_contents(tests[:max(1, size >> 10)]))[:size]
  rest = b"".join(_contents(source_files(root)))[used:used + size]
  return rest


if __name__ == "__main__":
  sys.exit(main())
