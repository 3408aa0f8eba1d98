"""Inspect a torch.export archive (`.pt2`) before torch parses it: refuse what could run code.

`torch.export.load` in torch 2.13 is not safe on untrusted bytes; its own docstring says it
"uses pickle under the hood". Reading its code (torch/export/__init__.py,
torch/export/pt2_archive/_package.py, torch/_export/serde/serialize.py,
torch/export/_unlift.py) and crafting archives showed these ways for an archive to run code
of its author's choosing in the loading process:

- weights or constants marked `use_pickle: true` go to `torch.load(weights_only=False)`:
  os.system ran at load;
- sample inputs (`data/sample_inputs/*.pt`) that fail `torch.load(weights_only=True)` are
  retried with `weights_only=False`: os.system ran at load;
- constants named `opaque_obj_*` go to `pickle.loads`, `custom_obj_*` to the TorchScript
  object unpickler (read in the code);
- symbolic shape strings (`expr_str`) go to `sympy.sympify`, which is `eval`: os.system ran
  at load;
- `guards_code` strings are pasted into the source of a function that `ep.module()` `exec`s
  into being and every forward pass calls: a file was opened on the first call;
- `forward_arg_names` are pasted into the generated `forward` source (a crafted name
  reached the generated code; it failed to compile there);
- `data/aotinductor/...` is loaded as a compiled shared library (read);
- a pre-2.7 layout (a root `version`, `serialized_*.pt`) takes a legacy path with the same
  `torch.load` fallback (read);
- node targets are resolved by attribute walk from `torch` (`torch.os.system` resolves to
  os.system); torch's own verifier refused such a node in the cases tried.

So servemesh never hands torch an archive it has not checked against this allowlist
(`check_export_archive`): the current layout only, one program named `model`, every entry
stored uncompressed with a plain name; weights and constants as raw tensor bytes only; no
AOTInductor, executorch, extra or legacy parts; the sample inputs a pickle of tensors only
(its GLOBALs from a short list, and loadable with `weights_only=True`, so torch never falls
back); every symbolic expression and guard parsed with `ast` and made of nothing but
literals, known sympy constructors, arithmetic and comparisons (the only attribute,
subscript and method call allowed are a guard's `L['x'].size()[0]` and its kin); forward
argument names plain identifiers; every graph node an ATen operator on the allowlist
(`op_allowlist`: pure tensor maths; never `aten::save` or `aten::from_file`) or one of
torch's symbolic-int helpers. After torch has loaded it,
`check_loaded_program` walks the graph again. The ATen operators allowed are
`op_allowlist`'s, the list TorchScript archives are held to.

An archive that passes is parsed by torch and runs aten operators on tensors: the same trust
as a TorchScript archive (whose code is TorchScript, compiled by torch, not Python).
"""

from __future__ import annotations

import ast
import io
import json
import pickletools
import re
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from servemesh.contract.errors import ServemeshError
from servemesh.services.model.op_allowlist import allowed_operator

__all__ = [
    "UnsafeArtifact",
    "archive_members",
    "check_export_archive",
    "check_loaded_program",
    "whole_zip",
]

# The layout torch 2.13 writes (torch.export.pt2_archive.constants), under one top folder.
ARCHIVE_FORMAT = ("archive_format", b"pt2")
ARCHIVE_VERSION = ("archive_version", b"0")
MODEL_JSON = "models/model.json"
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
SAMPLE_INPUTS = "data/sample_inputs/model.pt"
BOOKKEEPING = {"byteorder", ".data/version", ".data/serialization_id"}
PAYLOAD_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
TOP_FOLDER = re.compile(r"[A-Za-z0-9_.-]{1,128}")

# Node targets: ATen operators, and the symbolic-int helpers torch serialises by name.
ATEN_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")
ATEN_FILES = {"save", "from_file"}  # the ATen operators that open files by name
SYM_TARGETS = {
    *(
        f"_operator.{name}"
        for name in (
            "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
            "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "lshift", "rshift",
        )
    ),
    *(f"torch.{name}" for name in ("sym_max", "sym_min", "sym_not", "sym_float", "sym_int",
                                   "sym_ite", "_sym_sqrt")),
    "math.trunc",
}  # fmt: skip

# What the sample inputs' pickle may name: tensors rebuilt from storages, in plain containers.
PICKLE_GLOBALS = {
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_parameter",
    "collections OrderedDict",
    *(
        f"torch {kind}Storage"
        for kind in (
            "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
            "Bool", "Untyped",
        )
    ),
}  # fmt: skip

# Names a symbolic expression may use: sympy constructors as srepr writes them, and the
# functions torch's deserializer itself provides to sympify.
SYMPY_NAMES = {
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan",
    "StrictGreaterThan", "LessThan", "GreaterThan", "And", "Or", "Not", "true", "false",
    "oo", "zoo", "nan", "floor", "ceiling", "sqrt", "Mod", "FloorDiv", "CeilDiv",
    "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
    "IntTrueDiv", "FloatTrueDiv", "TruncToInt", "TruncToFloat", "ToFloat", "RoundToInt",
    "RoundDecimal", "Identity", "IsNonOverlappingAndDenseIndicator", "OpaqueUnaryFn_sqrt",
    "PowByNatural", "FloatPow", "LShift", "RShift", "BitwiseFn_bitwise_and",
    "BitwiseFn_bitwise_or", "Infinity", "NegativeInfinity", "int_oo", "IntInfinity",
    "NegativeIntInfinity",
}  # fmt: skip
SYMBOL_NAME = re.compile(r"[a-z]+[0-9]+")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
ASSUMPTIONS = {
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
    "zero", "nonzero", "even", "odd", "rational", "extended_real", "commutative",
}  # fmt: skip
GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
MAX_EXPRESSION_CHARS = 4096

_ARITHMETIC = (
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
    ast.Not, ast.Invert, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
    ast.BitAnd, ast.BitOr, ast.LShift, ast.RShift,
)  # fmt: skip


class UnsafeArtifact(ServemeshError, ValueError):
    """The archive holds something servemesh will not let torch parse; the message says what."""


_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22


def whole_zip(data: bytes) -> zipfile.ZipFile:
    """`data` opened as a zip archive that spans it exactly; UnsafeArtifact otherwise.

    zipfile finds an archive by the last end-of-directory record it sees, so a truncated
    .pt2 can open as the archive nested inside it (its sample inputs): the record must end
    the data, and the first entry must start it.
    """
    eocd = data.rfind(_EOCD, max(0, len(data) - _EOCD_SIZE - 0xFFFF))
    comment = int.from_bytes(data[eocd + 20 : eocd + 22], "little") if eocd >= 0 else -1
    if eocd < 0 or eocd + _EOCD_SIZE + comment != len(data):
        raise UnsafeArtifact("truncated or damaged archive: it does not end with its directory")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError) as exc:
        raise UnsafeArtifact(f"truncated or damaged archive ({exc})") from None
    entries = archive.infolist()
    if not entries or min(info.header_offset for info in entries) != 0:
        archive.close()
        raise UnsafeArtifact("truncated or damaged archive: its entries do not start it")
    return archive


def check_export_archive(data: bytes) -> None:
    """Raise UnsafeArtifact unless `data` is a torch.export archive within the allowlist."""
    with whole_zip(data) as archive:
        members = archive_members(archive)
        for path, expected in (ARCHIVE_FORMAT, ARCHIVE_VERSION):
            got = members.get(path)
            if got is None or archive.read(got).strip() != expected:
                raise UnsafeArtifact(
                    f"{path}: expected {expected.decode()!r} (an archive from torch.export.save "
                    "in torch 2.6 or newer)"
                )
        for required in (MODEL_JSON, WEIGHTS_CONFIG, CONSTANTS_CONFIG, SAMPLE_INPUTS):
            if required not in members:
                raise UnsafeArtifact(f"{required}: missing")
        allowed = {
            ARCHIVE_FORMAT[0], ARCHIVE_VERSION[0], MODEL_JSON, WEIGHTS_CONFIG, CONSTANTS_CONFIG,
            SAMPLE_INPUTS, *BOOKKEEPING,
        }  # fmt: skip
        allowed |= _payloads(archive, members, WEIGHTS_CONFIG, "data/weights/", "weight_")
        allowed |= _payloads(archive, members, CONSTANTS_CONFIG, "data/constants/", "tensor_")
        unexpected = sorted(set(members) - allowed)
        if unexpected:
            shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
            raise UnsafeArtifact(
                f"unexpected parts {shown}: only a single exported program with raw tensor "
                "weights is accepted (no AOTInductor, pickled objects, extra files or "
                "legacy layouts)"
            )
        _check_sample_inputs(archive.read(members[SAMPLE_INPUTS]))
        try:
            program = json.loads(archive.read(members[MODEL_JSON]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnsafeArtifact(f"{MODEL_JSON}: not JSON ({exc})") from None
    _check_program_json(program)


def archive_members(
    archive: zipfile.ZipFile,
    saver: str = "torch.export.save",
    deflated: re.Pattern[str] | None = None,
    max_inflated: int = 0,
) -> dict[str, zipfile.ZipInfo]:
    """Entries by their path under the archive's one top folder, each stored and plainly named
    (`saver` writes them so: a compressed entry could inflate without end). Paths matching
    `deflated` may be deflated, to at most `max_inflated` bytes all together (zipfile and
    torch's reader both stop at the size the directory records)."""
    inflated = 0
    members: dict[str, zipfile.ZipInfo] = {}
    tops: set[str] = set()
    for info in archive.infolist():
        name = info.filename
        top, _, path = name.partition("/")
        if (
            not path
            or name.endswith("/")
            or "\\" in name
            or any(part in ("", ".", "..") for part in name.split("/"))
            or not TOP_FOLDER.fullmatch(top)
        ):
            raise UnsafeArtifact(f"entry {name[:80]!r}: not a plain file path under one folder")
        if info.flag_bits & 0x1:
            raise UnsafeArtifact(f"entry {name[:80]!r}: encrypted")
        if (
            info.compress_type == zipfile.ZIP_DEFLATED
            and deflated is not None
            and deflated.fullmatch(path)
        ):
            inflated += info.file_size
            if inflated > max_inflated:
                raise UnsafeArtifact(
                    f"entry {name[:80]!r}: the compressed entries inflate to more than "
                    f"{max_inflated} bytes"
                )
        elif info.compress_type != zipfile.ZIP_STORED:
            raise UnsafeArtifact(f"entry {name[:80]!r}: compressed ({saver} stores)")
        if path in members:
            raise UnsafeArtifact(f"entry {name[:80]!r}: appears twice")
        tops.add(top)
        members[path] = info
    if len(tops) != 1:
        raise UnsafeArtifact(f"entries under {len(tops)} top folders; an archive has one")
    return members


def _payloads(
    archive: zipfile.ZipFile,
    members: dict[str, zipfile.ZipInfo],
    config_path: str,
    folder: str,
    prefix: str,
) -> set[str]:
    """The payload files a weights/constants config names, once each is known raw tensor data."""
    try:
        config = json.loads(archive.read(members[config_path]))
        entries = config["config"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UnsafeArtifact(f"{config_path}: not a payload config ({exc})") from None
    if not isinstance(entries, dict):
        raise UnsafeArtifact(f"{config_path}: not a payload config")
    files: set[str] = set()
    for fqn, entry in entries.items():
        where = f"{config_path}: {str(fqn)[:80]!r}"
        if not isinstance(entry, dict):
            raise UnsafeArtifact(f"{where}: not an entry")
        if entry.get("use_pickle") is not False:
            raise UnsafeArtifact(f"{where}: stored as a pickle (only raw tensor bytes load)")
        name = entry.get("path_name")
        if not isinstance(name, str) or not PAYLOAD_NAME.fullmatch(name):
            raise UnsafeArtifact(f"{where}: path_name is not a plain file name")
        if not name.startswith(prefix):
            raise UnsafeArtifact(f"{where}: {name!r} is not a tensor (a pickled Python object)")
        if not isinstance(entry.get("tensor_meta"), dict):
            raise UnsafeArtifact(f"{where}: no tensor_meta")
        if folder + name not in members:
            raise UnsafeArtifact(f"{where}: {folder + name} is missing")
        files.add(folder + name)
    return files


def _check_sample_inputs(data: bytes) -> None:
    """The example inputs: a torch.save archive whose pickle builds tensors and nothing else."""
    try:
        inner = zipfile.ZipFile(io.BytesIO(data))
        pickles = [name for name in inner.namelist() if name.endswith(".pkl")]
        if len(pickles) != 1 or not pickles[0].endswith("/data.pkl"):
            raise UnsafeArtifact(f"{SAMPLE_INPUTS}: expected one data.pkl, found {pickles}")
        opcodes = list(pickletools.genops(inner.read(pickles[0])))
    except (zipfile.BadZipFile, ValueError) as exc:
        if isinstance(exc, UnsafeArtifact):
            raise
        raise UnsafeArtifact(f"{SAMPLE_INPUTS}: not a tensor archive ({exc})") from None
    for opcode, arg, _ in opcodes:
        if opcode.name in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"):
            raise UnsafeArtifact(f"{SAMPLE_INPUTS}: the pickle uses {opcode.name}")
        if opcode.name == "GLOBAL" and arg not in PICKLE_GLOBALS:
            raise UnsafeArtifact(f"{SAMPLE_INPUTS}: the pickle references {str(arg)[:80]!r}")
    # What torch tries first: loading with weights_only=True must succeed, or it would
    # retry without it.
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise UnsafeArtifact(
            f"{SAMPLE_INPUTS}: does not load with weights_only=True ({type(exc).__name__})"
        ) from None


def _check_program_json(program: Any) -> None:
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise UnsafeArtifact(f"{MODEL_JSON}: not an exported program")
    ranges = program.get("range_constraints") or {}
    if not isinstance(ranges, dict):
        raise UnsafeArtifact(f"{MODEL_JSON}: range_constraints is not a mapping")
    for symbol in ranges:
        if not IDENTIFIER.fullmatch(str(symbol)):
            raise UnsafeArtifact(f"{MODEL_JSON}: range_constraints: {str(symbol)[:80]!r}")
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise UnsafeArtifact(f"{MODEL_JSON}: guards_code is not a list")
    for guard in guards:
        _check_expression(guard, "guards_code", guard=True)
    module = program["graph_module"]
    graph = module.get("graph")
    if not isinstance(graph, dict) or graph.get("custom_obj_values"):
        raise UnsafeArtifact(f"{MODEL_JSON}: the graph holds custom objects (not served)")
    if module.get("treespec_namedtuple_fields"):
        raise UnsafeArtifact(f"{MODEL_JSON}: named tuples in inputs or outputs are not served")
    for entry in module.get("module_call_graph") or []:
        signature = entry.get("signature") if isinstance(entry, dict) else None
        for name in (signature or {}).get("forward_arg_names") or []:
            if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
                raise UnsafeArtifact(f"{MODEL_JSON}: forward argument {str(name)[:80]!r}")
    for key, value in _walk(program):
        if key == "expr_str":
            _check_expression(value, "expr_str", guard=False)
        elif key == "target":
            _check_target(value)


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a JSON document, depth first."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                yield key, value
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _check_target(target: Any) -> None:
    if not isinstance(target, str):
        raise UnsafeArtifact(f"{MODEL_JSON}: a node target is not a name")
    if target in SYM_TARGETS:
        return
    match = ATEN_TARGET.fullmatch(target)
    if match is None:
        raise UnsafeArtifact(
            f"{MODEL_JSON}: node target {target[:80]!r} is not an ATen operator (custom "
            "operators, higher-order operators and Python callables are not served)"
        )
    if match.group(1) in ATEN_FILES:
        raise UnsafeArtifact(f"{MODEL_JSON}: node target {target!r} opens files")
    if not allowed_operator(f"aten::{match.group(1)}"):
        raise UnsafeArtifact(
            f"{MODEL_JSON}: node target {target!r}: operator aten::{match.group(1)} is not "
            "allowed (services/model/op_allowlist.py)"
        )


def _check_expression(text: Any, where: str, *, guard: bool) -> None:
    """An expression made of literals, known names, arithmetic and comparisons only."""
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION_CHARS:
        raise UnsafeArtifact(f"{MODEL_JSON}: {where}: not a short expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError):
        raise UnsafeArtifact(f"{MODEL_JSON}: {where}: {text[:80]!r} does not parse") from None
    for node in ast.walk(tree):
        if not _allowed(node, guard):
            raise UnsafeArtifact(
                f"{MODEL_JSON}: {where}: {text[:80]!r} is not a plain shape expression "
                f"({type(node).__name__})"
            )


def _allowed(node: ast.AST, guard: bool) -> bool:
    if isinstance(
        node,
        (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Load, *_ARITHMETIC),
    ):
        return True
    if isinstance(node, ast.Constant):
        # Strings only as a symbol's name or a guard's argument key; both are identifiers.
        value = node.value
        if isinstance(value, str):
            return bool(IDENTIFIER.fullmatch(value))
        return value is None or isinstance(value, (bool, int, float))
    if isinstance(node, ast.Name):
        return (
            node.id in SYMPY_NAMES
            or bool(SYMBOL_NAME.fullmatch(node.id))
            or (guard and node.id == "L")
        )
    if isinstance(node, ast.keyword):
        return node.arg in ASSUMPTIONS and isinstance(node.value, ast.Constant)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id in SYMPY_NAMES
        # Guards only: `L['x'].size()` and the like, with no arguments.
        return (
            guard
            and isinstance(func, ast.Attribute)
            and func.attr in GUARD_METHODS
            and not node.args
            and not node.keywords
        )
    if isinstance(node, ast.Attribute):
        return guard and node.attr in GUARD_METHODS  # only as checked in Call above
    if isinstance(node, ast.Subscript):
        # Guards only: L['x'] and size()[0]; the index a constant.
        return guard and isinstance(node.slice, ast.Constant)
    return False


def check_loaded_program(program: torch.export.ExportedProgram) -> None:
    """After torch loaded it: every node of every graph calls an ATen operator or getitem."""
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            target = node.target
            if node.op != "call_function":
                raise UnsafeArtifact(f"graph node {node.name}: {node.op} is not served")
            if isinstance(target, torch._ops.OpOverload):
                if target.namespace == "aten" and allowed_operator(f"aten::{target._opname}"):
                    continue
            elif f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', '')}" in (
                SYM_TARGETS
            ):
                continue
            raise UnsafeArtifact(f"graph node {node.name}: target {target!r} is not served")
