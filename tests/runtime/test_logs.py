"""Per-request log lines are off by default; warnings and other INFO lines are not."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from servemesh.services.runtime.logs import REQUEST_LOGGERS, configure_logging

REQUEST_LOGGER = logging.getLogger(REQUEST_LOGGERS[0])
OTHER_LOGGER = logging.getLogger("servemesh.services.runtime.server")


@pytest.fixture(autouse=True)
def restored_logging() -> Iterator[None]:
    """configure_logging rewires the root logger: put back what pytest set up."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in REQUEST_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


def _log_a_request_and_more() -> None:
    REQUEST_LOGGER.info("predict", extra={"model": "fraud"})
    REQUEST_LOGGER.warning("predict degraded", extra={"hop": "feature"})
    OTHER_LOGGER.info("serving", extra={"port": 1})


def test_a_request_that_went_well_writes_no_line_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("gateway-zone-a-0", "INFO")
    _log_a_request_and_more()
    assert [line["msg"] for line in _lines(capsys)] == ["predict degraded", "serving"]


def test_request_logs_on_write_a_line_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("gateway-zone-a-0", "INFO", request_logs=True)
    _log_a_request_and_more()
    lines = _lines(capsys)
    assert [line["msg"] for line in lines] == ["predict", "predict degraded", "serving"]
    assert lines[0]["model"] == "fraud" and lines[0]["service"] == "gateway-zone-a-0"


def test_a_stricter_level_still_holds_for_request_loggers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("gateway-zone-a-0", "ERROR")
    _log_a_request_and_more()
    assert _lines(capsys) == []
