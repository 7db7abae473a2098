"""gpuwarden.daemon."""
