"""Helpers that several test files share; test files import from here, never from each other
(tests/test_layout.py checks it). Fixtures are in tests/conftest.py.

- procs: `Proc` (a real child, its output read line by line), `free_port`, `wait_until`,
  `owned_processes` (no process group or launched server outlives a test), `require_tool`.
- configs: stand-in server configs (`standin_config`, `two_configs`), a daemon's settings
  (`write_setup` for one run as a process, `make_settings` in-process), the YAML alias `BOMB`.
- daemon: `start_daemon` (`gpuwarden serve` as a process, listening) and `Daemon`, which follows
  it through its JSON log records and its HTTP API; `serve` and `gpuwarden` for other starts.
- supervisor: `running` (the supervisor in-process) and `FakeClock`.
- effects: `RecordingEffects`, the machine's `Effects` written out, each call recorded.
- machine: `World`, a machine without processes and the messages a host would post to it.
- http: raw sockets against the control plane, a `/logs/stream` client that never reads, a
  webhook `Receiver`.
- gpu: `start_holder`, a foreign process holding memory on a fake GPU.
"""
