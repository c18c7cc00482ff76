"""``ctl.checkpointer``: the save protocol, restores and retention."""
