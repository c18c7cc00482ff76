"""Importing the package, its decorators or the CLI loads no jax, grpc or grain; importing
sidecar.torch (its DataLoader too) loads no jax, Grain, Orbax or TensorStore."""

import pytest

pytestmark = pytest.mark.processes


def test_importing_the_package_its_decorators_or_the_cli_loads_no_jax_grpc_or_grain():
  # test_public_api_is_pinned shows that every name still resolves; the command line
  # (`sidecar launch`, `status`, `--help`) imports what a command runs when it runs.
  import subprocess
  import sys
  script = ("import sys, sidecar; heavy = lambda: sorted(m for m in ('jax', 'grpc', 'grain') "
            "if m in sys.modules); print(heavy()); sidecar.function; "
            "import sidecar._src.tools.cli, sidecar._src.tools.launch; print(heavy())")
  out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       text=True, timeout=120).stdout
  assert out.splitlines() == ["[]", "[]"], out


def test_star_import_loads_no_framework_and_a_moved_name_loads_jax_only_when_used():
  # `from sidecar import *` takes every name of __all__ (sidecar.elastic, sidecar.testing,
  # sidecar.distributed among them): none may import JAX or torch. The names moved in 0.2.0
  # (sidecar.Controller, sidecar.distributed.initialize) import JAX when used, not before.
  import subprocess
  import sys
  script = ("import sys, warnings; warnings.simplefilter('ignore', DeprecationWarning); "
            "heavy = lambda: sorted(m for m in ('jax', 'jaxlib', 'torch', 'grain', 'orbax', "
            "'tensorstore') if m in sys.modules); "
            "from sidecar import *; print(heavy()); "
            "import sidecar; print(sorted(n for n in sidecar.__all__ if n not in globals())); "
            "print(callable(elastic.retry), heavy()); "
            "from sidecar import Controller; print(Controller.__module__, 'jax' in sys.modules); "
            "print(distributed.initialize.__module__)")
  out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       text=True, timeout=120).stdout
  assert out.splitlines() == [
      "[]", "[]", "True []", "sidecar._src.jax.controller True",
      "sidecar._src.jax.distributed"], out


def test_importing_sidecar_torch_loads_no_jax_and_dcp_once_a_checkpoint_class_is_named():
  import subprocess
  import sys
  script = ("import sys, sidecar.torch; "
            "print(sorted(m for m in ('jax', 'jaxlib', 'grain', 'orbax', 'tensorstore') "
            "if m in sys.modules)); "
            "dcp = lambda: 'torch.distributed.checkpoint' in sys.modules; print(dcp()); "
            "sidecar.torch.DataLoader, sidecar.torch.connect; print(dcp()); "
            "w = sidecar.torch.StorageWriter; print(dcp(), w.__module__); "
            "print(sidecar.torch.Checkpointer.__module__, 'Checkpointer' in dir(sidecar.torch))")
  out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       text=True, timeout=120).stdout
  assert out.splitlines() == ["[]", "False", "False", "True sidecar._src.torch.storage",
                              "sidecar._src.torch.checkpointer True"], out


def test_a_sidecars_server_loads_no_ml_dtypes_until_an_array_of_its_types_comes():
  # ml_dtypes' import is most of a sidecar's start (core/dtypes.py): it waits for a bfloat16.
  import subprocess
  import sys
  script = ("import sys, sidecar._src.server.server as s; from sidecar._src.core import dtypes; "
            "print('ml_dtypes' in sys.modules); dtypes.dtype_of('float32'); "
            "print('ml_dtypes' in sys.modules); print(dtypes.dtype_of('bfloat16')); "
            "print('ml_dtypes' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       text=True, timeout=120).stdout
  assert out.splitlines() == ["False", "False", "bfloat16", "True"], out
