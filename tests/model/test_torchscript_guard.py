"""TorchScript archives run only allowlisted operators (services/model/torchscript_guard.py).

Every hostile archive is built here: a small module scripted and saved to bytes. Each
refusal must name the operator, and whatever the module would have done to the file system
must not have happened.
"""

from __future__ import annotations

import io
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from servemesh.cli.models import ModelsError, PushRequest, check_push
from servemesh.contract.demo import build_fraud_model, demo_artifact
from servemesh.services.model.artifacts import ArtifactError, load_module, open_artifact
from servemesh.services.model.op_allowlist import ALLOWED_ATEN, allowed_operator
from tests.model import crafted_pt2
from tests.model.torch_models import Churn, churn_example, exported, scripted

pytestmark = pytest.mark.timeout(300)

SECRET = b"control-token-0123456789"


def saved(module: torch.nn.Module) -> bytes:
    """`module` scripted and saved as torch.jit.save writes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        return scripted(module)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "control.token"
    path.write_bytes(SECRET)
    return path


def refused(data: bytes, operator: str) -> str:
    """The refusal's message, once checked that it names `operator`."""
    with pytest.raises(ArtifactError) as caught:
        open_artifact(data)
    message = str(caught.value)
    assert message.startswith("TorchScript archive refused: "), message
    assert operator in message, message
    return message


# --- the original hole, end to end ------------------------------------------------------


class Copier(torch.nn.Module):
    """Copies a file it can read to a path it can write, on its first forward."""

    def __init__(self, source: str, target: str) -> None:
        super().__init__()
        self.source = source
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stolen = torch.from_file(self.source, shared=False, size=24, dtype=torch.uint8)
        torch.save(stolen, self.target)
        return x


def test_quantized_operators_other_than_dynamic_linear_are_not_allowed() -> None:
    assert allowed_operator("quantized::linear_dynamic")
    for kind in ("quantized::linear", "quantized::conv2d", "quantized::add", "quantized::cat"):
        assert not allowed_operator(kind), kind


def test_a_module_copying_the_control_token_is_refused_before_it_runs(
    secret: Path, tmp_path: Path
) -> None:
    target = tmp_path / "stolen.pt"
    data = saved(Copier(str(secret), str(target)))
    message = refused(data, "operator aten::from_file in __torch__.")
    assert ".Copier.forward (code/" in message
    with pytest.raises(ArtifactError, match="operator aten::from_file"):
        load_module(data, "torchscript")
    assert not target.exists()
    # What the model would have done: torch itself runs it without complaint.
    torch.jit.load(io.BytesIO(data))(torch.ones(1))
    assert target.exists()


def test_push_refuses_it_before_the_probe_batch(secret: Path, tmp_path: Path) -> None:
    # The probe batch `servemesh models push` runs was the first forward that copied it.
    target = tmp_path / "stolen.pt"
    model = tmp_path / "copier.pt"
    model.write_bytes(saved(Copier(str(secret), str(target))))
    signature = tmp_path / "sig.yaml"
    signature.write_text(
        "inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]\n"
        "outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n"
    )
    request = PushRequest(file=model, model="churn", version="v9", signature=signature)
    with pytest.raises(ModelsError, match=r"copier.pt: TorchScript archive refused: operator"):
        check_push(request, limit_bytes=1 << 30)
    assert not target.exists()


# --- one hostile archive per refused family -----------------------------------------------


class Reader(torch.nn.Module):
    """Reads a file into its answer (the caller sees the secret)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_file(self.source, shared=False, size=24, dtype=torch.uint8)


class Writer(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.save(x, self.target)
        return x


class Loader(torch.nn.Module):
    """torch.load is not TorchScript; this debug operator loads a tensor from a file."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.debugprims.load_tensor("t", [1], [1], dtype=torch.float32, device=x.device)


class Strided(torch.nn.Module):
    """A raw view of memory by offsets: storage entry point."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_strided([4], [1], 0)


class Uninitialised(torch.nn.Module):
    """Memory the allocator hands out unwritten: it can hold what the process freed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty([1024], dtype=torch.uint8)


class SameStorage(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> bool:
        return torch.ops.aten._has_same_storage_numel(x, x)


class Printer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forged log line")
        return x


def test_file_reads_are_refused(secret: Path) -> None:
    refused(saved(Reader(str(secret))), "operator aten::from_file in __torch__.")


def test_file_writes_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "written.pt"
    refused(saved(Writer(str(target))), "operator aten::save in __torch__.")
    assert not target.exists()


def test_file_loads_are_refused() -> None:
    refused(saved(Loader()), "operator debugprims::load_tensor in __torch__.")


@pytest.mark.parametrize(
    ("module", "operator"),
    [
        (Strided(), "aten::as_strided"),
        (Uninitialised(), "aten::empty"),
        (SameStorage(), "aten::_has_same_storage_numel"),
        (Printer(), "prim::Print"),
    ],
    ids=["as_strided", "empty", "private-storage", "print"],
)
def test_storage_memory_and_print_operators_are_refused(
    module: torch.nn.Module, operator: str
) -> None:
    refused(saved(module), f"operator {operator} in __torch__.")


# --- raw kernels that trust their caller (memory outside the tensors) ------------------------
# Each of these passed the allowlist before it was narrowed, behaved on the push probe's rows,
# and read or wrote the server's memory on a request's values: the model takes its offset,
# batch size or index from the request. Scripting is enough to show the guard refuses them;
# none of them runs here.


class ReshapeAlias(torch.nn.Module):
    """Strides from the request: reads (and writes) anywhere in the process."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = int(x[0, 0].item())
        return torch.ops.aten._reshape_alias(self.w, [2, 4], [offset, 1]) + 0


class PadPacked(torch.nn.Module):
    """A negative batch size from the request: a heap write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = torch.tensor([int(x[0, 0].item())])
        out, _ = torch.ops.aten._pad_packed_sequence(x, sizes, False, 0.0, 1)
        return out


class EmbeddingBagPastTheTable(torch.nn.Module):
    """`padding_idx` past the table: the private kernel indexes past it."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = x.long().flatten()
        offsets = torch.zeros(1, dtype=torch.long)
        out = torch.ops.aten._embedding_bag(
            self.table, index, offsets, False, 0, False, None, False, 1 << 20
        )
        return out[0]


class BatchNormShortStats(torch.nn.Module):
    """Training mode with one-element running stats for four channels: writes past them."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.var = torch.nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten.native_batch_norm(x, None, None, self.mean, self.var, True, 0.1, 1e-5)
        return out[0]


class BatchNormLegitShortStats(BatchNormShortStats):
    """The same through the private kernel torch.export writes for batch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._native_batch_norm_legit(
            x, None, None, self.mean, self.var, True, 0.1, 1e-5
        )
        return out[0]


class RawLstm(torch.nn.Module):
    """A wider layer given 1x1 weight views: the raw kernels read past them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(1, x.size(0), 64)
        weights = [self.w, self.w]
        return torch.ops.aten.lstm(x, [h, h], weights, False, 1, 0.0, False, False, True)[0]


class RawGru(RawLstm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(1, x.size(0), 64)
        return torch.ops.aten.gru(x, h, [self.w, self.w], False, 1, 0.0, False, False, True)[0]


class RawRnnTanh(RawLstm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(1, x.size(0), 64)
        return torch.ops.aten.rnn_tanh(x, h, [self.w, self.w], False, 1, 0.0, False, False, True)[0]


class Warner(torch.nn.Module):
    """`warnings.warn` writes a line of the model's choosing into the server's log."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn('{"level": "ERROR", "service": "gateway", "msg": "forged"}', stacklevel=1)
        return x


@pytest.mark.parametrize(
    ("module", "operator"),
    [
        (ReshapeAlias(), "aten::_reshape_alias"),
        (PadPacked(), "aten::_pad_packed_sequence"),
        (EmbeddingBagPastTheTable(), "aten::_embedding_bag"),
        (BatchNormShortStats(), "aten::native_batch_norm"),
        (BatchNormLegitShortStats(), "aten::_native_batch_norm_legit"),
        (RawLstm(), "aten::lstm"),
        (RawGru(), "aten::gru"),
        (RawRnnTanh(), "aten::rnn_tanh"),
        (Warner(), "aten::warn"),
    ],
    ids=[
        "reshape_alias", "pad_packed_sequence", "embedding_bag", "native_batch_norm",
        "native_batch_norm_legit", "lstm", "gru", "rnn_tanh", "warn",
    ],
)  # fmt: skip
def test_raw_kernels_that_trust_their_caller_are_refused(
    module: torch.nn.Module, operator: str
) -> None:
    refused(saved(module), f"operator {operator} in __torch__.")


def test_push_refuses_a_raw_kernel_before_the_probe_batch(tmp_path: Path) -> None:
    model = tmp_path / "alias.pt"
    model.write_bytes(saved(ReshapeAlias()))
    signature = tmp_path / "sig.yaml"
    signature.write_text(
        "inputs: [{name: x, datatype: FP32, shape: [-1, 8]}]\n"
        "outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n"
    )
    request = PushRequest(file=model, model="alias", version="v1", signature=signature)
    with pytest.raises(ModelsError, match=r"operator aten::_reshape_alias in"):
        check_push(request, limit_bytes=1 << 30)


def test_the_public_forms_of_those_kernels_check_what_they_are_given() -> None:
    # Why the public operators stay allowed: each refuses what its raw kernel would trust.
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="running_mean should contain 4 elements"):
        short = (torch.zeros(1), torch.ones(1))
        torch.ops.aten.batch_norm(x, None, None, *short, True, 0.1, 1e-5, False)
    with pytest.raises(RuntimeError, match="padding_idx must be within"):
        torch.ops.aten.embedding_bag.padding_idx(
            torch.randn(4, 3), torch.tensor([0, 1]), torch.tensor([0]),
            False, 0, False, None, False, 100,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="inconsistent input_size"):
        torch.ops.aten.lstm_cell(
            torch.randn(2, 4), [torch.randn(2, 3), torch.randn(2, 3)],
            torch.randn(1, 1), torch.randn(1, 1),
        )  # fmt: skip


def test_library_layers_built_on_refused_kernels_say_which_and_why() -> None:
    # nn.LSTM calls the raw kernel; the transformer layers' scripted code has a fused fast
    # path (a private kernel) in a branch. Both are refused by name: recurrent models use
    # the cells, transformer models go through torch.export (scaled_dot_product_attention).
    refused(saved(torch.nn.LSTM(4, 4)), "operator aten::lstm in __torch__.")
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    message = refused(saved(layer), "operator aten::_")
    assert re.search(r"aten::_(transformer_encoder_layer_fwd|native_multi_head_attention)", message)


# --- hidden operators ----------------------------------------------------------------------


class Hider(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @torch.jit.export
    def stash(self, x: torch.Tensor) -> torch.Tensor:
        torch.save(x, self.target)
        return x


class Outer(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.inner = Hider(target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.stash(self.inner(x))


@torch.jit.script
def stash_to(x: torch.Tensor, target: str) -> torch.Tensor:
    torch.save(x, target)
    return x


class CallsAFunction(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stash_to(x * 2, self.target)


class InABranch(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 1000):
            torch.save(x, self.target)
        return x


class InALoop(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in range(int(x.size(0))):
            if step == 3:
                torch.save(x, self.target)
        return x


class NeverCalled(torch.nn.Module):
    """An exported method forward never calls: still code of the archive, still refused."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def later(self, x: torch.Tensor) -> None:
        torch.save(x, self.target)


@pytest.mark.parametrize(
    ("build", "where"),
    [
        (Outer, ".Hider.stash"),
        (CallsAFunction, ".stash_to"),
        (InABranch, ".InABranch.forward"),
        (InALoop, ".InALoop.forward"),
        (NeverCalled, ".NeverCalled.later"),
    ],
    ids=["submodule-method", "scripted-function", "if-block", "loop-block", "uncalled-method"],
)
def test_an_operator_hidden_anywhere_in_the_code_is_found(
    build: Callable[[str], torch.nn.Module], where: str, tmp_path: Path
) -> None:
    target = tmp_path / "hidden.pt"
    message = refused(saved(build(str(target))), "operator aten::save in __torch__.")
    assert where in message
    assert not target.exists()


class Hook(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def reading_hook(module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
    return (torch.from_file("/etc/hostname", shared=False, size=1, dtype=torch.uint8),)


def test_a_forward_hook_is_checked() -> None:
    module = Hook()
    module.register_forward_pre_hook(reading_hook)
    refused(saved(module), "operator aten::from_file in __torch__.")


# --- code that would run inside torch.jit.load ----------------------------------------------


class SetsState(torch.nn.Module):
    """torch.jit.load calls __setstate__ while it unpickles the module."""

    def __init__(self, source: str, target: str) -> None:
        super().__init__()
        self.source = source
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, str, bool]:
        return (self.source, self.target, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, str, bool]) -> None:
        stolen = torch.from_file(state[0], shared=False, size=24, dtype=torch.uint8)
        torch.save(stolen, state[1])
        self.source = state[0]
        self.target = state[1]
        self.training = state[2]


def test_code_torch_would_run_while_loading_is_refused_before_torch_sees_it(
    secret: Path, tmp_path: Path
) -> None:
    target = tmp_path / "stolen-at-load.pt"
    data = saved(SetsState(str(secret), str(target)))
    assert not target.exists()
    message = refused(data, "defines __setstate__, which torch.jit.load would run")
    assert not target.exists(), message
    # The reason: torch.jit.load alone runs it.
    torch.jit.load(io.BytesIO(data))
    assert target.exists()


def test_a_pickled_custom_class_is_refused() -> None:
    # Quantized layers keep their weights in C++ classes (torch.classes.quantized); only the
    # dynamic linear layer's packed weights are let through. The same archive naming the
    # convolution's class instead is refused at its pickle.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = saved(torch.ao.nn.quantized.dynamic.Linear(4, 2))
    renamed = rewritten(
        data,
        lambda name, body: (
            body.replace(b"LinearPackedParamsBase", b"Conv2dPackedParamsBase")
            if name.endswith("/data.pkl")
            else body
        ),
    )
    with pytest.raises(
        ArtifactError, match="references '__torch__.torch.classes.quantized Conv2dPackedParams"
    ):
        open_artifact(renamed)


def test_a_dynamically_quantized_linear_layer_loads_and_a_static_one_is_refused() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = saved(torch.ao.nn.quantized.dynamic.Linear(4, 2))
        static = saved(torch.ao.nn.quantized.Linear(4, 2))
    opened = open_artifact(dynamic)
    assert opened.module(torch.ones(3, 4)).shape == (3, 2)
    # The same packed-weights class, but the static layer's operator is not allowed.
    with pytest.raises(ArtifactError, match="quantized::linear"):
        open_artifact(static)


def rewritten(data: bytes, edit: Callable[[str, bytes], bytes]) -> bytes:
    """The archive with each entry's bytes passed through `edit`, stored."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, edit(info.filename, source.read(info)))
    return out.getvalue()


def test_a_pickle_naming_anything_else_is_refused() -> None:
    data = rewritten(
        saved(Hook()),
        lambda name, body: (
            re.sub(rb"c__torch__[^\n]*\nHook\n", b"cposix\nsystem\n", body)
            if name.endswith("/data.pkl")
            else body
        ),
    )
    with pytest.raises(ArtifactError, match=r"data.pkl: the pickle references 'posix system'"):
        open_artifact(data)


def test_a_flatbuffer_in_zip_clothing_and_strange_parts_are_refused() -> None:
    data = saved(Hook())
    disguised = data[:4] + b"PTMF" + data[8:]
    with pytest.raises(ArtifactError, match="a flatbuffer .mobile. module in disguise"):
        open_artifact(disguised)
    extra = io.BytesIO(data)
    with zipfile.ZipFile(extra, "a") as archive:
        top = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{top}/bytecode.pkl", b"\x80\x02N.")
    with pytest.raises(ArtifactError, match="unexpected parts bytecode.pkl"):
        open_artifact(extra.getvalue())


# --- what must keep working ----------------------------------------------------------------


def test_the_demo_model_passes_and_answers() -> None:
    artifact = demo_artifact(1)
    opened = open_artifact(artifact.data)
    assert opened.format == "torchscript"
    rows = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(opened.module(rows), build_fraud_model(1)(rows))


class Ordinary(torch.nn.Module):
    """Library layers, compiled with their torch.nn.functional code, every branch checked."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Upsample(scale_factor=2),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(4, 16),
            torch.nn.GELU(),
            torch.nn.LayerNorm(16),
        )
        self.query = torch.nn.Linear(16, 16)
        self.cell = torch.nn.LSTMCell(16, 8)
        self.embedding = torch.nn.Embedding(10, 8)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.conv(image).unsqueeze(1)
        q = self.query(features)
        attended = torch.nn.functional.scaled_dot_product_attention(q, features, features)
        hidden = torch.zeros(features.size(0), 8)
        state = torch.zeros(features.size(0), 8)
        for step in range(attended.size(1)):
            hidden, state = self.cell(attended[:, step], (hidden, state))
        mixed = hidden + self.embedding(tokens).mean(1)
        return torch.softmax(mixed, dim=-1).topk(2).indices


def test_ordinary_layers_pass_and_answer() -> None:
    model = Ordinary().eval()
    image, tokens = torch.randn(2, 3, 8, 8), torch.zeros(2, 3, dtype=torch.int64)
    module = load_module(saved(model), "torchscript")
    with torch.no_grad():
        assert torch.equal(module(image, tokens), model(image, tokens))


# --- the allowlist itself -------------------------------------------------------------------


def test_the_allowlist_names_no_operator_that_reaches_outside_the_tensors() -> None:
    for kind in (
        "aten::from_file", "aten::save", "aten::set_", "aten::as_strided", "aten::empty",
        "aten::new_empty", "aten::resize_", "aten::data_ptr", "aten::_print", "aten::seed",
        "aten::manual_seed", "aten::record_stream", "prim::Print", "prim::PythonOp",
        "prim::fork", "aten::wait", "prim::rpc_async", "prim::id",
        "profiler::_record_function_enter_new", "debugprims::load_tensor",
        "quantized::linear", "inductor::resize_storage_bytes_",
    ):  # fmt: skip
        assert not allowed_operator(kind), kind
    assert allowed_operator("aten::linear") and allowed_operator("prim::If")
    assert not any("storage" in name or "file" in name for name in ALLOWED_ATEN)
    # Every name is an operator torch has (no typo lets nothing through; none is dead).
    known = {schema.name for schema in torch._C._jit_get_all_schemas()}
    missing = {name for name in ALLOWED_ATEN if f"aten::{name}" not in known}
    assert len(missing) < len(ALLOWED_ATEN) // 4, sorted(missing)


def test_exported_programs_are_held_to_the_same_allowlist() -> None:
    # torch.export archives (pt2_guard) take their ATen operators from the same list.
    data = exported(Churn(seed=1), churn_example())
    assert open_artifact(data).format == "torch_export"
    hostile = crafted_pt2.with_a_node_calling(data, "torch.ops.aten.empty.memory_format", "x")
    with pytest.raises(ArtifactError, match=r"operator aten::empty is not allowed"):
        open_artifact(hostile)
