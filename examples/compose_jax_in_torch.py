"""A JAX-written physics term inside a PyTorch model trained with ``ad.train``.

    python examples/compose_jax_in_torch.py                    # explicit mode, 300 steps
    python examples/compose_jax_in_torch.py --mode implicit --steps 100 --seed 1
    python examples/compose_jax_in_torch.py --steps 50 --rounds 5
    python examples/compose_jax_in_torch.py --physics-weight 0    # the noisy samples alone

A small tanh MLP (``torch.nn.Module``) fits a damped oscillation ``u(t)`` from a dozen
noisy samples.  Its loss adds a physics-informed regulariser: the residual of the
oscillator's equation ``u'' + 2 zeta omega u' + omega^2 u = 0`` on a collocation grid, by
finite differences.  That residual is written in ``jax.numpy`` (as a library author
would ship it) and called from the torch loss through ``ad.differentiate_with(term,
"jax")``: torch differentiates the network, jax the residual, each with its own AD.

The script checks itself first: the gradient of the composed loss with respect to the
model's parameters must equal, to 1e-12 in float64, the gradient of the same loss with
the residual written in torch.  Then it trains (printing the loss), and measures the
cost of crossing libraries: the time per training step with the jax term against the
same loop with the torch term, in interleaved rounds (median).  It exits with status 1
if the check fails.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import abstractdiff as ad
from abstractdiff import optim

OMEGA, ZETA = 3.0, 0.1          # the oscillator: angular frequency and damping ratio
T_END = 3.0                     # the time window [0, T_END]
N_GRID = 64                     # collocation points of the physics term
N_OBS, NOISE = 12, 0.05         # noisy observations
PHYSICS_WEIGHT = 1e-2
TOLERANCE = 1e-12               # float64: the composed and single-library gradients agree to rounding


# ------------------------------------------------------------------ the physics term, twice
@jax.jit  # as a jax library would ship it; eager jax dispatches op by op (about 0.5 ms a step more here)
def residual_jax(u):
    """Mean squared residual of ``u'' + 2 zeta omega u' + omega^2 u`` on the uniform grid
    (central differences, interior points): the kernel, written for jax."""
    h = T_END / (N_GRID - 1)
    d2 = (u[2:] - 2.0 * u[1:-1] + u[:-2]) / h**2
    d1 = (u[2:] - u[:-2]) / (2.0 * h)
    r = d2 + 2.0 * ZETA * OMEGA * d1 + OMEGA**2 * u[1:-1]
    return jnp.mean(r**2)


def residual_torch(u):
    """The same residual, written in torch: the single-library reference."""
    h = T_END / (N_GRID - 1)
    d2 = (u[2:] - 2.0 * u[1:-1] + u[:-2]) / h**2
    d1 = (u[2:] - u[:-2]) / (2.0 * h)
    r = d2 + 2.0 * ZETA * OMEGA * d1 + OMEGA**2 * u[1:-1]
    return torch.mean(r**2)


residual_from_jax = ad.differentiate_with(residual_jax, "jax")  # callable from torch code
TERMS: dict[str, Callable] = {"jax": residual_from_jax, "torch": residual_torch}


# ------------------------------------------------------------------ the problem
def exact(t: np.ndarray) -> np.ndarray:
    """The oscillator's solution with ``u(0) = 1``, ``u'(0) = -zeta omega``."""
    damped = OMEGA * np.sqrt(1.0 - ZETA**2)
    return np.exp(-ZETA * OMEGA * t) * np.cos(damped * t)


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(t_obs, u_obs, t_grid)``, float64 columns: noisy samples and the collocation grid."""
    rng = np.random.default_rng(seed)
    t_obs = np.sort(rng.uniform(0.0, T_END, N_OBS))
    u_obs = exact(t_obs) + NOISE * rng.normal(size=N_OBS)
    t_grid = np.linspace(0.0, T_END, N_GRID)
    return tuple(torch.tensor(a, dtype=torch.float64).reshape(-1, 1) for a in (t_obs, u_obs, t_grid))


def make_net(seed: int, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(1, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    ).double()


def predict(mode: str, net: torch.nn.Module, model, t: torch.Tensor) -> torch.Tensor:
    """The network at ``t``: ``model`` is the module itself (implicit mode) or a dict of
    its parameters (explicit mode, through ``torch.func.functional_call``)."""
    if mode == "implicit":
        return model(t)
    return torch.func.functional_call(net, model, (t,))


def make_loss(term: Callable, mode: str, net: torch.nn.Module, weight: float = PHYSICS_WEIGHT) -> Callable:
    """``loss(model, t_obs, u_obs, t_grid)``: data misfit plus the weighted physics term."""

    def loss(model, t_obs, u_obs, t_grid):
        misfit = torch.mean((predict(mode, net, model, t_obs) - u_obs) ** 2)
        return misfit + weight * term(predict(mode, net, model, t_grid).reshape(-1))

    return loss


def make_model(mode: str, seed: int) -> tuple[torch.nn.Module, object]:
    """The module and what ``train_step`` trains: the module (implicit) or a copy of its
    parameters as a dict of tensors (explicit)."""
    net = make_net(seed)
    if mode == "implicit":
        return net, net
    return net, {k: v.detach().clone() for k, v in net.named_parameters()}


def backend_for(mode: str) -> ad.Backend:
    return ad.Implicit("torch") if mode == "implicit" else ad.backend("torch")


# ------------------------------------------------------------------ the three parts
def parameter_gradients(term: Callable, mode: str, seed: int) -> list[np.ndarray]:
    """The gradient of the loss with ``term`` with respect to each parameter of the initial model."""
    net, model = make_model(mode, seed)
    loss = make_loss(term, mode, net)
    batch = make_data(seed)
    if mode == "implicit":
        gs = ad.gradient(backend_for(mode), lambda *b: loss(net, *b), ad.Params(net), *batch)
        return [ad.to_numpy(gs[p]) for p in net.parameters()]
    gs = ad.gradient(backend_for(mode), loss, model, *batch)
    return [ad.to_numpy(gs[k]) for k in model]


def check_gradients(mode: str, seed: int) -> float:
    """Largest relative difference (max-norm, per parameter) between the gradient of the
    composed loss (jax term) and of the torch-only loss."""
    composed = parameter_gradients(TERMS["jax"], mode, seed)
    reference = parameter_gradients(TERMS["torch"], mode, seed)
    return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(composed, reference))


def train(
    mode: str, seed: int, steps: int, weight: float = PHYSICS_WEIGHT, lr: float = 1e-2
) -> tuple[list[float], object]:
    """``steps`` Adam steps on the composed loss: the losses (before each step) and the model."""
    net, model = make_model(mode, seed)
    batch = make_data(seed)
    loss = make_loss(residual_from_jax, mode, net, weight)
    losses: list[float] = []
    state = optim.setup(optim.Adam(lr=lr), model)
    state, model = ad.train(loss, model, [batch] * steps, state, backend=backend_for(mode), progress=False,
                            callbacks=[lambda info: losses.append(info.loss)])
    return losses, model


def measure_overhead(mode: str, seed: int, rounds: int, steps_per_round: int) -> dict[str, float]:
    """Median milliseconds per ``train_step`` with each term, rounds interleaved (the order
    alternating), after a warm-up step each."""
    batch = make_data(seed)
    b = backend_for(mode)
    runs = {}
    for name, term in TERMS.items():
        net, model = make_model(mode, seed)
        loss = make_loss(term, mode, net)
        state = optim.setup(optim.Adam(lr=1e-2), model)
        state, model, _ = ad.train_step(loss, model, batch, state, backend=b)  # warm-up
        runs[name] = [loss, model, state]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            loss, model, state = runs[name]
            start = time.perf_counter()
            for _ in range(steps_per_round):
                state, model, _ = ad.train_step(loss, model, batch, state, backend=b)
            times[name].append(1e3 * (time.perf_counter() - start) / steps_per_round)
            runs[name] = [loss, model, state]
    return {name: statistics.median(ts) for name, ts in times.items()}


def rms_error(mode: str, seed: int, model) -> float:
    """Root-mean-square error of the trained network against the exact solution on the grid."""
    _, _, t_grid = make_data(seed)
    with torch.no_grad():
        u = predict(mode, make_net(seed), model, t_grid).numpy().ravel()
    return float(np.sqrt(np.mean((u - exact(t_grid.numpy().ravel())) ** 2)))


# ------------------------------------------------------------------ the script
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("explicit", "implicit"), default="explicit",
                        help="train a dict of the module's parameters (explicit) or the module itself (implicit)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--physics-weight", type=float, default=PHYSICS_WEIGHT,
                        help="weight of the physics term in training (0: fit the noisy samples alone)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved timing rounds (median)")
    parser.add_argument("--steps-per-round", type=int, default=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.steps_per_round) < 1:
        parser.error("--steps, --rounds and --steps-per-round must be at least 1")
    print(f"mode {args.mode}, seed {args.seed}: torch MLP, physics term {residual_from_jax!r}")

    diff = check_gradients(args.mode, args.seed)
    ok = diff <= TOLERANCE
    print(f"check: parameters' gradient, jax term through differentiate_with vs the torch term: largest "
          f"relative difference {diff:.1e} (tolerance {TOLERANCE:.0e}): {'passed' if ok else 'FAILED'}")
    if not ok:
        return 1

    losses, model = train(args.mode, args.seed, args.steps, args.physics_weight)
    every = max(1, len(losses) // 6)
    for step in sorted({*range(0, len(losses), every), len(losses) - 1}):
        print(f"  step {step + 1:4d}: loss {losses[step]:.5f}")
    print(f"trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"RMS error against the exact solution {rms_error(args.mode, args.seed, model):.4f}")

    ms = measure_overhead(args.mode, args.seed, args.rounds, args.steps_per_round)
    print(f"time per training step (median of {args.rounds} interleaved rounds of {args.steps_per_round}): "
          f"jax term via differentiate_with {ms['jax']:.2f} ms, torch term {ms['torch']:.2f} ms, "
          f"ratio {ms['jax'] / ms['torch']:.2f}x (+{ms['jax'] - ms['torch']:.2f} ms a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
