"""ad.DataParallel keeps the ranks in step (issue 46, item 5): on every step the processes
check that they take the same step on batches of the same size with the same model
(``DataParallel.verify_step``), and a rank that differs is a ``DistributedError`` naming it.

The two-process cases run in ONE launch of this file as a script (two processes with
torchrun's environment, gloo), each rank going through the scenarios below in one process
group and writing what happened to ``rank<r>.json``; the tests read those files. Both
ranks see the same gathered rows, so both raise (or not) on the same call and stay paired
for the next scenario.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim
from tests.test_distributed import _env, _free_port, _gloo_reason, needs_gloo

HERE = Path(__file__).resolve()
#: the rank processes import the abstractdiff this process imported, and these tests
PYTHONPATH = os.pathsep.join([str(Path(ad.__file__).resolve().parent.parent), str(HERE.parent.parent)])
STEPS_BEFORE, STEPS_AFTER = 3, 3


# ------------------------------------------------------------------ the rank processes
def _loss(m, x, y):
    return ((x @ m["w"] - y) ** 2).mean()


def _data(seed: int, n: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(6, 2)), rng.normal(size=6)) for _ in range(n)]


def _scenario(results: dict, name: str, run) -> None:
    try:
        run()
        results[name] = None
    except ad.DistributedError as err:
        results[name] = str(err)


def _rank_main(out: Path) -> None:
    import torch

    dp = ad.DataParallel("gloo", timeout=60)
    r = dp.rank
    results: dict = {}
    model = {"w": np.arange(3.0), "b": np.ones(2)}
    other = {"w": model["w"].copy(), "b": model["b"].copy()}
    other["w"][1] = np.nextafter(other["w"][1], np.inf)  # one ulp in one element
    mine = other if r == 1 else model

    _scenario(results, "same", lambda: dp.verify_step(5, 8, model))
    _scenario(results, "one_ulp", lambda: dp.verify_step(5, 8, mine))
    _scenario(results, "rows", lambda: dp.verify_step(7, 6 if r == 1 else 8, model))
    _scenario(results, "step", lambda: dp.verify_step(9 if r == 1 else 7, 8, model))
    _scenario(results, "structure", lambda: dp.verify_step(4, 8, {"w": np.zeros(4)} if r == 1 else model))
    # step 1: rank 0's values are broadcast afterwards, so they may differ before
    _scenario(results, "first_step", lambda: dp.verify_step(1, 8, mine))
    swapped = {"w": model["w"][::-1].copy(), "b": model["b"]} if r == 1 else model
    _scenario(results, "swapped", lambda: dp.verify_step(5, 8, swapped))

    # implicit mode: a buffer (BatchNorm's running mean) that differs is found too
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).double()
    _scenario(results, "implicit_same", lambda: dp.verify_step(5, 8, net))
    if r == 1:
        with torch.no_grad():
            net[1].running_mean[0] += 1.0
    _scenario(results, "implicit_buffer", lambda: dp.verify_step(5, 8, net))

    # verify_every: N compares the values every N steps; 0 never checks (no collective)
    every3 = ad.DataParallel("gloo", timeout=60, verify_every=3)
    _scenario(results, "every3_step4", lambda: every3.verify_step(4, 8, mine))
    _scenario(results, "every3_step6", lambda: every3.verify_step(6, 8, mine))
    # one rank fingerprints (step 6), the other not (step 7): still one collective each
    _scenario(results, "every3_steps", lambda: every3.verify_step(7 if r == 1 else 6, 8, model))
    off = ad.DataParallel("gloo", timeout=60, verify_every=0)
    _scenario(results, "off", lambda: off.verify_step(9 if r == 1 else 7, 8, mine))

    # END-TO-END through ad.train: passes once _train.py's train_step calls
    # distributed.verify_step(step, n_rows, model) right after distributed.shard(batch).
    # Each rank trains STEPS_BEFORE steps alone (on its own data: different models, or the
    # same data: the same model), then they resume together.
    start = {"w": np.zeros(2)}
    alone = ad.train(_loss, start, _data(10 + r), optim.setup(optim.Adam(0.1), start), backend="torch",
                     progress=False)
    after = _data(20, STEPS_AFTER)
    _scenario(results, "train_different", lambda: ad.train(_loss, alone[1], after, alone[0], backend="torch",
                                                          progress=False, distributed=dp))
    alone = ad.train(_loss, start, _data(10), optim.setup(optim.Adam(0.1), start), backend="torch",
                     progress=False)
    trained: dict = {}

    def together() -> None:
        trained["state"], trained["model"] = ad.train(_loss, alone[1], after, alone[0], backend="torch",
                                                      progress=False, distributed=dp)

    _scenario(results, "train_same", together)
    if "model" in trained:
        results["train_same_w"] = ad.to_numpy(trained["model"]["w"]).tolist()
        results["train_same_step"] = int(trained["state"].step)
    (out / f"rank{r}.json").write_text(json.dumps(results))
    for group in (off, every3, dp):
        group.close()


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results of one two-process launch of this file."""
    if _gloo_reason():
        pytest.skip(_gloo_reason())
    out = tmp_path_factory.mktemp("in_step")
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(_env(), PYTHONPATH=PYTHONPATH, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(HERE), str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _both(ranks: list[dict], name: str) -> list:
    return [ranks[0][name], ranks[1][name]]


@needs_gloo
def test_ranks_in_step_pass(ranks):
    for name in ("same", "first_step", "implicit_same", "every3_step4", "off"):
        assert _both(ranks, name) == [None, None], name


@needs_gloo
def test_a_rank_with_a_different_model_is_named_on_every_rank(ranks):
    for message in _both(ranks, "one_ulp"):
        assert message is not None
        assert "rank 1's model values differ from rank 0's (1 of 2 arrays differ: ['w'])" in message
        assert "resume every rank from the same checkpoint" in message
    for message in _both(ranks, "swapped"):  # same values in another order
        assert message is not None and "rank 1's model values differ" in message
    for message in _both(ranks, "every3_step6"):
        assert message is not None and "rank 1's model values differ" in message


@needs_gloo
def test_a_different_buffer_is_named(ranks):
    for message in _both(ranks, "implicit_buffer"):
        assert message is not None and "(1 of 7 arrays differ: 1.running_mean)" in message


@needs_gloo
def test_a_batch_size_mismatch_after_the_first_step_is_an_error(ranks):
    for message in _both(ranks, "rows"):
        assert message is not None
        assert "before step 7" in message and "rank 1 was given a batch of 6 rows, rank 0 one of 8" in message
        assert "values" not in message  # the model is the same


@needs_gloo
def test_ranks_at_different_steps_or_structures_are_an_error(ranks):
    for message in _both(ranks, "step"):
        assert message is not None and "rank 1 is at step 9, rank 0 at step 7" in message
    for message in _both(ranks, "every3_steps"):
        assert message is not None and "rank 1 is at step 7, rank 0 at step 6" in message
    for message in _both(ranks, "structure"):
        assert message is not None and "rank 1's model has another structure" in message


@needs_gloo
def test_end_to_end_train_refuses_ranks_resumed_with_different_models(ranks):
    # end to end: train_step verifies the ranks each step (distributed.verify_step)
    for message in _both(ranks, "train_different"):
        assert message is not None and f"before step {STEPS_BEFORE + 1}" in message
        assert "rank 1's model values differ from rank 0's" in message


@needs_gloo
def test_end_to_end_matching_ranks_train_on_like_one_process(ranks):
    assert _both(ranks, "train_same") == [None, None]
    assert _both(ranks, "train_same_step") == [STEPS_BEFORE + STEPS_AFTER] * 2
    assert ranks[0]["train_same_w"] == ranks[1]["train_same_w"]  # bit for bit
    start = {"w": np.zeros(2)}
    state, model = ad.train(_loss, start, _data(10), optim.setup(optim.Adam(0.1), start), backend="torch",
                            progress=False)
    state, model = ad.train(_loss, model, _data(20, STEPS_AFTER), state, backend="torch", progress=False)
    np.testing.assert_allclose(ranks[0]["train_same_w"], ad.to_numpy(model["w"]), rtol=0, atol=1e-12)


# ------------------------------------------------------------------ one process, in this one
@pytest.mark.parametrize(("value", "error", "match"), [
    (-1, ad.InvalidArgumentError, "verify_every must be >= 0"),
    (1.5, ad.ArgumentTypeError, "verify_every must be an int"),
    (True, ad.ArgumentTypeError, "verify_every must be an int"),
])
def test_bad_verify_every(value, error, match):
    with pytest.raises(error, match=match):
        ad.DataParallel(rank=0, world_size=1, init_method="tcp://127.0.0.1:1", verify_every=value)


def test_the_fingerprint_sees_every_bit_of_every_leaf():
    pytest.importorskip("torch")
    import torch
    from abstractdiff.adapters.torch_distributed import _bit_sums as _sums

    def _bit_sums(t):
        return _sums([t])[0]

    # a rank that drifted by one bit anywhere differs from the others
    base = torch.tensor([0.5, -1.25, 3.0, 0.0, 2.0], dtype=torch.float32)
    expected = _bit_sums(base)
    raw = base.numpy().view(np.uint32)
    for i in range(raw.size):
        for bit in range(32):
            flipped = raw.copy()
            flipped[i] ^= np.uint32(1 << bit)
            assert not torch.equal(_bit_sums(torch.from_numpy(flipped.view(np.float32))), expected), (i, bit)
    # swapped elements (a transposed square matrix) change the position-weighted sums
    square = torch.arange(130.0 * 130.0).reshape(130, 130)
    wide = square.double()
    for a, b in ((square, square.T), (wide, wide.T), (base, base.flip(0)), (wide[0, :3], wide[0, :3].flip(0))):
        assert not torch.equal(_bit_sums(a), _bit_sums(b))
    # every dtype, odd sizes, strided and offset views: equal values, equal sums
    for t in (torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.complex128), torch.ones(3)[::2],
              torch.zeros(0), torch.tensor(2.0, dtype=torch.bfloat16), torch.arange(200.0)[1:], torch.ones(7)):
        assert torch.equal(_bit_sums(t), _bit_sums(t.clone()))
    # several tensors at once: each one's sums as alone
    many = [torch.arange(300.0), torch.ones(3, dtype=torch.float64), torch.zeros(0), torch.arange(129.0)]
    assert torch.equal(_sums(many), torch.stack([_bit_sums(t) for t in many]))


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
