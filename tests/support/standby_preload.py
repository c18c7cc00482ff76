"""A module ``sidecar launch --standby --preload`` imports ahead: it notes when."""

import os
import time

IMPORTED_AT = time.time()

# As JAX's TPU setup does at import: a variable the device runtime reads later. A standby
# taking the next start's environment must keep it.
os.environ["TEST_EXPORTED_AT_IMPORT"] = "yes"
