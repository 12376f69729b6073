"""The script tests/test_distributed.py launches: one process of a data-parallel run.

    torchrun --standalone --nproc_per_node 2 tests/distributed_worker.py OUT --backends torch,jax
    python tests/distributed_worker.py OUT --single --backends torch,jax      # the 1-process reference

Trains the parity MLP (float64) with Adam on batches of 9 and 8 rows (uneven and even
splits between 2 processes) and writes each rank's final parameters to
``OUT/<backend>_rank<r>.npz`` (``OUT/<backend>_single.npz`` with ``--single``).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--backends", default="torch")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--single", action="store_true", help="no DataParallel: the whole batch in one process")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--die-at", type=int, default=0, help="rank 1 exits abruptly at this step")
    p.add_argument("--hang-at", type=int, default=0, help="rank 1 stops responding at this step")
    p.add_argument("--save-at", type=int, default=0, help="rank 0 writes a checkpoint at this step and all stop")
    p.add_argument("--resume", default=None, help="load this checkpoint on every rank, then train the rest")
    return p.parse_args(argv)


def data(steps: int) -> list:
    from abstractdiff.parity import mlp_data

    batches = mlp_data(n=44, batch=9)  # 9, 9, 9, 9, 8 rows
    return [batches[i % len(batches)] for i in range(steps)]


def run(name: str, args: argparse.Namespace, dp) -> None:
    import abstractdiff as ad
    from abstractdiff import optim
    from abstractdiff.parity import mlp_init, mlp_loss

    implicit = name.startswith("implicit:")
    backend = ad.Implicit(name.partition(":")[2]) if implicit else ad.backend(name)

    def init():
        return ad.variables(mlp_init(), backend) if implicit else mlp_init()

    model = init()
    if dp is not None and dp.rank != 0:  # rank 0's parameters must win (broadcast)
        if implicit:
            for p in optim.params_of(model):
                value = optim.read(p)
                with optim.arithmetic_scope([value]):  # jax float64 outside x64 would become float32
                    optim.write(p, value + 1.0)
        else:
            model = {k: v + 1.0 for k, v in model.items()}
    state = optim.setup(optim.Adam(0.01), model)
    batches = data(args.steps)
    ckpt = os.path.join(args.out, f"{name.replace(':', '_')}.ckpt.npz")
    if args.resume:
        state, model = ad.load_checkpoint(ckpt, like=(state, init()))
        batches = batches[state.step:]

    def callback(info):
        if dp is not None and info.step == args.die_at and dp.rank == 1:
            os._exit(1)
        if dp is not None and info.step == args.hang_at and dp.rank == 1:
            time.sleep(600)
        if info.step == args.save_at:
            dp.save_checkpoint(ckpt, info.state, info.model)
            return False
        return True

    state, model = ad.train(mlp_loss, model, batches, state, backend=backend, progress=False,
                            callbacks=[callback], distributed=dp)
    tag = "single" if dp is None else f"rank{dp.rank}"
    np.savez(os.path.join(args.out, f"{name.replace(':', '_')}_{tag}.npz"), step=state.step, **ad.to_numpy(model))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import abstractdiff as ad

    dp = None if args.single else ad.DataParallel("gloo", timeout=args.timeout)
    for name in args.backends.split(","):
        run(name, args, dp)
    if dp is not None:
        dp.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
