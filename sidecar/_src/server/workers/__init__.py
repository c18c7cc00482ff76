"""The worker socket: the Unix socket Workers attach to, and its connections."""
