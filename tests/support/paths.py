"""Where the repository and the tests' data are, for tests at any depth."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
