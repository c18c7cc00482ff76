"""A pool tenant's work in processes of its own, which the kernel bounds (issue 76;
ARCHITECTURE.md, "Tenant processes").

The sidecar's side: ``processes`` (every tenant's process: started at its first job,
watched, stopped; the sidecar's ``isolation.Isolation`` with a pool file), ``process``
(one of them: its spawn, its control socket, its death), ``jobs`` (each job's socket: what
its process asks, decided here; what it answers, checked here), ``tmp`` (the processes'
temporary directories, measured). Both sides: ``messages`` (what crosses, one frozen value
each) and ``limits`` (what the kernel holds a process to, from the pool file). The tenant
process's side: ``child`` (its main), ``child_jobs`` (its jobs).
"""
