"""The pool: what a sidecar serving several tenants (``--pool FILE``) adds (docs/pool.md).

What holds every client, a single-tenant sidecar's too, is elsewhere in ``server/``:
``tenancy/`` (``tenants``: who each session and worker is, the token modes being pools of
one or of named clients; ``quotas``: each quota declared once, as a policy object), ``limits``
(RPC slots, handshake sessions, inline bytes, a stream's prefetch), ``arenas/leases`` (the
arena's blocks) and ``calls/credits`` (a stream's prefetch credits); each asks a quota where
a tenant has one. Here, above ``tenancy/`` (which never imports the pool): ``pool_file``
reads the YAML; ``tenant_checks`` holds the tenants to their
allowlists and checkpoint quotas, as the policies (``server/policies.py``) the server hands
the call runner and the checkpoint store; ``admission`` is the arena's queue, ``shares`` the CPUs
and write bandwidth by weight, ``departures`` the RAM-tier copies kept after a job left
(``ram_keep``).
"""
