"""Triton kernel of the LUT runtime's Step B on CUDA (actstore.lut_runtime.weighted_rows picks it).

Importing this module imports triton, which is not a dependency of the project (the GPU image has
it): lut_runtime imports it on its first CUDA call and keeps embedding_bag when it is missing.

One program per (row, block of output columns) loads the row's k table rows as one [k, block] tile,
so all of its gathers are in flight at once, and sums them in float32; the output is in the table's
dtype, as embedding_bag writes it. On an NVIDIA H100 80GB HBM3 (2026-11-26; Llama-8B gate + up, 16384
latents, k 32, bfloat16, CUDA graphs) it took 0.084 ms at 64 tokens and 2.419 at 2048 where
embedding_bag took 0.189 and 5.556 (docs/sae-lut.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # output columns per program: the block of the H100 numbers (bench_lut timed 64, 128 and 256)
# Table rows summed per step of a program: a whole tile at the SAE's k (32), while a compensation
# budget (up to the input width) is summed in steps, not held in registers as one [budget, BLOCK] tile.
K_STEP = 32


@triton.jit
def _weighted_rows_kernel(values, indices, table, out, k, n_cols, row_stride, col_stride,
                          K: tl.constexpr, BLOCK: tl.constexpr):
    # One grid axis, column blocks of a row adjacent (the order measured): a second axis holds at most
    # 65535 rows. int64 offsets: rows x columns passes 2**31 at ~75k tokens of 28672 columns.
    blocks = tl.cdiv(n_cols, BLOCK)
    row = (tl.program_id(0) // blocks).to(tl.int64)
    cols = (tl.program_id(0) % blocks) * BLOCK + tl.arange(0, BLOCK)
    in_cols = cols < n_cols
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, K):
        j = start + tl.arange(0, K)
        in_k = j < k
        idx = tl.load(indices + row * k + j, mask=in_k, other=0).to(tl.int64)
        weight = tl.load(values + row * k + j, mask=in_k, other=0.0).to(tl.float32)
        tile = tl.load(table + idx[:, None] * row_stride + cols[None, :] * col_stride,
                       mask=in_k[:, None] & in_cols[None, :], other=0.0)
        total += tl.sum(tile.to(tl.float32) * weight[:, None], axis=0)
    tl.store(out + row * n_cols + cols, total.to(out.dtype.element_ty), mask=in_cols)


def weighted_rows_triton(weights: torch.Tensor, indices: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * table[indices[n, j]] -> [n, table.shape[1]] in table's dtype, float32 sums;
    weights [n, k] of any float dtype (loaded as float32), indices [n, k], table [rows, cols] on CUDA."""
    rows, k = indices.shape
    n_cols = table.shape[1]
    out = torch.empty(rows, n_cols, dtype=table.dtype, device=table.device)
    if out.numel():  # a grid with no programs is not launched
        grid = (triton.cdiv(n_cols, BLOCK) * rows,)
        # Triton launches on the current device, which need not be the table's (a model on cuda:1).
        with torch.cuda.device(table.device):
            _weighted_rows_kernel[grid](weights.contiguous(), indices.contiguous(), table, out, k, n_cols,
                                        table.stride(0), table.stride(1),
                                        K=min(K_STEP, triton.next_power_of_2(k)), BLOCK=BLOCK)
    return out
