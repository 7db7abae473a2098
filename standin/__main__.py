"""``python -m gpuwarden.standin``: the SGLang stand-in server.

Spawned children re-import this module as ``__mp_main__``, so it imports nothing at the top.
"""

if __name__ == "__main__":
    import sys

    from .server import main

    sys.exit(main())
