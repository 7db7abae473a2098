"""The front proxy (`proxy:` in the settings): clients use its address, the server listens on
its config's port behind it. It runs as a process of its own, so it outlives the daemon
(`python -m gpuwarden.daemon.proxy`); the daemon tells it the server's state (`gate.py`).
Standard library only.
"""
