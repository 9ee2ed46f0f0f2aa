"""The autotuning space of the LayerNorm kernels (kernels/layernorm.py): which (ROWS, num_warps) tiles the
pruner keeps for a row width, forward and backward. CUDA only; the interpreter gets one config (>1 fails
there). Pure host-side integer math on ``triton.Config`` objects: nothing here queries a GPU.

A program normalises a ROWS x BLOCK_N tile. Small widths need several rows per program to keep enough
bytes in flight; wide rows need more warps. For each width the pruner keeps at most four tiles: two tile
sizes x two loads per thread, so a first call on a new key times <= 4 configs. The backward holds ~3x more
live values per element than the forward: smaller tiles, fewer elements per thread. Every kept tile gives
each thread >= 8 contiguous elements (16-byte bf16 loads).
"""

from __future__ import annotations

import torch
import triton

from kernels._utils import autotune

FWD_TILES = dict(tiles=(4096, 8192), per_thread=(16, 32))  # forward: ~elements per tile, per thread
BWD_TILES = dict(tiles=(2048, 4096), per_thread=(8, 16))  # backward: ~3x the live values per element
MAX_ROWS, MAX_WARPS = 256, 16


def block_n(N: int) -> int:
    """BLOCK_N of width N: the next power of two >= N (plain int math: cheap on the hot path)."""
    return 1 << (N - 1).bit_length()


def tile_grid() -> list[triton.Config]:
    """Every (ROWS, num_warps) pair the pruner may pick from."""
    return [triton.Config({"ROWS": 1 << r}, num_warps=1 << w) for r in range(9) for w in range(5)]


def width_tiles(N: int, tiles: tuple[int, ...], per_thread: tuple[int, ...]) -> list[tuple[int, int]]:
    """(ROWS, num_warps) for width N: tiles of ~``tiles`` elements, ~``per_thread`` elements per thread."""
    width = block_n(N)
    kept = []
    for tile in tiles:
        rows = min(max(tile // width, 1), MAX_ROWS)
        for elems in per_thread:
            warps = min(max(rows * width // (32 * elems), 1), MAX_WARPS)
            if (rows, warps) not in kept:
                kept.append((rows, warps))
    return kept


def tile_pruner(tiles: tuple[int, ...], per_thread: tuple[int, ...]):
    """The Autotuner's ``prune_configs_by`` hook: keeps `width_tiles` of the launch's N."""
    def prune(configs, named_args, **kwargs):
        wanted = width_tiles(named_args["N"], tiles, per_thread)
        return [c for c in configs if (c.kwargs["ROWS"], c.num_warps) in wanted]
    return prune


def layer_norm_autotune(interpret_rows: int, key: list[str], limits: dict):
    """The autotune decorator of one LayerNorm kernel: `tile_grid` pruned by ``limits`` (`FWD_TILES` or
    `BWD_TILES`); ``interpret_rows`` rows per program under the interpreter."""
    return autotune(tile_grid(), key, interpret_config=triton.Config({"ROWS": interpret_rows}, num_warps=4),
                    prune=tile_pruner(**limits))


GPU_WIDTHS = (1, 7, 64, 512, 1000, 1024, 4095, 8192)  # off and on the block sizes, a 1-wide and an 8192-wide row


def gpu_shapes(activations: tuple) -> dict:
    """The launches the LayerNorm op declares (``LAYER_NORM_OP.shapes``; its GPU tests and ``bench.aot`` read them):
    "full", every (dtype, width, residual, bias, activation); "fast", every dtype x width once with the flags rotating
    (each width meets residual/bias/activation variants; every combination compiles its own kernel: the full
    product is slow); "mixed_residual", (rows, width, x dtype, residual dtype)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return {"full": [(dt, N, res, bias, act) for dt in dtypes for N in GPU_WIDTHS for res in (True, False)
                     for bias in (True, False) for act in activations],
            "fast": [(dt, N, i % 2 == 0, i % 4 != 3, activations[i % 3])
                     for i, (dt, N) in enumerate((dt, N) for N in GPU_WIDTHS for dt in dtypes)],
            "mixed_residual": [(37, 200, torch.bfloat16, torch.float32), (37, 200, torch.float16, torch.float32),
                               (37, 200, torch.float32, torch.bfloat16)]}
