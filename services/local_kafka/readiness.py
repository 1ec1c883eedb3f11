"""Whether a node serves: an open port, and a Metadata request that lists it (Kafka's wire
protocol by hand: the launcher uses the standard library only)."""

from __future__ import annotations

import socket
import struct


def metadata_request(client_id: bytes = b"draftstream-kafka-sh") -> bytes:
    """A framed Metadata v1 request (api key 3, correlation id 1) for no topics."""
    req = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", 0)
    return struct.pack(">i", len(req)) + req


def metadata_ready(response: bytes, port: int) -> bool:
    """True when a framed Metadata v1 response lists a broker on ``port`` and names a controller.

    Raises:
        struct.error: the response is truncated or malformed.
    """
    off = 8  # size, correlation id
    (count,) = struct.unpack_from(">i", response, off)
    off += 4
    ports = []
    for _ in range(count):
        (host_len,) = struct.unpack_from(">h", response, off + 4)
        off += 6 + host_len
        ports.append(struct.unpack_from(">i", response, off)[0])
        (rack_len,) = struct.unpack_from(">h", response, off + 4)
        off += 6 + max(rack_len, 0)
    (controller,) = struct.unpack_from(">i", response, off)
    return controller >= 0 and port in ports


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """A bare TCP connect (the address is local: no hang to fear)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def probe_ready(host: str, port: int) -> bool:
    """The port answers AND a Metadata request lists this broker and a controller."""
    try:
        with socket.create_connection((host, port), timeout=2) as sock:
            sock.settimeout(5)
            sock.sendall(metadata_request())
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return False
                buf += chunk
        return metadata_ready(buf, port)
    except (OSError, struct.error):
        return False
