"""The mesh's own alert receiver: the webhook Alertmanager notifies (servemesh.procs.
alertmanager), keeping every alert it is sent, firing or resolved, one JSON line each in
`<state_dir>/alerts/received.jsonl` (owner-only), for `servemesh alerts` and the drills.

`POST /<receiver>` takes Alertmanager's webhook body (version 4: `status`, `receiver`,
`alerts` with `status`, `labels`, `annotations`, `startsAt`, `endsAt`, `fingerprint`);
`GET /ready` answers once it listens. Loopback only; a body over MAX_BODY_BYTES is 413, one
that is not such JSON 400, and nothing of it is kept.

    python -m servemesh.observe.alert_receiver --state-dir DIR --listen 127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RECEIVED = Path("alerts") / "received.jsonl"
MAX_BODY_BYTES = 1 << 20
# What each kept line holds of an alert (Alertmanager sends more: generator URLs, ids).
_KEPT = ("status", "labels", "annotations", "startsAt", "endsAt", "fingerprint")


def received_path(state_dir: Path) -> Path:
    return Path(state_dir) / RECEIVED


def read_received(state_dir: Path) -> list[dict[str, Any]]:
    """Every alert the receiver kept, oldest first (none yet: empty)."""
    path = received_path(state_dir)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kept_lines(route: str, body: Any, now: float) -> list[str]:
    """One JSON line per alert of a webhook body; ValueError when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("alerts"), list):
        raise ValueError("alerts: expected Alertmanager's webhook body with a list of alerts")
    lines = []
    for alert in body["alerts"]:
        if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
            raise ValueError("alerts[].labels: expected an object")
        kept = {key: alert.get(key) for key in _KEPT}
        lines.append(json.dumps({"received": round(now, 3), "route": route, **kept}))
    return lines


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(200 if self.path == "/ready" else 404)

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._answer(400)
            return
        if length > MAX_BODY_BYTES:
            self._answer(413)
            return
        try:
            body = json.loads(self.rfile.read(length))
            lines = kept_lines(self.path.strip("/") or "mesh", body, time.time())
        except ValueError:  # JSONDecodeError included
            self._answer(400)
            return
        self.server.keep(lines)
        self._answer(200)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # Alertmanager's retries would fill the log; the kept lines are the record


class _Receiver(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], path: Path) -> None:
        super().__init__(address, _Handler)
        self.path = path
        self.lock = threading.Lock()

    def keep(self, lines: list[str]) -> None:
        with self.lock, self.path.open("a", encoding="utf-8") as file:
            file.writelines(line + "\n" for line in lines)


def serve(state_dir: Path, host: str, port: int) -> None:
    path = received_path(state_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    with _Receiver((host, port), path) as server:
        server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--listen", required=True, help="host:port")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    serve(Path(args.state_dir), host, int(port))


if __name__ == "__main__":
    main()
