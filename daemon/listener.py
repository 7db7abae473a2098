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
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .redact import mask_url_passwords

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
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


# sock_diag (netlink): the listening sockets of one family, and only those. Reading
# /proc/net/tcp walks the whole established-connection table too, a few milliseconds on any
# host whatever it holds; this asks the kernel for its listening table alone.
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCPF_LISTEN = 1 << 10
_NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBBI48x")  # family, protocol, ext, pad, states; the socket id
_DIAG_PORT = struct.Struct("!H")  # the reply's source port, network order, after 4 bytes
_DIAG_INODE = struct.Struct("=I")  # the reply's inode, 68 bytes in


def _diag_rows(port: int) -> list[tuple[str, IPAddress, int]] | None:
    """(table, bound address, inode) of the TCP sockets listening on `port`, as sock_diag
    reports them; None where it cannot (no netlink here, or an answer not understood)."""
    rows: list[tuple[str, IPAddress, int]] = []
    for family, name, size in ((socket.AF_INET, "tcp", 4), (socket.AF_INET6, "tcp6", 16)):
        try:
            with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
                nl.settimeout(2.0)
                req = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, TCPF_LISTEN)
                flags = NLM_F_REQUEST | NLM_F_DUMP
                nl.send(
                    _NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), SOCK_DIAG_BY_FAMILY, flags, 1, 0)
                    + req
                )
                done = False
                while not done:
                    data = nl.recv(65536)
                    if not data:
                        return None
                    off = 0
                    while off + _NLMSG_HDR.size <= len(data):
                        length, kind = struct.unpack_from("=IH", data, off)
                        if kind == NLMSG_DONE:
                            done = True
                            break
                        if kind == NLMSG_ERROR or length < _NLMSG_HDR.size + 72:
                            return None
                        msg = off + _NLMSG_HDR.size
                        if _DIAG_PORT.unpack_from(data, msg + 4)[0] == port:
                            bound = ipaddress.ip_address(data[msg + 8 : msg + 8 + size])
                            rows.append((name, bound, _DIAG_INODE.unpack_from(data, msg + 68)[0]))
                        off += (length + 3) & ~3
        except (OSError, AttributeError, ValueError, struct.error):
            return None
    return rows


def _proc_rows(port: int, proc: Path) -> list[tuple[str, IPAddress, int]]:
    """The same rows from /proc/net/tcp{,6}. Raises OSError when neither can be read."""
    rows: list[tuple[str, IPAddress, int]] = []
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
            if int(hexport, 16) == port:
                rows.append((name, _decode_addr(addr), int(cols[9])))
    if not read_any:
        raise OSError("no /proc/net/tcp")
    return rows


def listening_inodes(ip: IPAddress, port: int, proc: Path = Path("/proc")) -> list[int]:
    """Inodes of the sockets a connection to ip:port would reach: exact binds first, then
    wildcard ones. Raises OSError when the listening sockets cannot be read."""
    rows = _diag_rows(port) if proc == Path("/proc") else None
    if rows is None:
        rows = _proc_rows(port, proc)
    exact: list[int] = []
    wildcard: list[int] = []
    for name, bound, inode in rows:
        if bound == ip or (ip.is_unspecified and bound.version == ip.version):
            exact.append(inode)
        elif bound.is_unspecified and (bound.version == ip.version or name == "tcp6"):
            wildcard.append(inode)
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
        return ListenerCheck(None, f"{mask_url_passwords(url)} names no host and port")
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
