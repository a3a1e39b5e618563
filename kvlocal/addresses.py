"""Listening addresses: whether a host is this machine's loopback (kvlocal serve, kvlocal rpc-server)."""

from __future__ import annotations

import ipaddress
import socket

from kvlocal.errors import UsageError


def is_loopback(host: str) -> bool:
    """`host` (a name or address) resolves to loopback addresses only; UsageError if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise UsageError(f"{host!r}: {err.strerror}", setting="host") from None
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
