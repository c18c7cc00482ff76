"""A host's part of a feed: its pipeline, batched into the arena, in workers."""
