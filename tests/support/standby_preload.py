"""A module ``sidecar launch --standby --preload`` imports ahead: it notes when."""

import time

IMPORTED_AT = time.time()
