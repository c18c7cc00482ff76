"""Code that runs in the controller process."""
