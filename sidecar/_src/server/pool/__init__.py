"""The pool: what a sidecar's clients (a pool file's tenants, or the older modes' one
tenant or per-client tokens) may hold, and how they share it. See docs/pool.md.
"""
