"""The benchmarks find the checkout they run from (servemesh/bench/ is two folders deep,
servemesh/bench/model/ three): the wine example `bench batch` scores, the Triton venv
`bench model --against triton` runs."""

from __future__ import annotations

from pathlib import Path

from servemesh.bench.batch import _wine_example
from servemesh.bench.model.run import PYTRITON_PYTHON, REPO

CHECKOUT = Path(__file__).resolve().parents[2]


def test_bench_batch_finds_the_wine_example_of_its_checkout() -> None:
    wine = _wine_example()
    assert Path(str(wine.__file__)).resolve() == CHECKOUT / "examples" / "wine" / "train.py"


def test_bench_model_looks_for_the_triton_venv_at_the_checkouts_root() -> None:
    assert REPO == CHECKOUT
    assert PYTRITON_PYTHON == CHECKOUT / ".venv-pytriton" / "bin" / "python"
