"""Each built-in pipeline, imported without its library, names the extra to install."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

# (pipeline module, the module its library provides, the message's library and extra)
CASES = [
    ("pipelines.parquet", "pyarrow", "pyarrow: pip install 'colocated-sidecar[parquet]'"),
    ("pipelines.arrayrecord", "array_record",
     "array-record: pip install 'colocated-sidecar[arrayrecord]'"),
    ("pipelines.lm", "array_record", "array-record: pip install 'colocated-sidecar[lm]'"),
    ("pipelines.tfds", "tensorflow_datasets",
     "tensorflow-datasets: pip install 'colocated-sidecar[tfds]'"),
    ("pipelines.digits", "sklearn", "scikit-learn: pip install 'colocated-sidecar[demo]'"),
    ("pipelines.digits_iterable", "sklearn",
     "scikit-learn: pip install 'colocated-sidecar[digits]'"),
]


@pytest.mark.parametrize("module, library, message", CASES, ids=[c[0] for c in CASES])
def test_missing_library_names_the_extra(module, library, message):
  # A None entry in sys.modules makes `import library` fail as if it were not installed. Grain is
  # imported first, as the pipelines do: on Linux it needs array-record itself.
  code = (f"import sys, grain\n"
          f"for name in [m for m in sys.modules if m.split('.')[0] == {library!r}]:\n"
          f"  del sys.modules[name]\n"
          f"sys.modules[{library!r}] = None\n"
          f"try:\n  import {module}\n"
          f"except ImportError as e:\n  print(e)\nelse:\n  print('imported')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=True).stdout.strip()
  assert out == f"{module} needs {message}"


@pytest.mark.parametrize("module", [c[0] for c in CASES], ids=[c[0] for c in CASES])
def test_imports_with_its_library(module):
  out = subprocess.run([sys.executable, "-c", f"import {module}; print('imported')"],
                       capture_output=True, text=True, timeout=60, check=True).stdout.strip()
  assert out == "imported"


def test_digits_iterable_imports_without_grain_or_jax():
  # The one built-in pipeline a PyTorch job without JAX can feed from (issue 45, item 4).
  code = ("import sys\n"
          "for name in ('jax', 'jaxlib', 'grain'):\n  sys.modules[name] = None\n"
          "import pipelines.digits_iterable\nprint('imported')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "imported", out.stderr


@pytest.mark.parametrize("module", ["pipelines.digits", "pipelines.digits_iterable"])
def test_the_digits_are_read_without_importing_scikit_learn(module):
  # Its import took 1.7 s of CPU in every sidecar, feed worker and trainer of a digits
  # pipeline (sidecar demo, the torch demo and example); the file it ships is read instead.
  code = (f"import sys\nimport {module} as p\n"
          f"images, labels = p._digits_data.load('train')\n"
          f"print(images.shape, labels.shape, 'sklearn' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "(1500, 8, 8, 1) (1500,) False", out.stderr
