# ruff: noqa: E402  (time is imported first, to time the start-up that torch's import is most of)
"""A small GPT-style training loop on one CUDA GPU, for measuring what profiling costs a real PyTorch job
(issues #25, #26): token embedding, N pre-norm transformer blocks (causal flash attention, GELU MLP), bf16
autocast, AdamW, random tokens. With --nccl the gradients are all-reduced through NCCL (world size 1), as DDP
does. After --warmup seconds it counts steps for --seconds and prints one JSON line: steps/s and launches/step.

    python3 gpt_loop.py [--seconds 10] [--warmup 3] [--layers 4] [--d 512] [--heads 8] [--seq 256] [--batch 16]
"""

from __future__ import annotations

import time

START = time.monotonic()  # before torch's import: startup_s is the script's start to its first step

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(self.ln2(x))))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x)
        return x + self.mlp(x)


class Gpt(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


def train_step(model: Gpt, opt: torch.optim.Optimizer, idx: torch.Tensor, nccl: bool) -> None:
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    if nccl:
        import torch.distributed as dist

        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
    opt.step()


def _map_cudnn() -> None:
    import ctypes
    import glob

    import nvidia.cudnn  # the wheel torch's CUDA build depends on

    libs = sorted(glob.glob(os.path.join(list(nvidia.cudnn.__path__)[0], "lib", "libcudnn*.so.9")))
    for _ in range(2):  # a second pass for those that needed another one first
        for lib in list(libs):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                libs.remove(lib)
            except OSError:
                pass
    if libs:
        print(f"gpt_loop: could not map {', '.join(os.path.basename(x) for x in libs)}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the script where there is no GPU")
    ap.add_argument("--map-cudnn", action="store_true",
                    help="map cuDNN's libraries first, as a GPU job does at its first attention or convolution (for "
                         "the CPU proxy: their unwind tables press on aiflame's pool although never executed)")
    a = ap.parse_args()
    if a.map_cudnn:
        _map_cudnn()
    if a.nccl:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    model = Gpt(a.vocab, a.d, a.heads, a.layers, a.seq).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=a.device)

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    t0 = time.monotonic()
    while time.monotonic() - t0 < a.warmup:
        train_step(model, opt, idx, a.nccl)
    sync()
    steps = 0
    t1 = time.monotonic()
    while time.monotonic() - t1 < a.seconds:
        train_step(model, opt, idx, a.nccl)
        steps += 1
    sync()
    dt = time.monotonic() - t1
    print(json.dumps({"steps": steps, "seconds": round(dt, 3), "steps_per_s": round(steps / dt, 2),
                      "startup_s": round(t0 - START, 2), "end_unix": time.time()}), flush=True)


if __name__ == "__main__":
    main()
