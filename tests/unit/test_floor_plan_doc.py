"""docs/architecture.md draws the floor plan as the code measures it: each part on the
floor above the highest part it imports (test_floor_plan.py reads the imports). A change
that moves a part up or down fails here until the drawing is redrawn; the failure prints
the new one."""

from __future__ import annotations

import functools
import re

from tests.unit.test_floor_plan import REPO, imports_by_area

DOC = REPO / "docs" / "architecture.md"
MARK = "<!-- the floors as measured (tests/unit/test_floor_plan_doc.py) -->"
WIDTH = 92


def folder_of(area: str) -> str:
    if area.startswith("services."):
        return f"services/{area.split('.', 1)[1]}/"
    if area in ("registry", "chaos"):
        return f"{area}/"
    return f"servemesh/{area}/" if (REPO / "servemesh" / area).is_dir() else f"servemesh/{area}.py"


def floors() -> dict[int, list[str]]:
    """Floor 0 imports nothing of ours; every other part sits one above its highest import."""
    imports = imports_by_area()

    @functools.cache
    def floor(area: str) -> int:
        below = [other for other in imports[area] if other in imports and other != area]
        return 1 + max(map(floor, below)) if below else 0

    found: dict[int, list[str]] = {}
    for area in sorted(imports):
        found.setdefault(floor(area), []).append(area)
    return found


def drawing() -> str:
    lines = []
    for number, areas in sorted(floors().items(), reverse=True):
        line = f"{number:>2} "
        for folder in map(folder_of, areas):
            if len(line) + len(folder) + 2 > WIDTH:
                lines.append(line.rstrip())
                line = " " * 3
            line += f" {folder} "
        lines.append(line.rstrip())
    return "\n".join(lines)


def drawn() -> str | None:
    found = re.search(re.escape(MARK) + r"\n```text\n(.*?)\n```", DOC.read_text(), re.S)
    return found[1] if found else None


def test_the_architecture_doc_draws_the_floors_the_imports_make() -> None:
    assert drawn() == drawing(), (
        f"docs/architecture.md's floors differ from the imports; under {MARK} put:\n"
        f"```text\n{drawing()}\n```"
    )
