"""The arenas on the sidecar: their memory (one, or one per pool tenant), who holds each
block, and a call's views and results in them."""
