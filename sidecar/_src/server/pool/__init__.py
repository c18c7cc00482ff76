"""The pool: what a sidecar's clients may hold, and how they share it (docs/pool.md).

A pool file's tenants, and the older modes' one shared token or per-client tokens, are
tenants of one pool. ``quotas`` declares each quota once, as a policy object;
``tenants`` is the pool and who is whose at run time; ``pool_file`` reads the YAML. The
parts that hold clients to their quotas are each handed the quota objects they enforce:
``limits`` (handshake sessions, calls, streams, inline bytes), ``leases`` and
``admission`` (arena blocks, a tenant's guaranteed share and ceiling, the queue),
``tenant_checks`` (checkpoint roots, RAM tier, storage bytes), ``shares`` (CPUs and write
bandwidth by weight), ``departures`` (``ram_keep``) and ``credits`` (a stream's prefetch).
"""
