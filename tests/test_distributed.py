"""ad.DataParallel: 2 processes (torchrun, gloo) train exactly like 1 process on the whole
batch on every backend; a dead or hung process is an error on the others, not a hang;
checkpoints restart bit-identically; every error path raises the package's errors.

The multi-process tests launch tests/distributed_worker.py with torchrun (or as two
plain processes with torchrun's environment) in subprocesses with a timeout.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff._distributed import shard_batch, shard_rows

WORKER = str(Path(__file__).with_name("distributed_worker.py"))
ROOT = Path(__file__).resolve().parent.parent


def _gloo_reason() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError as err:
        return f"torch is not installed ({err})"
    if not dist.is_available():
        return "this torch was built without torch.distributed"
    if not dist.is_gloo_available():
        return "this torch has no gloo backend"
    return None


needs_gloo = pytest.mark.skipif(_gloo_reason() is not None, reason=str(_gloo_reason()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(out: Path, *args: str, timeout: float = 240) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           WORKER, str(out), *args]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def _single(out: Path, *args: str, timeout: float = 240) -> None:
    done = subprocess.run([sys.executable, WORKER, str(out), "--single", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def _available(names: list[str]) -> list[str]:
    have = ad.available_backends()
    return [n for n in names if n.partition(":")[2 if ":" in n else 0] in have]


def _params(out: Path, name: str, tag: str) -> dict[str, np.ndarray]:
    with np.load(out / f"{name.replace(':', '_')}_{tag}.npz") as f:
        return {k: f[k] for k in f.files}


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


#: steps per training run: four passes over the five batches (the last one smaller), each
#: backend's step traced and its rule's state advanced (50 took ~75 s on the slow group)
STEPS = 20
FAST = ["torch", "jax", "tensorflow", "autograd", "implicit:torch", "implicit:autograd"]
SLOW = ["mlx", "paddle", "pytensor", "finite_differences", "implicit:jax", "implicit:tensorflow"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Each group of backends trained once by 2 processes and once by 1 (STEPS steps).  Under
    pytest-xdist a group runs once per session, not once per xdist process that meets its
    tests (pytest-xdist's documented file-lock recipe, as tests/test_keras.py)."""
    done: dict[str, Path | BaseException] = {}
    shared = getattr(request.config, "workerinput", None) is not None and importlib.util.find_spec("filelock")

    def launch(key: str, out: Path) -> None:
        _torchrun(out, "--backends", key, "--steps", str(STEPS))
        _single(out, "--backends", key, "--steps", str(STEPS))

    def launch_shared(key: str) -> Path:
        from filelock import FileLock

        out = tmp_path_factory.getbasetemp().parent / f"dp-{key.replace(',', '-').replace(':', '_')}"
        failed = out.with_suffix(".failed")
        with FileLock(f"{out}.lock"):
            if not out.is_dir() and not failed.is_file():
                out.mkdir()
                try:
                    launch(key, out)
                except (AssertionError, subprocess.TimeoutExpired) as err:
                    failed.write_text(f"{type(err).__name__}: {err}")
                    out.rename(out.with_suffix(".partial"))
        if failed.is_file():
            raise AssertionError(f"the {key} runs failed (in another xdist process): {failed.read_text()}")
        return out

    def run(group: list[str]) -> Path:
        key = ",".join(group)
        if key not in done:
            try:
                if shared:
                    done[key] = launch_shared(key)
                else:
                    done[key] = out = tmp_path_factory.mktemp("dp")
                    launch(key, out)
            except (AssertionError, subprocess.TimeoutExpired) as err:  # launched once, not once per test
                done[key] = err
        result = done[key]
        if isinstance(result, BaseException):
            raise result
        return result

    return run


def _check_same_as_one_process(runs, group: list[str], name: str) -> None:
    if name not in _available([name]):
        pytest.skip(f"{name.partition(':')[2] or name} is not available here")
    out = runs(_available(group))
    single, rank0, rank1 = (_params(out, name, t) for t in ("single", "rank0", "rank1"))
    assert int(single.pop("step")) == int(rank0.pop("step")) == int(rank1.pop("step")) == STEPS
    assert _max_diff(rank0, rank1) == 0.0  # the processes hold identical parameters
    assert single["w0"].dtype == rank0["w0"].dtype == np.float64
    assert _max_diff(single, rank0) < 1e-10


@needs_gloo
@pytest.mark.parametrize("name", FAST)
def test_two_processes_train_like_one_on_the_whole_batch(runs, name):
    _check_same_as_one_process(runs, FAST, name)


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_two_processes_train_like_one_on_every_other_backend(runs, name):
    _check_same_as_one_process(runs, SLOW, name)


@needs_gloo
def test_restarting_from_a_checkpoint_continues_bit_identically(runs, tmp_path):
    full = runs(_available(FAST))
    _torchrun(tmp_path, "--backends", "torch", "--steps", str(STEPS), "--save-at", "8")
    assert (tmp_path / "torch.ckpt.npz").exists()
    _torchrun(tmp_path, "--backends", "torch", "--steps", str(STEPS), "--resume", "1")
    expected = _params(full, "torch", "rank0")
    for rank in ("rank0", "rank1"):
        resumed = _params(tmp_path, "torch", rank)
        assert int(resumed.pop("step")) == STEPS
        for k in resumed:
            np.testing.assert_array_equal(resumed[k], expected[k])


def _launch_two(out: Path, *args: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The two processes torchrun would start, without its agent (which would kill rank 0
    as soon as rank 1 fails, before rank 0 could report anything itself)."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, WORKER, str(out), "--backends", "autograd", *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs[0], procs[1]


def _rank0_error(out: Path, *args: str, within: float) -> tuple[str, float]:
    rank0, rank1 = _launch_two(out, *args)
    start = time.monotonic()
    try:
        _, err = rank0.communicate(timeout=120)
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
            p.communicate()
    elapsed = time.monotonic() - start
    assert rank0.returncode != 0
    assert elapsed < within, f"rank 0 took {elapsed:.1f} s to give up"
    return err, elapsed


@needs_gloo
def test_a_process_that_dies_is_a_clear_error_on_the_others(tmp_path):
    err, _ = _rank0_error(tmp_path, "--die-at", "10", "--timeout", "20", within=60)
    assert "abstractdiff._errors.DistributedError" in err and "rank 0 of 2" in err, err[-3000:]
    assert "Another process probably exited or hangs" in err


@needs_gloo
def test_a_process_that_hangs_is_an_error_after_the_timeout(tmp_path):
    err, _ = _rank0_error(tmp_path, "--hang-at", "10", "--timeout", "3", within=60)
    assert "abstractdiff._errors.DistributedError" in err and "timeout=3 s" in err, err[-3000:]


# ------------------------------------------------------------------ one process, in this one
@pytest.fixture(scope="module")
def dp():
    """A process group of one process: enough for the crossing and the error paths."""
    if _gloo_reason():
        pytest.skip(_gloo_reason())
    group = ad.DataParallel("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            timeout=30)
    yield group
    group.close()


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


ALL = ["torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor", "finite_differences"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", ALL)
def test_every_backends_arrays_cross_and_come_back_as_they_were(dp, name, dtype):
    try:
        b = ad.backend(name)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))
    g = b.convert(np.arange(6.0, dtype=dtype).reshape(2, 3))
    loss = b.convert(np.array(2.5, dtype=dtype))
    new_loss, (new_g, none) = dp.average(loss, [g, None], 1.0)
    assert none is None
    for new, old in ((new_loss, loss), (new_g, g)):
        assert type(new) is type(old) or b.is_native(new)
        assert ad.to_numpy(new).dtype == np.dtype(dtype)
        np.testing.assert_array_equal(ad.to_numpy(new), ad.to_numpy(old))
    (back,) = dp.broadcast([g])
    assert b.is_native(back) or type(back) is type(g)
    np.testing.assert_array_equal(ad.to_numpy(back), ad.to_numpy(g))


def test_train_with_one_process_is_plain_training(dp):
    from abstractdiff.parity import mlp_data, mlp_init, mlp_loss

    data = mlp_data()
    expected = ad.train(mlp_loss, mlp_init(), data, optim.setup(optim.Adam(0.01), mlp_init()),
                        backend="autograd", progress=False)[1]
    got = ad.train(mlp_loss, mlp_init(), data, optim.setup(optim.Adam(0.01), mlp_init()), backend="autograd",
                   progress=False, distributed=dp)[1]
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-14)


def test_non_float_gradients_are_refused(dp):
    with pytest.raises(ad.ArgumentTypeError, match="gradient 0 is int64, not a float array"):
        dp.average(np.array(1.0), [np.array([1, 2])], 1.0)
    with pytest.raises(ad.ArgumentTypeError, match="the loss is"):
        dp.average("loss", [], 1.0)


def test_arrays_that_cannot_cross_to_torch_are_refused(dp):
    if np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("numpy's longdouble is float64 on this platform")
    with pytest.raises(ad.ArgumentTypeError, match="cannot cross to torch"):
        dp.average(np.array(1.0), [np.ones(2, dtype=np.longdouble)], 1.0)


def test_processes_with_different_models_are_an_error(dp, monkeypatch):
    monkeypatch.setattr(dp._engine, "all_gather_object", lambda obj: [obj, [obj[0], 99]])
    with pytest.raises(ad.DistributedError, match="rank 1 has"):
        dp.check_same("the model", ["tree", 8])


def test_distributed_must_be_a_data_parallel():
    state = optim.setup(optim.Descent(0.1), {"w": np.zeros(2)})
    with pytest.raises(ad.ArgumentTypeError, match="ad.DataParallel"):
        ad.train_step(lambda m, x: (m["w"] ** 2).sum(), {"w": np.zeros(2)}, (np.ones((2, 2)),), state,
                      backend="finite_differences", distributed="gloo")


def test_outside_torchrun_is_a_clear_error(no_torchrun):
    with pytest.raises(ad.DistributedError, match="torchrun --standalone --nproc_per_node 2"):
        ad.DataParallel()


def test_a_world_size_that_disagrees_with_torchrun_is_an_error(no_torchrun):
    no_torchrun.setenv("RANK", "0")
    no_torchrun.setenv("WORLD_SIZE", "2")
    with pytest.raises(ad.DistributedError, match="world_size=3 was given.*WORLD_SIZE=2"):
        ad.DataParallel(world_size=3)
    with pytest.raises(ad.DistributedError, match="MASTER_ADDR and MASTER_PORT"):
        ad.DataParallel()


def test_a_world_size_that_disagrees_with_the_process_group_is_an_error(dp, no_torchrun):
    with pytest.raises(ad.DistributedError, match="already exists as rank 0 of 1"):
        ad.DataParallel("gloo", rank=0, world_size=2, init_method="tcp://127.0.0.1:1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "0 <= rank < world_size"),
        ({"rank": 0, "world_size": 1, "timeout": 0}, "timeout must be"),
        ({"rank": 0, "world_size": 1, "uneven": "drop"}, "uneven must be one of"),
    ],
)
def test_bad_arguments(no_torchrun, kwargs, match):
    with pytest.raises(ad.InvalidArgumentError, match=match):
        ad.DataParallel(init_method="tcp://127.0.0.1:1", **kwargs)
    with pytest.raises(ad.ArgumentTypeError, match="rank must be an int"):
        ad.DataParallel(rank="0", world_size=1)


def test_an_unknown_communication_backend_is_an_error(dp, no_torchrun):
    with pytest.raises(ad.InvalidArgumentError, match="backend must be one of"):
        ad.DataParallel("mpi", rank=0, world_size=1, init_method="tcp://127.0.0.1:1")


# ------------------------------------------------------------------ sharding
def test_shards_are_contiguous_blocks_covering_the_batch():
    for n in range(3, 12):
        for world in (1, 2, 3):
            blocks = [shard_rows(n, r, world) for r in range(world)]
            assert [i for s in blocks for i in range(s.start, s.stop)] == list(range(n))
            assert max(s.stop - s.start for s in blocks) - min(s.stop - s.start for s in blocks) <= 1


def test_uneven_blocks_are_weighted_by_their_rows():
    (x, y), share, n = shard_batch((np.arange(7.0), np.arange(7.0) * 2), rank=1, world_size=2)
    np.testing.assert_array_equal(x, [4.0, 5.0, 6.0])
    assert share == 3 / 7 and n == 7 and y.shape == (3,)


def test_sharding_errors():
    with pytest.raises(ad.InvalidArgumentError, match="does not split evenly"):
        shard_batch((np.zeros((7, 2)),), 0, 2, uneven="error")
    with pytest.raises(ad.InvalidArgumentError, match="a batch of 1 rows cannot be split between 2"):
        shard_batch((np.zeros((1, 2)),), 0, 2)
    with pytest.raises(ad.InvalidArgumentError, match="different leading"):
        shard_batch((np.zeros((4, 2)), np.zeros(5)), 0, 2)
    with pytest.raises(ad.InvalidArgumentError, match="no array with a leading"):
        shard_batch((1.0, np.array(2.0)), 0, 2)
