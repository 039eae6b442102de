"""Train a two-layer MLP whose kernels live in libmlp.so (mlp.cu), the workload of the AI flame graph example.

Python does what a training script's Python does: builds each batch (here, synthetic data drawn on the CPU),
hands it to the device and calls forward, backward and the optimizer step; every kernel is launched from native
code under those Python frames, so a launch stack reads train -> train_step -> forward -> mlp_forward -> matmul.
Without a GPU the CUDA calls fail and the loss stays 0; the launches are made all the same.

Usage: python train.py LIBMLP [--steps N]
"""

from __future__ import annotations

import argparse
import ctypes
import random

BATCH, IN, HIDDEN, OUT = 64, 256, 512, 10


def make_batch(rng: random.Random) -> tuple[ctypes.Array[ctypes.c_float], ctypes.Array[ctypes.c_int]]:
    """A batch of noisy class prototypes: the CPU-side data work of a training step."""
    labels = [rng.randrange(OUT) for _ in range(BATCH)]
    xs = [((y * 31 + j) % 7) * 0.1 + rng.gauss(0.0, 1.0) for y in labels for j in range(IN)]
    return (ctypes.c_float * len(xs))(*xs), (ctypes.c_int * BATCH)(*labels)


def forward(lib: ctypes.CDLL) -> None:
    lib.mlp_forward()


def backward(lib: ctypes.CDLL) -> None:
    lib.mlp_backward()


def optimizer_step(lib: ctypes.CDLL, lr: float) -> None:
    lib.mlp_sgd(ctypes.c_float(lr))


def train_step(lib: ctypes.CDLL, rng: random.Random, lr: float) -> float:
    x, y = make_batch(rng)
    lib.mlp_upload(x, y)
    forward(lib)
    backward(lib)
    optimizer_step(lib, lr)
    return float(lib.mlp_loss())


def train(lib: ctypes.CDLL, steps: int) -> None:
    rng = random.Random(0)
    for step in range(steps):
        loss = train_step(lib, rng, lr=0.05)
        if step % 10 == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", help="path of libmlp.so")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    lib = ctypes.CDLL(args.lib)
    lib.mlp_loss.restype = ctypes.c_float
    status = lib.mlp_init(BATCH, IN, HIDDEN, OUT)
    print(f"mlp_init: CUDA status {status} (35: no driver, the kernels are launched regardless)", flush=True)
    train(lib, args.steps)


if __name__ == "__main__":
    main()
