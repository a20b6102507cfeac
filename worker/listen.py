"""Binding a server's listening sockets before it starts, so that a port in use (or a host that cannot be
listened on) is one clear error naming the flag, not a traceback from inside the server."""

from __future__ import annotations

import errno
import socket


def listen_sockets(host: str, port: int, *, host_flag: str = "--host", port_flag: str = "--port") -> list[socket.socket]:
    """Listening sockets on every address of host:port (as aiohttp binds them: SO_REUSEADDR, IPv6 only on
    IPv6 addresses); ValueError naming `host_flag`/`port_flag` when one cannot be had."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"{host_flag} {host}: cannot resolve it ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks (IPv6 off): the server skips it too
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ValueError(f"{port_flag} {port}: {host}:{port} is already in use; stop what listens "
                                     f"there or choose another {port_flag}") from None
                raise ValueError(f"{host_flag} {host} {port_flag} {port}: cannot listen there ({exc.strerror})") from None
            sock.listen()
        if not sockets:
            raise ValueError(f"{host_flag} {host}: no address of it can be listened on")
    except BaseException:
        close_all(sockets)
        raise
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
