"""Load a TorchScript archive (`.pt`) only once every operator it can run is on the allowlist.

TorchScript's code is TorchScript, compiled by torch, not Python; but it may call any
operator torch has registered, and some of them reach outside the tensors:
`torch.from_file(path, ...)` reads any file the process can read and `torch.save(t, path)`
writes any path it can write, so a scripted `forward` could copy the mesh's control token
to wherever its author reads it back. Nothing in `torch.jit.load` objects. So servemesh
loads a TorchScript archive in three steps (`load_checked`):

1. Before torch parses anything (`check_archive`): the bytes must be one plain zip archive
   in the layout `torch.jit.save` writes: entries plainly named, once each, under one
   folder (`data.pkl`, `constants.pkl`, `code/**.py` and their `.debug_pkl`, tensor data,
   version and bookkeeping, `extra/` files), stored but for the code, which may inflate
   to `MAX_CODE_BYTES` in all; not a flatbuffer (`PTMF` at byte 4, which torch would read
   as a mobile module whatever the zip says); its pickles may name only tensor-rebuilding
   helpers and the archive's own `__torch__` classes (no custom C++ classes,
   `torch.classes.*`, but one: torch's packed weights of a dynamically quantized linear
   layer, `LinearPackedParamsBase`, with the quantized tensors it is rebuilt from); and
   its code must not define `__setstate__`.

   That one class's `__setstate__` is torch's own C++ (it packs a quantized weight
   tensor and an optional bias for the CPU's kernel), not code the archive brings; its
   state reaches it through TorchScript's typed unpickler, which refuses a state of
   another type.

   What runs at load: `torch.jit.load` compiles the code (compiling runs nothing; constant
   folding at compile time folds only operators on immutable values such as ints and
   strings, never a tensor-returning `from_file`), unpickles `data.pkl` and
   `constants.pkl` with TorchScript's own restricted unpickler, and for every object whose
   class defines `__getstate__` and `__setstate__`, calls that `__setstate__`: compiled
   code of the author's choosing, run inside `torch.jit.load`, before any graph could be
   checked. A hostile `__setstate__` copied a file during the load itself
   (tests/model/test_torchscript_guard.py). So an archive whose code defines
   `__setstate__` is refused before torch sees it (a method's name can only appear in the
   code as written: TorchScript source has no other way to define one).

2. torch compiles the archive into a compilation unit of servemesh's own (as
   `torch.jit.load` does, without its Python wrapper yet): every function and method the
   archive defines, reachable or not: `forward`, exported methods, hooks,
   `__getstate__`, helper functions, TorchScript classes' methods (`__enter__` of a
   `with` block), `torch.nn.functional` code compiled into the archive.

3. `check_compilation_unit`: every node of every one of those graphs, nested `if` and
   loop blocks included, must be an operator on the allowlist (`op_allowlist`);
   `prim::CallFunction` and `prim::CallMethod` must call a function of this same unit
   (checked in its own right); no value may be a storage, a capsule, a Python object or a
   custom C++ class. Only then is the module wrapped and returned, so nothing of the
   archive runs before the check but torch's compiler and unpickler.

A refusal names the operator, the function and the line of the archive's code:
`operator aten::from_file in __torch__.Reader.forward (code/__torch__.py, line 12) is not
allowed`; `torch.jit.load(path).code` (or `.graph`) prints a model's code to compare.
"""

from __future__ import annotations

import pickletools
import re
from collections.abc import Iterator
from typing import Any

import torch

from servemesh.services.model.op_allowlist import allowed_operator
from servemesh.services.model.pt2_guard import UnsafeArtifact, archive_members, whole_zip

__all__ = ["check_archive", "check_compilation_unit", "load_checked"]

# torch.jit.save deflates the code and its debug tables; all of it inflated, at most:
MAX_CODE_BYTES = 256 * 1024 * 1024
_FLATBUFFER_MAGIC = b"PTMF"  # bytes 4..8 of a mobile flatbuffer module
_FIXED_PARTS = {
    "data.pkl",
    "constants.pkl",
    "version",
    ".data/version",
    "byteorder",
    ".data/serialization_id",
}
_CODE = re.compile(r"code/(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+\.py(?:\.debug_pkl)?")
_TENSOR_DATA = re.compile(r"(?:data|constants)/[0-9]{1,9}")
_EXTRA = re.compile(r"extra/[^/]+")
# What the pickles may name besides the archive's own classes: the helpers TorchScript's
# unpickler rebuilds tensors, typed lists and ordered dicts with.
_PICKLE_GLOBALS = {
    "collections OrderedDict",
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_tensor",
    *(
        f"torch.jit._pickle {name}"
        for name in (
            "build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
            "build_complexlist", "build_tensor_from_id", "restore_type_tag",
        )
    ),
    *(
        f"torch {kind}Storage"
        for kind in (
            "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
            "Bool", "ComplexFloat", "ComplexDouble",
        )
    ),
}  # fmt: skip
# A dynamically quantized linear layer's weights (`models quantize --to int8`): torch's
# packed-params class and how its quantized tensors are pickled.
_QUANTIZED_GLOBALS = {
    "__torch__.torch.classes.quantized LinearPackedParamsBase",
    "torch._utils _rebuild_qtensor",
    "torch QInt8Storage",
    "torch per_tensor_affine",
    "torch per_channel_affine",
}
_OWN_CLASS = re.compile(r"__torch__(?:\.[A-Za-z0-9_]+)* [A-Za-z0-9_]+")
_CUSTOM_CLASSES = "__torch__.torch.classes"
_PACKED_LINEAR = "__torch__.torch.classes.quantized.LinearPackedParamsBase"
_REFUSED_TYPES = {"StorageType", "CapsuleType", "PyObjectType"}
_C: Any = torch._C
_SOURCE_LINE = re.compile(r'Serialized\s+File "(code/[^"]{1,200})", line ([0-9]+)')


def load_checked(data: bytes, device: torch.device) -> Any:
    """The archive's module, once `check_archive` and `check_compilation_unit` passed;
    UnsafeArtifact says what was refused. Errors from torch itself propagate."""
    check_archive(data)
    unit = _C.CompilationUnit()
    # What torch.jit.load does, into a unit of our own (torch's stubs lag the binding).
    cpp_module = _C.import_ir_module_from_buffer(unit, data, device, {}, False)
    check_compilation_unit(unit)
    from torch.jit._recursive import wrap_cpp_module

    return wrap_cpp_module(cpp_module)


def check_archive(data: bytes) -> None:
    """Raise UnsafeArtifact unless `data` is a plain `torch.jit.save` archive whose loading
    runs none of its own code (see the module docstring, step 1)."""
    if data[4:8] == _FLATBUFFER_MAGIC:
        raise UnsafeArtifact("a flatbuffer (mobile) module in disguise, not a zip archive")
    with whole_zip(data) as archive:
        members = archive_members(
            archive, saver="torch.jit.save", deflated=_CODE, max_inflated=MAX_CODE_BYTES
        )
        unexpected = sorted(
            path
            for path in members
            if path not in _FIXED_PARTS
            and not _CODE.fullmatch(path)
            and not _TENSOR_DATA.fullmatch(path)
            and not _EXTRA.fullmatch(path)
        )
        if unexpected:
            shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
            raise UnsafeArtifact(
                f"unexpected parts {shown}: only what torch.jit.save writes is accepted "
                "(no mobile bytecode or legacy layouts)"
            )
        if "data.pkl" not in members:
            raise UnsafeArtifact("data.pkl: missing")
        for path, info in members.items():
            if path.endswith(".pkl") or path.endswith(".debug_pkl"):
                _check_pickle(path, archive.read(info))
            elif path.endswith(".py") and b"__setstate__" in archive.read(info):
                raise UnsafeArtifact(
                    f"{path} defines __setstate__, which torch.jit.load would run while "
                    "loading, before any check (drop __getstate__/__setstate__ from the model)"
                )


def _check_pickle(path: str, data: bytes) -> None:
    try:
        opcodes = list(pickletools.genops(data))
    except ValueError as exc:
        raise UnsafeArtifact(f"{path}: not a pickle ({exc})") from None
    for opcode, arg, _ in opcodes:
        if opcode.name in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"):
            raise UnsafeArtifact(f"{path}: the pickle uses {opcode.name}")
        if opcode.name != "GLOBAL":
            continue
        name = str(arg)
        if name in _PICKLE_GLOBALS or name in _QUANTIZED_GLOBALS:
            continue
        if _OWN_CLASS.fullmatch(name) and not name.startswith(_CUSTOM_CLASSES):
            continue
        raise UnsafeArtifact(
            f"{path}: the pickle references {name[:80]!r} (custom C++ classes and Python "
            "objects are not served)"
        )


def check_compilation_unit(unit: Any) -> None:
    """Raise UnsafeArtifact unless every node of every function in `unit` is allowed."""
    functions = list(unit.get_functions())
    names = {function.qualified_name for function in functions}
    for function in functions:
        where = function.qualified_name
        if function.name == "__setstate__":
            raise UnsafeArtifact(f"{where}: __setstate__ runs at load and is not served")
        for node in _nodes(function.graph.nodes()):
            _check_node(node, where, names)


def _nodes(nodes: Any) -> Iterator[torch._C.Node]:
    """Every node, and every node of its blocks (prim::If, prim::Loop), depth first."""
    for node in nodes:
        yield node
        for block in node.blocks():
            yield from _nodes(block.nodes())


def _check_node(node: torch._C.Node, where: str, functions: set[str]) -> None:
    kind = node.kind()
    if not allowed_operator(kind):
        _refuse(node, f"operator {kind}", where)
    if kind == "prim::CallFunction":
        callee = str(node.inputsAt(0).type())
        if callee not in functions:
            _refuse(node, f"prim::CallFunction of {callee[:80]} (not this archive's code)", where)
    elif kind == "prim::CallMethod":
        receiver = node.inputsAt(0).type()
        method = f"{receiver}.{node.s('name')}"
        if receiver.kind() == "InterfaceType":
            # Dispatched at run time to a class of this unit; each of those is checked.
            if str(receiver).startswith(_CUSTOM_CLASSES):
                _refuse(node, f"prim::CallMethod of {method[:80]}", where)
        elif method not in functions:
            _refuse(node, f"prim::CallMethod of {method[:80]} (not this archive's code)", where)
    for value in (*node.inputs(), *node.outputs()):
        kind_of = value.type().kind()
        type_name = str(value.type())
        if kind_of in _REFUSED_TYPES or (
            type_name.startswith(_CUSTOM_CLASSES) and type_name != _PACKED_LINEAR
        ):
            _refuse(node, f"a value of type {type_name[:80]} in {kind}", where)


def _refuse(node: torch._C.Node, what: str, where: str) -> None:
    match = _SOURCE_LINE.search(str(node.sourceRange()))
    line = f" ({match.group(1)}, line {match.group(2)})" if match else ""
    raise UnsafeArtifact(f"{what} in {where}{line} is not allowed")
