"""The fork server's messages: one JSON object per SOCK_SEQPACKET message, a child's log
descriptor with its request (SCM_RIGHTS)."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any

MAX_MESSAGE = 1 << 20


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    payload = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.send(payload)
