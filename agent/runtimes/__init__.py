"""Runtime plug-ins (CUDA, NCCL, gloo, Level Zero): one module per runtime, one registry line each."""

from __future__ import annotations

from aiflame.agent.runtimes.base import Runtime


def all_runtimes() -> list[Runtime]:
    """A fresh instance of every runtime plug-in (they keep per-capture state)."""
    from aiflame.agent.runtimes.cuda import CudaRuntime
    from aiflame.agent.runtimes.gloo import GlooRuntime
    from aiflame.agent.runtimes.level_zero import LevelZeroRuntime
    from aiflame.agent.runtimes.nccl import NcclRuntime

    return [CudaRuntime(), GlooRuntime(), NcclRuntime(), LevelZeroRuntime()]
