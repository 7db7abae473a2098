"""Who answers a health URL: the launch's own processes, or someone else on its port?

A 200 on the port, or SGLang's ready line (its warm-up request may have reached another server
on that port while its own bind failed), does not prove that *this* launch answers. When the
URL's host is an address of this machine, the listening socket is looked up in
``/proc/net/tcp{,6}`` (the most specific bind wins, as the kernel routes it: an exact address
before the wildcard) and its inode is looked for among the descriptors of the launch's
processes. Linux only; elsewhere, or for a remote host, the answer is "cannot tell".
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

_LISTEN = "0A"
# A foreign holder is looked for among this many processes at most (a busy host has many).
_SCAN_LIMIT = 20_000


@dataclass(frozen=True)
class ListenerCheck:
    """`ours`: True (a process of the launch holds it), False (another process does), None
    (cannot tell, or nobody listens: `detail` says why)."""

    ours: bool | None
    detail: str
    holder: int | None = None  # the foreign pid, when found
    nothing_listens: bool = False


def url_endpoint(url: str) -> tuple[str, int] | None:
    parts = urlsplit(url)
    if parts.hostname is None:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return parts.hostname, port


def _local_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    import psutil  # noqa: PLC0415

    out: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    with contextlib.suppress(OSError):
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    with contextlib.suppress(ValueError):
                        out.add(ipaddress.ip_address(a.address.split("%", 1)[0]))
    return out


def local_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `host` names if it is one of this machine's, else None."""
    if host == "localhost":
        return ipaddress.ip_address("127.0.0.1")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return ip
    return ip if ip in _local_addresses() else None


def _decode_addr(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    # Four 32-bit words, each in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return v6.ipv4_mapped or v6


def listening_inodes(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, proc: Path = Path("/proc")
) -> list[int]:
    """Inodes of the sockets a connection to ip:port would reach: exact binds first, then
    wildcard ones. Raises OSError when /proc/net cannot be read."""
    exact: list[int] = []
    wildcard: list[int] = []
    read_any = False
    for name in ("tcp", "tcp6"):
        try:
            text = (proc / "net" / name).read_text()
        except FileNotFoundError:
            continue
        read_any = True
        for row in text.splitlines()[1:]:
            cols = row.split()
            if len(cols) < 10 or cols[3] != _LISTEN:
                continue
            addr, _, hexport = cols[1].partition(":")
            if int(hexport, 16) != port:
                continue
            bound = _decode_addr(addr)
            inode = int(cols[9])
            if bound == ip or (ip.is_unspecified and bound.version == ip.version):
                exact.append(inode)
            elif bound.is_unspecified and (bound.version == ip.version or name == "tcp6"):
                wildcard.append(inode)
    if not read_any:
        raise OSError("no /proc/net/tcp")
    return exact or wildcard


def socket_inodes(pid: int, proc: Path = Path("/proc"), strict: bool = False) -> set[int]:
    """The socket inodes `pid` holds. `strict`: a process whose descriptors cannot be read
    (another user's, without the privilege) raises PermissionError instead of holding none."""
    out: set[int] = set()
    try:
        entries = list(os.scandir(proc / str(pid) / "fd"))
    except PermissionError:
        if strict:
            raise
        return out
    except OSError:
        return out  # gone
    with contextlib.suppress(OSError):
        for fd in entries:
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


def _find_holder(inodes: set[int], skip: set[int], proc: Path) -> int | None:
    with contextlib.suppress(OSError):
        for n, entry in enumerate(os.scandir(proc)):
            if n > _SCAN_LIMIT:
                break
            pid = int(entry.name) if entry.name.isdigit() else None
            if pid is not None and pid not in skip and socket_inodes(pid, proc) & inodes:
                return pid
    return None


def describe_pid(pid: int) -> str:
    """The pid and its program's name: not its command line, which may carry its secrets."""
    import psutil  # noqa: PLC0415

    try:
        return f"pid {pid} ({psutil.Process(pid).name()})"
    except psutil.Error:
        return f"pid {pid}"


def check_listener(
    url: str, pids: Iterable[int] | Callable[[], Iterable[int]], proc: Path = Path("/proc")
) -> ListenerCheck:
    """Does one of `pids` hold the socket that answers `url`? Blocking (reads /proc). `pids`
    may be a function: the process tree is walked only when something listens."""
    endpoint = url_endpoint(url)
    if endpoint is None:
        return ListenerCheck(None, f"{url} names no host and port")
    host, port = endpoint
    ip = local_ip(host)
    if ip is None:
        return ListenerCheck(None, f"{host} is not an address of this machine")
    try:
        inodes = listening_inodes(ip, port, proc)
    except OSError as exc:
        return ListenerCheck(None, f"the listening sockets cannot be read ({exc})")
    where = f"{host}:{port}"
    if not inodes:
        # A program whose ready line is its only readiness (no HTTP): nothing to compare.
        return ListenerCheck(None, f"nothing listens on {where}", nothing_listens=True)
    ours = set(pids() if callable(pids) else pids)
    held = set(inodes)
    for pid in ours:
        try:
            if socket_inodes(pid, proc, strict=True) & held:
                return ListenerCheck(True, f"{where} is held by pid {pid} of this launch")
        except PermissionError:
            return ListenerCheck(
                None, f"the descriptors of pid {pid} of this launch are unreadable"
            )
    # Not ours is said only of a holder found: one this daemon cannot see proves nothing.
    holder = _find_holder(held, ours, proc)
    if holder is None:
        return ListenerCheck(None, f"{where} is held by a process whose descriptors are unreadable")
    return ListenerCheck(
        False, f"{where} is held by {describe_pid(holder)}, not by this launch", holder
    )
