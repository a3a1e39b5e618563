"""Past one machine: layers, their weights and their KV cache on llama.cpp RPC servers.

llama.cpp's RPC backend (`GGML_RPC`) makes each device of a remote `ggml-rpc-server` a device of this
process: llama.cpp places whole layers on it (their weights and their part of the KV cache) and runs
their part of every graph there; only activations cross the wire. kvlocal's routed graph is built
from ordinary ggml ops, so it runs there unchanged.

Here: the `HOST:PORT` lists (`--rpc`, or KVLOCAL_RPC), a probe of a server that speaks the protocol's
handshake itself (reachability, protocol version, devices and their memory) before the engine connects
(the engine aborts the process on a server it cannot reach), the layer split (`Placement`), its
summary, and the checks of `kvlocal rpc-server` before it becomes the server. The engine's side
(registering the servers' devices, loading the model over them) is in kvlocal.engine.

The RPC protocol is unauthenticated (upstream: never expose it to an open network): `kvlocal
rpc-server` binds loopback unless --allow-remote.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import NoReturn

from kvlocal.addresses import is_loopback
from kvlocal.errors import EngineError, UsageError

ENV_SERVERS = "KVLOCAL_RPC"  # the servers `--rpc` names when it is not given
DEFAULT_PORT = 50052  # ggml-rpc-server's default
PROBE_TIMEOUT_S = 5.0

# the protocol of the pinned engine (ggml-rpc.h: RPC_PROTO_*_VERSION); a server answers HELLO with its
# own, and the client accepts the same major version and a minor version no newer than its own
RPC_PROTOCOL = (7, 0, 0)
_CMD_GET_DEVICE_MEMORY, _CMD_HELLO, _CMD_DEVICE_COUNT = 11, 14, 15
_CMD_KVLOCAL_BUILD, _BUILD_BYTES = 18, 64  # kvlocal's own command (patch 0019): the server's patch set
_CONN_CAPS = 24  # bytes of transport capabilities in HELLO (zero: plain TCP)


class RpcError(EngineError):
    """An RPC server that cannot be used (unreachable, another protocol, gone mid-answer)."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """`HOST:PORT[,HOST:PORT...]` (as llama.cpp's --rpc); UsageError naming the bad one."""
    endpoints = []
    for item in (part.strip() for part in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{item!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})", setting="rpc")
        endpoints.append(Endpoint(host, int(port)))
    if len(set(endpoints)) != len(endpoints):
        raise UsageError(f"a server is named twice: {text}", setting="rpc")
    return tuple(endpoints)


@dataclass(frozen=True)
class ServerInfo:
    endpoint: Endpoint
    protocol: tuple[int, int, int]
    devices: tuple[tuple[int, int], ...]  # (free, total) bytes per device
    build: str  # "kvlocal:<patch-set id>" the server was built from

    def describe(self) -> str:
        from kvlocal.units import human_bytes

        memory = ", ".join(f"{human_bytes(free)} free of {human_bytes(total)}" for free, total in self.devices)
        n = len(self.devices)
        return (f"RPC protocol {'.'.join(map(str, self.protocol))}, patch set {self.build.removeprefix('kvlocal:')}, "
                f"{n} device{'s' if n != 1 else ''} ({memory})")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def _command(sock: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    """One request (| cmd: 1 byte | size: 8 bytes | payload |) and its reply (| size: 8 | data |)."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != reply_size:
        raise ConnectionError(f"a reply of {size} bytes where {reply_size} were expected")
    return _recv_exact(sock, size)


def probe(endpoint: Endpoint, timeout: float = PROBE_TIMEOUT_S) -> ServerInfo:
    """Ask a server its protocol version, the patch set it was built from, its devices and their
    memory (the handshake the engine's client does first); RpcError in one line when it cannot serve
    this engine: another protocol, or another patch set than this engine's."""
    from kvlocal.engine import require_patched

    build = require_patched().build_id
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock:
            try:
                hello = _command(sock, _CMD_HELLO, bytes(_CONN_CAPS), 4 + _CONN_CAPS)
            except ConnectionError as err:
                raise RpcError(f"RPC server {endpoint} did not answer the protocol's handshake ({err}): not a "
                               f"ggml-rpc-server of protocol {RPC_PROTOCOL[0]}.x") from None
            protocol = tuple(hello[:3])
            if protocol[0] != RPC_PROTOCOL[0] or protocol[1] > RPC_PROTOCOL[1]:
                raise RpcError(f"RPC server {endpoint} speaks protocol {'.'.join(map(str, protocol))}, this engine "
                               f"{'.'.join(map(str, RPC_PROTOCOL))}: run the server built with this kvlocal "
                               f"(`kvlocal rpc-server`)")
            try:
                server_build = _command(sock, _CMD_KVLOCAL_BUILD, b"", _BUILD_BYTES).split(b"\0", 1)[0].decode()
            except (ConnectionError, UnicodeDecodeError):
                server_build = ""
            if server_build != build:
                said = f"patch set {server_build.removeprefix('kvlocal:')}" if server_build else "no kvlocal patch set"
                raise RpcError(f"RPC server {endpoint} was built from {said}, this engine from "
                               f"{build.removeprefix('kvlocal:')}: run the server of this kvlocal (`kvlocal rpc-server`)")
            (count,) = struct.unpack("<I", _command(sock, _CMD_DEVICE_COUNT, b"", 4))
            devices = tuple(struct.unpack("<QQ", _command(sock, _CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                            for i in range(count))
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint} did not answer within {timeout:g} s (a server serves one client at "
                       f"a time: is another kvlocal using it?)") from None
    except OSError as err:
        raise RpcError(f"cannot reach RPC server {endpoint}: {err.strerror or err}") from None
    if not devices:
        raise RpcError(f"RPC server {endpoint} has no devices")
    return ServerInfo(endpoint, protocol, devices, server_build)


# -- where the layers go --------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """The servers a model's layers are split over, and each machine's share: this one first, then
    the servers in the order given (`--tensor-split`; default: equal shares).

    llama.cpp's layer split (kvlocal.engine.layer_plan): the model's N layers and its output layer
    (N + 1 places) are split in proportion to the shares, this machine taking the first layers, each
    server the next ones in order; a layer's KV cache lives where its weights do."""

    servers: tuple[Endpoint, ...]
    shares: tuple[float, ...]

    def describe(self) -> str:
        return ", ".join(f"{where} {share:g}" for where, share in zip(["here", *map(str, self.servers)], self.shares))


def placement(rpc: str | None, tensor_split: str | None) -> Placement | None:
    """The placement `--rpc` and `--tensor-split` ask for (None: all layers here); UsageError on bad input."""
    if not rpc or not rpc.strip():
        if tensor_split:
            raise UsageError("--tensor-split needs --rpc (the servers to split the layers over)", setting=None)
        return None
    servers = parse_endpoints(rpc)
    if tensor_split is None:
        return Placement(servers, (1.0,) * (len(servers) + 1))
    try:
        shares = tuple(float(s) for s in tensor_split.split(","))
    except ValueError:
        raise UsageError(f"{tensor_split!r} is not a list of numbers, e.g. 1,1,1", setting="tensor_split") from None
    if len(shares) != len(servers) + 1:
        raise UsageError(f"--tensor-split gives {len(shares)} shares; it needs {len(servers) + 1}: this machine's, "
                         f"then one per --rpc server")
    if any(not s >= 0 for s in shares) or not sum(shares[1:]) > 0:
        raise UsageError("the shares are >= 0 and the servers' add up to more than 0",
                         setting="tensor_split")
    return Placement(servers, shares)


def check_servers(place: Placement) -> list[ServerInfo]:
    """Every server of `place`, probed; RpcError on the first that cannot serve."""
    return [probe(endpoint) for endpoint in place.servers]


def _refuses(endpoint: Endpoint, tries: int = 5, pause: float = 0.2) -> bool:
    """Whether `endpoint` refuses connections. A server that is exiting may still accept for a moment
    after its client's connection broke (its sockets close one by one): ask again a few times."""
    for attempt in range(tries):
        try:
            socket.create_connection((endpoint.host, endpoint.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # busy (serving this process's engine) or slow: not known to be gone
        if attempt + 1 < tries:
            time.sleep(pause)
    return False


def server_gone(detail: str, servers: tuple[Endpoint, ...] = ()) -> str:
    """The one line for a fatal engine error while RPC servers hold layers (engine.exit_on_engine_abort),
    naming the `servers` that now refuse connections."""
    gone = [str(endpoint) for endpoint in servers if _refuses(endpoint)]
    which = f"RPC server {', '.join(gone)} is gone" if gone else "an RPC server stopped answering"
    return (f"kvlocal: error: the engine stopped ({detail}): {which}; the saved KV states are intact: ask again "
            f"once the servers are back (`kvlocal doctor --rpc ...` lists them)")


def describe_layers(layer_devices: list[str], labels: dict[str, str]) -> str:
    """'layers 0-11 here (CPU), 12-23 and the output on 10.0.0.2:50052 (RPC0)' from the device of each
    layer (the last entry: the output layer) and each device's label."""
    runs: list[tuple[str, int, int]] = []  # (device, first, last)
    for i, dev in enumerate(layer_devices):
        if runs and runs[-1][0] == dev:
            runs[-1] = (dev, runs[-1][1], i)
        else:
            runs.append((dev, i, i))
    n_layer = len(layer_devices) - 1
    parts = []
    for dev, first, last in runs:
        span = [] if first >= n_layer else [f"{first}" if min(last, n_layer - 1) == first
                                            else f"{first}-{min(last, n_layer - 1)}"]
        if last == n_layer:
            span.append("the output")
        where = labels.get(dev, dev)
        parts.append(f"{' and '.join(span)} on {where} ({dev})")
    return "layers " + ", ".join(parts)


def wire_bytes(servers: tuple[Endpoint, ...]) -> tuple[int, int]:
    """(sent, received): the bytes this process's TCP connections to `servers` carried so far (the
    engine's RPC connections; Linux's TCP_INFO: tcpi_bytes_sent, tcpi_bytes_received, Linux 4.19 on),
    (0, 0) where the system does not tell."""
    peers = set()
    for endpoint in servers:
        try:
            peers |= {(info[4][0], endpoint.port) for info in socket.getaddrinfo(endpoint.host, endpoint.port)}
        except socket.gaierror:
            continue
    sent = received = 0
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return 0, 0
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:  # a duplicate of the engine's
                if sock.getpeername()[:2] not in peers:
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 208)
        except OSError:
            continue
        if len(info) < 208:
            return 0, 0
        # struct tcp_info: tcpi_bytes_received at 128, tcpi_bytes_sent at 200 (bytes_acked lags by a delayed ACK)
        sent, received = sent + struct.unpack_from("<Q", info, 200)[0], received + struct.unpack_from("<Q", info, 128)[0]
    return sent, received


# -- kvlocal rpc-server ---------------------------------------------------------------------------


def check_bind(host: str, port: int, allow_remote: bool) -> str | None:
    """Refuse a non-loopback address unless `allow_remote` (then the warning to print), and a port
    that cannot be bound; UsageError in one line."""
    warning = None
    if not is_loopback(host):
        if not allow_remote:
            raise UsageError(f"--host {host} is not a loopback address: the RPC protocol has no authentication, "
                             f"so anyone who reaches the port can run code on this machine; add --allow-remote on a "
                             f"trusted network")
        warning = (f"warning: serving RPC on {host}:{port} without authentication; anyone who reaches it can use "
                   f"this machine's memory and CPU: only on a trusted network")
    try:
        family = socket.getaddrinfo(host, port)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as err:
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}", setting="port") from None
    return warning


def serve(host: str, port: int, threads: int | None, mem: str | None, allow_remote: bool) -> NoReturn:
    """Become llama.cpp's RPC server (exec: Ctrl-C and signals reach it directly), after the checks:
    this engine's server exists, the address is loopback (or allowed), the port is free; `mem` caps
    the memory it may allocate. Its own log goes to stderr."""
    import resource
    import sys

    from kvlocal.engine import default_threads, require_patched, rpc_server_binary
    from kvlocal.units import parse_bytes

    info = require_patched()
    binary = rpc_server_binary()
    warning = check_bind(host, port, allow_remote)
    limit = int(parse_bytes(mem) or 0) if mem is not None else None
    if limit is not None and limit < 1 << 20:
        raise UsageError(f"not a memory size of 1 MiB or more: {mem!r} (for example 24GiB)", setting="mem")
    if warning:
        print(f"kvlocal: {warning}", file=sys.stderr)
    cap = f", memory cap {mem}" if limit else ""
    print(f"kvlocal: RPC server on {host}:{port}: protocol {'.'.join(map(str, RPC_PROTOCOL))}, engine patch set "
          f"{info.patchset}{cap}; clients: kvlocal ask --rpc {host}:{port} ...; Ctrl-C stops it", file=sys.stderr)
    if limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    argv = [str(binary), "--host", host, "--port", str(port), "--threads", str(threads or default_threads())]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(2, 1)  # the server's banner and connection log: diagnostics
    os.execv(binary, argv)


def rpc_report(servers: str | None) -> list[str]:
    """kvlocal doctor's lines: the RPC backend of this engine, and each server named (`--rpc` or
    KVLOCAL_RPC) with what it answers, or why it cannot be reached."""
    from kvlocal.engine import rpc_server_binary

    try:
        lines = [f"RPC: built in (protocol {'.'.join(map(str, RPC_PROTOCOL))}; server {rpc_server_binary()})"]
    except EngineError as err:
        lines = [f"RPC: {err}"]
    if not servers or not servers.strip():
        return lines + [f"RPC servers: none named (doctor --rpc HOST:PORT[,...] or ${ENV_SERVERS})"]
    for endpoint in parse_endpoints(servers):
        try:
            lines.append(f"RPC server {endpoint}: reachable, {probe(endpoint).describe()}")
        except RpcError as err:
            lines.append(f"RPC server {endpoint}: UNREACHABLE: {err}")
    return lines
