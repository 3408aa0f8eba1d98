"""docs/cli.md is generated from the parser: the page and the parser agree."""

from __future__ import annotations

from servemesh.cli.reference import PAGE, render


def test_the_cli_page_is_what_the_parser_generates() -> None:
    assert PAGE.read_text() == render(), (
        "docs/cli.md is stale: python -m servemesh.cli.reference > docs/cli.md"
    )


def test_the_page_names_every_command_and_the_exit_statuses() -> None:
    page = render()
    for command in ("up", "predict", "apply", "models push", "rollout start", "log query"):
        assert f"`servemesh {command}`" in page
    assert "| 130 | interrupted (Ctrl-C) |" in page
