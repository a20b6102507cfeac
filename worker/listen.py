"""Binding a server's listening sockets before it starts, so that a port in use (or a host that cannot be
listened on) is one clear error naming the flag (a StartupError: exit 2), not a traceback from inside the
server."""

from __future__ import annotations

import errno
import socket

from lorafleet.worker.startup_errors import StartupError


def port_in_use(host: str, port: int, port_flag: str = "--port") -> StartupError:
    return StartupError(f"{port_flag} {port}: {host}:{port} is already in use; stop what listens there or choose "
                        f"another {port_flag}")


ANY_HOST = "*"  # every address of every family the machine has: 0.0.0.0 and :: (IPv4, IPv6 and dual-stack pods)


def listen_sockets(host: str, port: int, *, host_flag: str = "--host", port_flag: str = "--port") -> list[socket.socket]:
    """Listening sockets on every address of host:port (as aiohttp binds them: SO_REUSEADDR, IPv6 only on
    IPv6 addresses); StartupError naming `host_flag`/`port_flag` when one cannot be had. `*` (ANY_HOST): the
    wildcard address of each family, a family the machine cannot listen on left out."""
    wildcard = host == ANY_HOST
    try:
        addresses = socket.getaddrinfo(None if wildcard else host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"{host_flag} {host}: cannot resolve it ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks (IPv6 off): the server skips it too
                continue
            if port == 0 and sockets:  # any free port: the one the first socket got, for every family
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise port_in_use(host, port, port_flag) from None
                if wildcard and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # IPv6 turned off
                    sockets.pop().close()
                    continue
                raise StartupError(f"{host_flag} {host} {port_flag} {port}: cannot listen there ({exc.strerror}); "
                                   f"choose another {host_flag} or {port_flag}") from None
            sock.listen()
        if not sockets:
            raise StartupError(f"{host_flag} {host}: no address of it can be listened on; choose another {host_flag}")
    except BaseException:
        close_all(sockets)
        raise
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
