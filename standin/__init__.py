"""gpuwarden.standin."""
