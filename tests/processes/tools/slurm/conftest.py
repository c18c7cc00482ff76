"""One real Slurm (munged, slurmctld, slurmd from a temp dir) for the tests of this folder.

Started once for the folder and stopped by pid afterwards (tests/support/slurm.py); where
it cannot start, every test here fails with the reason (they are never skipped).
"""

import pytest

from tests.support.slurm import SlurmCluster


@pytest.fixture(scope="package")
def slurm(tmp_path_factory):
  cluster = SlurmCluster()
  try:
    cluster.start()
  except Exception as e:
    pytest.fail(f"Slurm could not start here, so the Slurm tests cannot run: {e}",
                pytrace=False)
  try:
    yield cluster
  finally:
    cluster.close()
