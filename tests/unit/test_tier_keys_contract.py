"""The tiers' Redis key layout is spelled once: in servemesh/contract/tier_keys.py.

Every writer (`batch score --out redis`) and reader (the feature store, its change feed,
`cache flush`) asks tier_keys for a key. A module that spells a tier key itself fails here:
a string naming the tiers' key segments (`.scores`, `.tiers`), or an f-string that extends
a key tier_keys made (`f"{scores_base(...)}:current"`, `f"{base}@{run}"`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from servemesh.contract import tier_keys

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ["servemesh", "services", "registry", "chaos", "examples"]
OWNER = REPO / "servemesh" / "contract" / "tier_keys.py"
# A tier key segment, as a key spells it: `fs.scores:...`, `f"{prefix}.tiers"`.
SEGMENT = re.compile(
    "(" + "|".join(re.escape(s) for s in (tier_keys.SCORES, tier_keys.TIERS)) + ")(:|$)"
)
# The writers and readers of the tiers' keys: each must take them from tier_keys.
USERS = [
    "servemesh/batch/writers.py",
    "services/feature/store.py",
    "services/feature/changes.py",
    "servemesh/cli/cache.py",
]


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _tier_key_names(tree: ast.AST) -> set[str]:
    """The names a module imports from tier_keys, and the names it binds to their results
    (a key, or a ScoreKeys whose attributes are keys)."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "servemesh.contract.tier_keys"
        for alias in node.names
    }
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _made_by(node.value, imported):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.add(target.id)
                elif isinstance(target, ast.Attribute):
                    bound.add(target.attr)
    return imported | bound


def _made_by(node: ast.AST, names: set[str]) -> bool:
    """Whether `node` is a call of one of `names` (or an attribute of such a call)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    if isinstance(node, ast.Call):
        func = node.func
        return isinstance(func, ast.Name) and func.id in names
    return False


def _mentions(node: ast.AST, names: set[str]) -> bool:
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name) and inner.id in names:
            return True
        if isinstance(inner, ast.Attribute) and inner.attr in names:
            return True
    return False


def _extends(text: str) -> bool:
    """Whether `text`, after a key, makes another key (`:current`, `@3`), not prose (`: ...`)."""
    return text[:1] in (":", "@") and not text[1:2].isspace()


def spellings(source: str, where: str) -> list[str]:
    """Where `source` formats a tier key of its own: a string with a tier key segment, or an
    f-string extending a value tier_keys made."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    names = _tier_key_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings and SEGMENT.search(node.value):
                found.append(f"{where}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr):
            values = node.values
            for value, after in zip(values, values[1:], strict=False):
                if (
                    isinstance(value, ast.FormattedValue)
                    and _mentions(value.value, names)
                    and isinstance(after, ast.Constant)
                    and _extends(str(after.value))
                ):
                    found.append(f"{where}:{node.lineno}: an f-string extends a tier key")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            sides = (node.left, node.right)
            if any(_mentions(side, names) for side in sides) and any(
                isinstance(side, ast.Constant) and _extends(str(side.value)) for side in sides
            ):
                found.append(f"{where}:{node.lineno}: a tier key extended with +")
    return found


def product_files() -> list[Path]:
    return [
        path
        for folder in PRODUCT
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != OWNER and "servemesh_api" not in path.parts
    ]


def test_no_module_but_tier_keys_formats_a_tier_key() -> None:
    found = [
        hit
        for path in product_files()
        for hit in spellings(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert found == [], (
        "tier keys formatted outside servemesh/contract/tier_keys.py:\n" + "\n".join(found)
    )


@pytest.mark.parametrize("where", USERS)
def test_every_writer_and_reader_takes_its_keys_from_tier_keys(where: str) -> None:
    tree = ast.parse((REPO / where).read_text())
    assert any(
        isinstance(node, ast.ImportFrom) and node.module == "servemesh.contract.tier_keys"
        for node in ast.walk(tree)
    ), f"{where} reads or writes tier keys without servemesh.contract.tier_keys"


@pytest.mark.parametrize(
    "source",
    [
        'key = f"{prefix}.scores:{model}:{version}"',
        'key = prefix + ".tiers:" + model',
        'base = f"{key_prefix}.scores"',
        "from servemesh.contract.tier_keys import scores_base\n"
        "k = f'{scores_base(p, m, v)}:current'",
        "from servemesh.contract.tier_keys import scores_base\nbase = scores_base(p, m, v)\n"
        "k = base + ':seq'",
        "from servemesh.contract.tier_keys import score_keys\nself.keys = score_keys(p, m, v)\n"
        "k = f'{self.keys.base}@{run}'",
    ],
)
def test_the_check_finds_a_key_spelled_by_hand(source: str) -> None:
    assert spellings(source, "example.py") != []


def test_the_layout_reads_back() -> None:
    keys = tier_keys.score_keys("fs", "fraud", "v2")
    assert keys.current == "fs.scores:fraud:v2:current"
    assert keys.answer(3, "u1") == "fs.scores:fraud:v2@3:u1"
    assert tier_keys.flush_key("fs", "fraud") == "fs.tiers:fraud:flush"
    assert tier_keys.model_of(keys.current, "fs") == "fraud"
    assert tier_keys.model_of("fs.tiers:fraud:flush", "fs") == "fraud"
    assert tier_keys.model_of(keys.answer(3, "u1"), "fs") is None
    assert tier_keys.model_of("fs:user:current", "fs") is None
