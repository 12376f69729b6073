"""examples/compose_jax_in_torch.py: a jax-written physics term in a torch model trained with ad.train."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the example's model is a torch nn.Module (pip install torch)")
pytest.importorskip("jax", reason="the example's physics term is written in jax (pip install jax)")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "compose_jax_in_torch.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("compose_jax_in_torch_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["explicit", "implicit"])
def test_main_checks_trains_and_times(example, mode, capsys) -> None:
    assert example.main(["--mode", mode, "--steps", "40", "--rounds", "2", "--steps-per-round", "2"]) == 0
    out = capsys.readouterr().out
    assert "tolerance 1e-12): passed" in out
    assert "trained 40 steps" in out
    assert "ms, ratio" in out


@pytest.mark.parametrize("mode", ["explicit", "implicit"])
def test_composed_gradient_equals_the_torch_only_gradient(example, mode) -> None:
    assert example.check_gradients(mode, seed=3) <= 1e-12


def test_loss_decreases_the_same_way_in_both_modes(example) -> None:
    explicit, _ = example.train("explicit", seed=0, steps=60)
    implicit, _ = example.train("implicit", seed=0, steps=60)
    assert len(explicit) == 60
    assert explicit[-1] < 0.5 * explicit[0]
    assert implicit == pytest.approx(explicit, rel=1e-10)


def test_overhead_is_measured_for_both_terms(example) -> None:
    ms = example.measure_overhead("explicit", seed=0, rounds=2, steps_per_round=1)
    assert set(ms) == {"jax", "torch"} and all(v > 0 for v in ms.values())


def test_main_fails_when_the_gradients_disagree(example, monkeypatch, capsys) -> None:
    """A reference that is not the same function: the check fails and main returns 1 before training."""
    torch_term = example.TERMS["torch"]
    monkeypatch.setitem(example.TERMS, "torch", lambda u: 1.001 * torch_term(u))
    assert example.main(["--steps", "5"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "trained" not in out


def test_docstring_usage_lines_parse(example) -> None:
    lines = [ln.split("#")[0].strip() for ln in example.__doc__.splitlines() if "python examples/" in ln]
    assert lines
    for line in lines:
        example.build_parser().parse_args(shlex.split(line)[2:])
