"""Benchmark workloads, written once with autoray so every backend runs the same code.

* ``tiny``: a 10-element function, to measure dispatch overhead;
* ``gmm``: the ADBench/GradBench Gaussian-mixture objective (d=10, K=25, n=1000), inputs
  generated the way GradBench's ``gmm`` eval generates them (seed 31337, the same draw
  order);
* ``mlp``: the loss of a 784-128-10 MLP (about 1e5 parameters) on a batch of 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import autoray
import numpy as np
from autoray import do
from autoray import numpy as anp


@dataclass
class Workload:
    name: str
    f: Callable[..., Any]  # f(x, *args) -> scalar
    x: Any  # differentiated pytree (numpy)
    args: tuple = ()  # data, passed through (numpy)
    description: str = ""
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- tiny
def tiny_f(x: Any) -> Any:
    return anp.sum(anp.sin(x) * x + x**2)


def tiny() -> Workload:
    x = np.linspace(-1.0, 1.0, 10)
    return Workload("tiny", tiny_f, x, (), "sum(sin(x) * x + x^2), 10 elements")


# ----------------------------------------------------------------------- GMM
def gmm_inputs(d: int = 10, k: int = 25, n: int = 1000) -> dict[str, Any]:
    """GMM inputs drawn as GradBench's ``gmm`` data generator draws them."""
    rng_state = np.random.get_state()
    try:
        np.random.seed(31337)
        k_max, n_max = 200, 10000
        uniform = np.random.uniform(0, 1, k_max * d)
        normal = np.random.normal(0, 1, k_max * (1 + d + d * (d - 1) // 2) + n_max * d)
    finally:
        np.random.set_state(rng_state)  # leave the global numpy RNG as we found it
    n_icf = d + d * (d - 1) // 2
    pos = 0
    alphas = normal[pos : pos + k]
    pos += k
    icf = normal[pos : pos + k * n_icf].reshape(k, n_icf)
    pos += k * n_icf
    x = normal[pos : pos + n * d].reshape(n, d)
    means = uniform[: k * d].reshape(k, d)
    return {"alphas": alphas, "means": means, "icf": icf, "x": x, "gamma": 1.0, "m": 0}


def _lower_scatter(d: int) -> np.ndarray:
    """Constant (d(d-1)/2, d*d) matrix that places icf's off-diagonal part below the diagonal.

    Building L by a matmul with a constant keeps the objective free of in-place
    assignment, which autograd and jax do not support.
    """
    rows = [(i, j) for j in range(d) for i in range(j + 1, d)]  # column-major, as ADBench
    m = np.zeros((len(rows), d * d))
    for r, (i, j) in enumerate(rows):
        m[r, i * d + j] = 1.0
    return m


def _logsumexp(a: Any, axis: int | None = None) -> Any:
    """log(sum(exp(a))) over ``axis`` (all axes when None), shifted by the max for stability."""
    mx = do("max", a, axis=axis, keepdims=True)
    out = anp.log(anp.sum(anp.exp(a - mx), axis=axis, keepdims=True)) + mx
    return anp.reshape(out, (-1,)) if axis is not None else anp.reshape(out, ())


def gmm_objective(params: dict, x: Any, scatter: Any, gamma: float, m: int) -> Any:
    alphas, means, icf = params["alphas"], params["means"], params["icf"]
    n, d = autoray.shape(x)  # Python ints on every backend (PyTensor's x.shape is symbolic)
    k = autoray.shape(alphas)[0]
    log_qdiag = icf[:, :d]
    qdiags = anp.exp(log_qdiag)
    sum_qs = anp.sum(log_qdiag, axis=1)
    ls = anp.reshape(anp.matmul(icf[:, d:], scatter), (k, d, d))
    xcentered = anp.reshape(x, (n, 1, d)) - anp.reshape(means, (1, k, d))
    lx = anp.reshape(qdiags, (1, k, d)) * xcentered + do("einsum", "kij,nkj->nki", ls, xcentered)
    sqsum = anp.sum(lx**2, axis=2)
    inner = anp.reshape(alphas + sum_qs, (1, k)) - 0.5 * sqsum
    slse = anp.sum(_logsumexp(inner, axis=1))
    const = -n * d * 0.5 * math.log(2 * math.pi)
    # Wishart prior on the precision matrices.
    nn = d + m + 1
    prior = anp.sum(0.5 * gamma**2 * (anp.sum(qdiags**2, axis=1) + anp.sum(icf[:, d:] ** 2, axis=1)) - m * sum_qs)
    log_gamma = 0.25 * d * (d - 1) * math.log(math.pi)
    log_gamma += sum(math.lgamma(0.5 * nn + 0.5 * (1 - j)) for j in range(1, d + 1))
    c = nn * d * (math.log(gamma) - 0.5 * math.log(2)) - log_gamma
    return const + slse - n * _logsumexp(alphas) + prior - k * c


def gmm(d: int = 10, k: int = 25, n: int = 1000) -> Workload:
    inp = gmm_inputs(d, k, n)
    params = {"alphas": inp["alphas"], "means": inp["means"], "icf": inp["icf"]}
    args = (inp["x"], _lower_scatter(d), inp["gamma"], inp["m"])
    description = f"GMM objective, d={d}, K={k}, n={n}"
    return Workload("gmm", gmm_objective, params, args, description, {"d": d, "k": k, "n": n})


# ----------------------------------------------------------------------- MLP
def mlp_loss(params: dict, inputs: Any, targets: Any) -> Any:
    h = anp.tanh(anp.matmul(inputs, params["w1"]) + params["b1"])
    logits = anp.matmul(h, params["w2"]) + params["b2"]
    mx = do("max", logits, axis=1, keepdims=True)
    logz = anp.log(anp.sum(anp.exp(logits - mx), axis=1, keepdims=True)) + mx
    return -anp.sum(targets * (logits - logz)) / inputs.shape[0]


def mlp(n_in: int = 784, n_hidden: int = 128, n_out: int = 10, batch: int = 128, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(0, 1 / math.sqrt(n_in), (n_in, n_hidden)),
        "b1": np.zeros(n_hidden),
        "w2": rng.normal(0, 1 / math.sqrt(n_hidden), (n_hidden, n_out)),
        "b2": np.zeros(n_out),
    }
    inputs = rng.normal(0, 1, (batch, n_in))
    targets = np.eye(n_out)[rng.integers(0, n_out, batch)]
    n_params = sum(p.size for p in params.values())
    description = f"MLP {n_in}-{n_hidden}-{n_out} loss, batch {batch}, {n_params} parameters"
    return Workload("mlp", mlp_loss, params, (inputs, targets), description, {"n_params": n_params})


WORKLOADS: dict[str, Callable[[], Workload]] = {"tiny": tiny, "gmm": gmm, "mlp": mlp}
