"""gpuwarden.api."""
