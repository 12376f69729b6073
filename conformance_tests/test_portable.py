"""Portable functions: every entry of the table runs unchanged on every backend.

For each backend (torch, jax, tensorflow, autograd, finite_differences; the implicit
backend is not used) and each entry of ``abstractdiff.testing._portable.PORTABLE``, in
float64 and float32:

* the value equals the numpy/scipy reference (rtol 1e-10 in float64);
* the gradient of ``sum(w * f(x))`` (fixed, distinct weights ``w``; the value comes back as
  aux) equals the one the finite-differences backend computes in float64;
* the value and the gradient keep the inputs' dtype.

Known gaps live in :data:`GAPS` (none today); a gap that starts working fails the run, as
a strict xfail does, so that the docs page never understates what works.  Backends run as
in the rest of the conformance suite: every available one (an unavailable one is skipped
with the reason), or those named by ``--ad-backend`` / ``ABSTRACTDIFF_BACKENDS`` (which must
load).

The same table generates ``docs/guide/portable.md`` (between its ``portable:table``
markers); :func:`test_docs_page_is_current` fails when the committed page differs.
Regenerate it with::

    .venv/bin/python -m conformance_tests.test_portable
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from autoray import do

import abstractdiff as ad
from abstractdiff.testing._grid import ENV, requested_backends
from abstractdiff.testing._portable import CATEGORIES, PORTABLE, Portable

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "portable.md"

#: The backends of the page's columns, and the autoray name of the arrays ``f`` sees on each.
BACKENDS = ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor", "finite_differences")
AUTORAY_NAME = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow", "autograd": "autograd",
                "mlx": "mlx", "paddle": "paddle", "pytensor": "pytensor", "finite_differences": "numpy"}

#: (backend, entry id) -> (status, reason), status "value only" (the gradient is not
#: checked) or "✗" (does not run).
GAPS: dict[tuple[str, str], tuple[str, str]] = {
    ("mlx", "linalg.svd"): ("value only", "MLX has no derivative for its SVD"),
    ("mlx", "linalg.qr"): ("value only", "MLX has no derivative for its QR decomposition"),
}

#: What abstractdiff translates, per backend: autoray name -> why.  Each adapter registers
#: these in its ``_register_portable_functions`` (with ``autoray.register_function``) when
#: the backend is created; every other call is autoray's own translation, or the library's
#: function of that name.  ``test_translations_come_from_the_adapters`` keeps this in step.
_SCALAR = "numpy takes a Python scalar as second argument; torch wants a tensor"
_SCIPY_TORCH = "not in torch's namespace: torch.special"
_SCIPY_TF = "not in tf.experimental.numpy: tf.math"
_SCIPY_AUTOGRAD = "autoray looks in autograd.numpy: autograd.scipy.special"
_SCIPY_PYTENSOR = "autoray looks in pytensor.tensor: found there under its own name"
_EXACT64 = "MLX's CPU kernel is float32-accurate, float64 included (about 1e-7)"
_NO_DERIVATIVE = "MLX has no derivative for it (and runs it on the CPU stream only): JAX's rules"
_GATHER = "MLX refuses to differentiate a gather through indices computed from the traced values"
TRANSLATED: dict[str, dict[str, str]] = {
    "torch": {
        "logsumexp": "torch.logsumexp takes `dim`, not `axis`/`keepdims`",
        "scipy.special.logsumexp": "not found: torch.logsumexp, with `axis`/`keepdims`",
        "std": "torch.std's default is `correction=1` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "var": "torch.var's default is `correction=1` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "roll": "torch.roll takes `shifts`/`dims`, not `axis`",
        "dot": "torch.dot takes vectors only",
        "repeat": "not found: torch.repeat_interleave",
        "maximum": _SCALAR,
        "minimum": _SCALAR,
        "arctan2": _SCALAR,
        "hypot": _SCALAR,
        "logaddexp": _SCALAR,
        "linalg.solve_triangular": "torch.linalg.solve_triangular takes `upper=`, not `lower=`, and a matrix "
                                   "right-hand side",
        "scipy.linalg.solve_triangular": "autoray's translation takes a matrix right-hand side only",
        "scipy.special.erf": _SCIPY_TORCH,
        "scipy.special.erfc": _SCIPY_TORCH,
        "scipy.special.expit": _SCIPY_TORCH,
        "scipy.special.logit": _SCIPY_TORCH,
        "scipy.special.gammaln": _SCIPY_TORCH,
        "scipy.special.digamma": _SCIPY_TORCH,
        "scipy.special.xlogy": _SCIPY_TORCH,
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
    },
    "jax": {
        "logsumexp": "not in jax.numpy: jax.scipy.special.logsumexp",
        "linalg.solve_triangular": "not in jax.numpy: jax.scipy.linalg.solve_triangular",
    },
    "tensorflow": {
        "logsumexp": "not in tf.experimental.numpy: tf.math.reduce_logsumexp",
        "scipy.special.logsumexp": "not found: tf.math.reduce_logsumexp",
        "std": "tf.experimental.numpy.std fails on `ddof=`",
        "var": "tf.experimental.numpy.var fails on `ddof=`",
        "linalg.solve_triangular": "not found: tf.linalg.triangular_solve, with a vector right-hand side",
        "scipy.linalg.solve_triangular": "autoray's translation takes a matrix right-hand side only",
        "scipy.special.erf": _SCIPY_TF,
        "scipy.special.erfc": _SCIPY_TF,
        "scipy.special.expit": "not found: tf.math.sigmoid",
        "scipy.special.logit": "not found: log(x) - log1p(-x)",
        "scipy.special.gammaln": "not found: tf.math.lgamma",
        "scipy.special.digamma": _SCIPY_TF,
        "scipy.special.xlogy": _SCIPY_TF,
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
    },
    "autograd": {
        "logsumexp": "not in autograd.numpy: autograd.scipy.special.logsumexp",
        "scipy.special.logsumexp": _SCIPY_AUTOGRAD,
        "scipy.special.erf": _SCIPY_AUTOGRAD,
        "scipy.special.erfc": _SCIPY_AUTOGRAD,
        "scipy.special.expit": _SCIPY_AUTOGRAD,
        "scipy.special.logit": _SCIPY_AUTOGRAD,
        "scipy.special.gammaln": _SCIPY_AUTOGRAD,
        "scipy.special.digamma": _SCIPY_AUTOGRAD,
        "scipy.special.xlogy": "not in autograd: x * log(y), 0 where x == 0",
        "scipy.special.softmax": "not in autograd: from logsumexp",
        "scipy.special.log_softmax": "not in autograd: from logsumexp",
        "linalg.solve_triangular": "autograd.scipy.linalg.solve_triangular",
        "scipy.linalg.solve_triangular": "autoray looks in autograd.numpy: autograd.scipy.linalg",
        "linalg.eigvalsh": "no derivative in autograd: the eigenvalues of eigh",
        "linalg.qr": "no derivative in autograd: a primitive with one (rows >= columns, reduced mode)",
        "take_along_axis": "no derivative in autograd: fancy indexing",
        "sort": "autograd differentiates sort of vectors only: argsort, then take_along_axis",
        "cumprod": "no derivative in autograd: running products",
        "flip": "no derivative in autograd: reversed slices",
        "diagonal": "autograd differentiates offset=0 only: fancy indexing",
        "pad": "autograd's derivative fails unless `mode` is passed",
        "broadcast_to": "autograd's derivative fails on new leading axes: reshape first",
        "where": "a comparison of autograd's traced values is a numpy mask, so `where` dispatches to numpy: "
                 "numpy's `where` hands traced values to autograd.numpy.where",
    },
    "mlx": {
        "sin": f"{_EXACT64}: from tan(x/2), with exact derivatives",
        "cos": f"{_EXACT64}: from tan(x/2), with exact derivatives",
        "exp": f"{_EXACT64}: power(e, x)",
        "tan": "its derivative uses MLX's float32-accurate cos, float64 included: 1 + tan^2",
        "logaddexp": f"{_EXACT64} (its exp): max + log1p(exp(-|x - y|))",
        "logsumexp": f"{_EXACT64} (its exp): from the exact exp",
        "scipy.special.logsumexp": "not found: as logsumexp",
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.expit": f"not found; mx.sigmoid: {_EXACT64}: from the exact exp",
        "scipy.special.logit": "not found: log(x) - log1p(-x)",
        "scipy.special.erf": f"not found; mx.erf: {_EXACT64}: a series of positive terms in float64",
        "scipy.special.erfc": "not found: 1 - erf",
        "scipy.special.xlogy": "not found: x * log(y), 0 where x == 0",
        "scipy.special.gammaln": "MLX has no gamma functions: Lanczos' approximation (about 1e-14)",
        "scipy.special.digamma": "MLX has no gamma functions: the derivative of Lanczos' approximation",
        "hypot": "not in mlx.core: sqrt(x^2 + y^2)",
        "dot": "not in mlx.core: tensordot over numpy.dot's axes",
        "argmax": f"{_GATHER}: an integer result carries no derivative (stop_gradient)",
        "argsort": f"{_GATHER}: an integer result carries no derivative (stop_gradient)",
        "take": f"{_GATHER}: the indices with stop_gradient",
        "take_along_axis": f"{_GATHER}: the indices with stop_gradient",
        "linalg.inv": _NO_DERIVATIVE,
        "linalg.solve": _NO_DERIVATIVE,
        "linalg.cholesky": _NO_DERIVATIVE,
        "linalg.eigh": _NO_DERIVATIVE,
        "linalg.eigvalsh": f"{_NO_DERIVATIVE} (the eigenvalues of eigh)",
        "linalg.solve_triangular": "mx.linalg.solve_triangular takes `upper=` and has no derivative: a solve "
                                   "with the triangle",
        "scipy.linalg.solve_triangular": "not found: as linalg.solve_triangular",
    },
    "paddle": {
        "max": "paddle.max has no second derivative (max_grad has no grad op): the value at the argmax",
        "min": "paddle.min has no second derivative (min_grad has no grad op): the value at the argmin",
        "prod": "paddle.prod has no second derivative (prod_grad has no grad op): products of pairs",
        "logsumexp": "paddle.logsumexp takes `keepdim` and has no second derivative: shifted by its detached max",
        "scipy.special.logsumexp": "not found: as logsumexp",
        "scipy.special.softmax": "not found (paddle's softmax has no second derivative): from logsumexp",
        "scipy.special.log_softmax": "not found (paddle's log_softmax has no second derivative): from logsumexp",
        "std": "paddle.std's default is `unbiased=True` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "var": "paddle.var's default is `unbiased=True` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "take": "paddle.take takes no `axis`: paddle.index_select",
        "linalg.qr": "paddle 3.3's QR gradient crashes the process (a segfault) unless both Q and R are used: "
                     "each is tied to the other by a zero",
        "expand_dims": "not found: paddle.unsqueeze",
        "concatenate": "paddle.concat takes tensors only: numpy arrays in the list (with `like=x`) are converted",
        "stack": "paddle.stack takes tensors only: numpy arrays in the list (with `like=x`) are converted",
        "cumprod": "paddle.cumprod takes `dim`, not `axis`",
        "dot": "paddle.dot takes vectors only",
        "roll": "paddle.roll takes `shifts`, not `shift`",
        "repeat": "not found: paddle.repeat_interleave",
        "linalg.solve_triangular": "not found: paddle.linalg.triangular_solve, with `upper=` and a matrix "
                                   "right-hand side",
        "scipy.linalg.solve_triangular": "not found: paddle.linalg.triangular_solve, with `upper=` and a matrix "
                                         "right-hand side",
        "arcsin": "not found: paddle.asin",
        "arctan": "not found: paddle.atan",
        "arctan2": "not found: paddle.atan2, with a Python scalar second argument too",
        "maximum": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "minimum": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "logaddexp": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "hypot": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "scipy.special.erf": "not found: paddle.erf",
        "scipy.special.erfc": "not found: 1 - paddle.erf",
        "scipy.special.expit": "not found: paddle.nn.functional.sigmoid",
        "scipy.special.logit": "not found: paddle.logit",
        "scipy.special.gammaln": "not found: paddle.lgamma",
        "scipy.special.digamma": "not found: paddle.digamma",
        "scipy.special.xlogy": "not found: x * log(y), 0 where x == 0",
    },
    "pytensor": {
        "scipy.special.logsumexp": "not found: pytensor.tensor.logsumexp, with `axis`/`keepdims`",
        "scipy.special.erf": _SCIPY_PYTENSOR,
        "scipy.special.erfc": _SCIPY_PYTENSOR,
        "scipy.special.expit": "not found: pytensor.tensor.sigmoid",
        "scipy.special.logit": "not found: pytensor.tensor.special.logit",
        "scipy.special.gammaln": _SCIPY_PYTENSOR,
        "scipy.special.digamma": _SCIPY_PYTENSOR,
        "scipy.special.xlogy": "not in pytensor: x * log(y), 0 where x == 0",
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.linalg.solve_triangular": "not found: pytensor.tensor.linalg.solve_triangular",
        "linalg.norm": "pytensor's norm over an axis differentiates through a complex abs, which its "
                       "gradient refuses: sqrt(sum(x**2)) for the 2-norm and Frobenius norm",
        "prod": "pytensor's prod has no second derivative: a balanced tree of products (exact with zeros)",
        "split": "pytensor.tensor.split takes split sizes and a count, not numpy's sections or indices",
        "asarray": "not found: pytensor.tensor.as_tensor_variable, cast to `dtype`",
        "hypot": "not in pytensor: sqrt(x1**2 + x2**2)",
        "kron": "not found: pytensor.tensor.linalg.kron",
        "ravel": "not found: pytensor.tensor.flatten",
    },
    "finite_differences": {
        "logsumexp": "not in numpy: scipy.special.logsumexp",
        "linalg.solve_triangular": "not in numpy: scipy.linalg.solve_triangular",
    },
}

TOLERANCES = {
    # (value rtol, value atol, gradient rtol, gradient atol), relative to the largest
    # magnitude of the reference.
    "float64": (1e-10, 1e-12, 1e-6, 1e-8),
    "float32": (2e-5, 2e-6, 2e-4, 2e-5),
}
DTYPES = ("float64", "float32")


# ------------------------------------------------------------------ helpers
@functools.cache
def _backend(name: str) -> ad.Backend | str:
    """The backend, or why it is unavailable."""
    if name not in ad.available_backends():
        try:
            ad.backend(name)
        except Exception as err:  # the reason is the skip message
            return f"backend {name!r} is not available here: {err}"
        return f"backend {name!r} is not available here"
    return ad.backend(name)


def _load(name: str, config: Any) -> ad.Backend:
    requested = requested_backends(config)
    if requested and name not in requested:
        pytest.skip(f"backend {name!r} is not selected (--ad-backend / {ENV})")
    b = _backend(name)
    if isinstance(b, str):
        if name in requested:
            pytest.fail(f"{b} (asked for with --ad-backend / {ENV})", pytrace=False)
        pytest.skip(b)
    return b


@functools.cache
def _function(entry_id: str) -> Callable[..., Any]:
    """``f(x, *data)``: the entry's call, with ``x`` one array or a tuple of them (one object per entry)."""
    entry = _ENTRIES[entry_id]
    if len(entry.wrt) == 1:
        return lambda x, *data: entry.fn(x, *data)
    return lambda x, *data: entry.fn(*x, *data)


_ENTRIES = {p.id: p for p in PORTABLE}


def _weights(shape: tuple, dtype: str) -> np.ndarray:
    """Fixed, distinct weights for the pullback (a plain sum could hide a permutation)."""
    n = int(np.prod(shape))
    return (1.0 + 0.5 * np.cos(np.arange(n) + 1.0)).reshape(shape).astype(dtype)


def _point(entry: Portable, dtype: str) -> tuple[Any, list]:
    wrt, data = entry.inputs(dtype)
    return (wrt[0] if len(wrt) == 1 else tuple(wrt)), data


def _flat(tree: Any) -> list[np.ndarray]:
    tree = ad.to_numpy(tree)
    return [np.asarray(t) for t in (tree if isinstance(tree, tuple) else (tree,))]


@functools.cache
def _loss(entry_id: str) -> Callable[..., Any]:
    """``(sum(w * f(x)), f(x))``: a scalar to differentiate, the value as aux (one compilation)."""
    f = _function(entry_id)

    def loss(x: Any, w: Any, *data: Any) -> tuple[Any, Any]:
        out = f(x, *data)
        return do("sum", out * w), out

    return loss


@functools.cache
def _reference_gradient(entry_id: str, dtype: str) -> list[np.ndarray]:
    """Finite differences of ``sum(w * f(x))``, in float64 at the point rounded to ``dtype``."""
    entry = _ENTRIES[entry_id]
    x, data = _point(entry, dtype)
    x64 = tuple(a.astype(np.float64) for a in x) if isinstance(x, tuple) else x.astype(np.float64)
    w = _weights(entry.expected(dtype).shape, "float64")
    g, _ = ad.gradient("finite_differences", _loss(entry_id), x64, w, *data, has_aux=True)
    return _flat(g)


def _check(b: ad.Backend, entry: Portable, dtype: str, gradient: bool) -> None:
    rtol, atol, grtol, gatol = TOLERANCES[dtype]
    x, data = _point(entry, dtype)
    expected = entry.expected(dtype)
    w = _weights(expected.shape, dtype)
    if b.name == "finite_differences" and dtype != "float64":
        # float32 steps are too coarse for these tolerances (1e-5 at best, worse near a
        # kink): the gradient comes from the documented float32 oracle, which evaluates f
        # in float64; the value from f on the float32 inputs.
        y, _ = ad.value_and_pullback(b, _function(entry.id), x, *data)
        if gradient:
            oracle = ad.backend("finite_differences", compute_dtype="float64")
            g, _ = ad.gradient(oracle, _loss(entry.id), x, w, *data, has_aux=True)
    elif gradient:
        (_, y), g = ad.value_and_gradient(b, _loss(entry.id), x, w, *data, has_aux=True)
    else:
        y, _ = ad.value_and_pullback(b, _function(entry.id), x, *data)
    value = np.asarray(ad.to_numpy(y))
    assert value.shape == expected.shape, f"{entry.call}: shape {value.shape}, numpy's is {expected.shape}"
    np.testing.assert_allclose(value, expected, rtol=rtol, atol=atol * max(1.0, np.max(np.abs(expected))),
                               err_msg=f"{entry.call}: value")
    assert value.dtype == np.dtype(dtype), f"{entry.call}: value dtype {value.dtype}, inputs are {dtype}"
    if not gradient:
        return
    for k, (gk, ref) in enumerate(zip(_flat(g), _reference_gradient(entry.id, dtype))):
        assert gk.dtype == np.dtype(dtype), f"{entry.call}: gradient {k} dtype {gk.dtype}, inputs are {dtype}"
        np.testing.assert_allclose(gk, ref, rtol=grtol, atol=gatol * max(1.0, np.max(np.abs(ref))),
                                   err_msg=f"{entry.call}: gradient {k} against finite differences")


# ------------------------------------------------------------------ the grid
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry", PORTABLE, ids=lambda p: p.id)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_portable(backend_name: str, entry: Portable, dtype: str, request: pytest.FixtureRequest) -> None:
    b = _load(backend_name, request.config)
    status, reason = GAPS.get((backend_name, entry.id), ("✓", ""))
    if status == "✗":
        try:
            _check(b, entry, dtype, gradient=True)
        except Exception:  # the known gap
            pytest.xfail(reason)
        pytest.fail(f"XPASS(strict): {entry.call} now works on {backend_name}: remove it from GAPS and "
                    f"regenerate docs/guide/portable.md")
    _check(b, entry, dtype, gradient=status == "✓")


def _registered_by(lib: str, name: str) -> str | None:
    """The module of the function autoray calls for ``name`` on ``lib``, or None where it has
    none (numpy's ``logsumexp`` exists only once the numpy adapter registered it)."""
    import autoray

    try:
        return getattr(autoray.get_lib_fn(lib, name), "__module__", None)
    except (AttributeError, ImportError):
        return None


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_translations_come_from_the_adapters(backend_name: str, request: pytest.FixtureRequest) -> None:
    """The table's names this backend's adapter registers are exactly those of :data:`TRANSLATED`."""

    _load(backend_name, request.config)  # imports the adapter, which registers its translations
    module = f"abstractdiff.adapters.{backend_name}"
    # f sees the library's arrays, and numpy arrays (data autograd does not box)
    libs = {AUTORAY_NAME[backend_name], "numpy"}
    ours = {name for name in {p.name for p in PORTABLE} for lib in libs if _registered_by(lib, name) == module}
    assert ours == set(TRANSLATED[backend_name]), (
        f"registered by {module}: {sorted(ours)}; TRANSLATED lists {sorted(TRANSLATED[backend_name])}"
    )


def test_table_is_large_and_unique() -> None:
    assert len(PORTABLE) >= 60
    assert len({p.id for p in PORTABLE}) == len(PORTABLE)
    assert {p.category for p in PORTABLE} == set(CATEGORIES)
    assert set(TRANSLATED) == set(BACKENDS)
    assert not {n for per in TRANSLATED.values() for n in per} - {p.name for p in PORTABLE}
    assert not {b for _, b in GAPS} - {p.id for p in PORTABLE}


# ------------------------------------------------------------------ the docs page
BEGIN, END = "<!-- portable:table -->", "<!-- /portable:table -->"
_HEADINGS = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow", "autograd": "autograd",
             "mlx": "mlx", "paddle": "paddle", "pytensor": "pytensor", "finite_differences": "finite differences"}


def _cell(backend: str, entry: Portable) -> str:
    status, reason = GAPS.get((backend, entry.id), ("✓", ""))
    mark = status if not reason else f"{status}: {reason}"
    if entry.name in TRANSLATED[backend]:
        mark += " [†](#translations)"
    return mark


def render_table() -> str:
    """The generated part of docs/guide/portable.md (between the markers)."""
    out = [BEGIN, "<!-- generated by conformance_tests/test_portable.py: edit the table there -->", "",
           f"{len(PORTABLE)} calls.  ✓: the value matches numpy/scipy and the gradient matches finite "
           "differences, in float64 and in float32, with the inputs' dtype kept.  "
           "†: abstractdiff's translation (see [below](#translations)).", ""]
    for category in CATEGORIES:
        out += [f"### {category.capitalize()}", ""]
        out.append("| call | " + " | ".join(_HEADINGS[b] for b in BACKENDS) + " | notes |")
        out.append("|---|" + ":-:|" * len(BACKENDS) + "---|")
        for entry in (p for p in PORTABLE if p.category == category):
            call = entry.call.replace("|", "\\|")
            cells = " | ".join(_cell(b, entry) for b in BACKENDS)
            out.append(f"| `{call}` | {cells} | {entry.note} |")
        out.append("")
    out += ["### Translations", "",
            "What each adapter registers with `autoray.register_function` when its backend is created "
            "(`_register_portable_functions` at the end of `adapters/<library>.py`); every other call is "
            "autoray's own translation or the library's function of that name.", ""]
    for backend in BACKENDS:
        if not TRANSLATED[backend]:
            continue
        out += [f"**{_HEADINGS[backend]}**", "", "| name | why |", "|---|---|"]
        out += [f"| `{name}` | {why} |" for name, why in TRANSLATED[backend].items()]
        out.append("")
    out.append(END)
    return "\n".join(out)


def rendered_page(text: str) -> str:
    """``text`` with its table region replaced by :func:`render_table`."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{PAGE} has no {BEGIN} ... {END} region")
    return pattern.sub(lambda _: render_table(), text)


def test_docs_page_is_current() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert rendered_page(text) == text, (
        "docs/guide/portable.md is stale: run `.venv/bin/python -m conformance_tests.test_portable`"
    )


if __name__ == "__main__":
    PAGE.write_text(rendered_page(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {PAGE}")
