"""Implementation; the public API is what ``sidecar/__init__.py`` re-exports."""
