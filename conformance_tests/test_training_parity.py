"""Identical updates: the same MLP, data and rule give the same parameters on every backend,
in explicit and implicit mode, and on GPU as on CPU (abstractdiff.parity)."""

from __future__ import annotations

import pytest

from abstractdiff.parity import RTOL, default_rule, max_relative_difference, run_one, skip_reason, training_parity
from abstractdiff.testing._grid import Case, backend_names, load


def _load(request, name: str, device: str, dtype: str):
    b = load(Case(name, device, dtype, required=backend_names(request.config)[1]))  # fails/skips if missing
    why = skip_reason(name)
    if why is not None:
        pytest.skip(f"{name}: {why}")
    return b


def _usable(name: str) -> bool:
    try:
        return skip_reason(name) is None
    except Exception:  # noqa: BLE001  not installed here
        return False


def test_training_parity_cpu(request, ad_backend_name, ad_dtype):
    _load(request, ad_backend_name, "cpu", ad_dtype)
    summary = training_parity([ad_backend_name], dtypes=(ad_dtype,), devices=False)
    runs = [r for r in summary.results if r.status != "skip"]
    assert {r.mode for r in runs} == {"explicit", "implicit"}, summary.format()
    assert summary.ok, summary.format()
    assert all(r.max_rel_diff <= RTOL[ad_dtype] for r in runs)


@pytest.mark.gpu
def test_training_parity_gpu_matches_cpu(request, ad_backend_name, ad_dtype):
    b = _load(request, ad_backend_name, "gpu", ad_dtype)  # skips with the reason where there is no GPU
    rule = default_rule()
    for mode in ("explicit", "implicit"):
        cpu = run_one(ad_backend_name, mode, "cpu", ad_dtype, rule, epochs=10)
        gpu = run_one(ad_backend_name, mode, b.device, ad_dtype, rule, epochs=10)
        diff = max_relative_difference(gpu, cpu)
        assert diff <= RTOL[ad_dtype], f"{ad_backend_name} {mode} {ad_dtype}: {b.device} vs cpu differ by {diff:.2e}"


def test_summary_reports_every_run_and_formats(request):
    names = [n for n in backend_names(request.config)[0] if _usable(n)][:1]
    if not names:
        pytest.skip("no AD backend available")
    summary = training_parity(names + ["finite_differences"], steps=5, dtypes=("float64",))
    text = summary.format()
    assert "finite_differences" in text and "skip" in text
    assert f"{names[0]:<18} explicit" in text and f"{names[0]:<18} implicit" in text
    assert summary.steps == 5 and summary.ok
