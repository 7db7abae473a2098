"""The server and the processes around it, one concern a module:

* `local`: the local server's handle (`LocalServer`, an `effects.ServerHandle`) and `start`,
  which makes it: the spawn, its pipes, its exit read from its pidfd.
* `reaper`: processes that are not a handle: the subreaper's orphans, what a launch left
  behind, a server a previous life of the daemon left running, which pids are owned.
* `helpers`: `run_helper`, through which every helper process (the server's option
  introspection, the benchmark) is started, bounded and killed with its whole group.
"""
