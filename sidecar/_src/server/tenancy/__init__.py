"""Who each client is, a pool's or not: the tenants, their tokens, and every quota."""
