"""The shared-memory arena and the Worker that maps it beside the devices."""
