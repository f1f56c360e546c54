"""Triton kernels of the LUT runtime on CUDA: Step B (weighted_rows_triton, picked by
actstore.lut_runtime.weighted_rows) and Step A's ReLU + top-k at decode sizes (topk_relu_triton, picked
by actstore.lut_runtime.topk_relu).

Importing this module imports triton, which is not a dependency of the project (the GPU image has
it): lut_runtime imports it on its first CUDA call and keeps torch's ops when it is missing.

Step B: one program per (row, block of output columns) loads the row's k table rows as one [k, block]
tile, so all of its gathers are in flight at once, and sums them in float32; the output is in the
table's dtype, as embedding_bag writes it. On an NVIDIA H100 80GB HBM3 (2026-11-26; Llama-8B gate +
up, 16384 latents, k 32, bfloat16, CUDA graphs) it took 0.084 ms at 64 tokens and 2.419 at 2048 where
embedding_bag took 0.189 and 5.556 (docs/sae-lut.md).

Step A's ReLU + top-k: torch.topk over a few rows of 16384 latents took 0.066 ms in a CUDA graph on
that H100, longer than the encoder's GEMV, and the ReLU before it is one more kernel. Here two launches
do both (0.015 ms at 1 token, 0.016 at 8; 0.308 at 512, where torch.topk's 0.130 wins): one program
per (row, slice of SLICE latents) applies the ReLU and sorts its slice once; a row's k largest are
among its slices' k largest, which a second program per row sorts again. A value and its index sort
as one int64 key: a non-negative float orders as its bits, then 2**31 - 1 - index, so that the lower
index comes first among equal values.
"""
from __future__ import annotations

from contextlib import nullcontext

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
    weights [n, k] of any float dtype (loaded as float32), indices [n, k], table [rows, cols] on CUDA, of
    16 or 32 bits (lut_runtime.TRITON_DTYPES: float64 tables would be summed to float32 precision)."""
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


SLICE = 1024  # latents one top-k program sorts (16 slices of a 16384-latent SAE: 512 candidates a row)


@triton.jit
def _slice_top_kernel(pre, candidates, width, row_stride, K: tl.constexpr, SLICE: tl.constexpr):
    slices = tl.cdiv(width, SLICE)
    row = (tl.program_id(0) // slices).to(tl.int64)
    piece = tl.program_id(0) % slices
    col = piece * SLICE + tl.arange(0, SLICE)
    inside = col < width
    x = tl.load(pre + row * row_stride + col, mask=inside, other=0.0).to(tl.float32)  # exact from 16 bits
    # ReLU to +0.0 (a -0.0's sign bit would order it below every value; NaN, which torch.topk would
    # put first, becomes 0 too)
    fired = tl.where(x > 0, x, 0.0)
    key = (fired.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)
    key = tl.sort(tl.where(inside, key, -1), descending=True)
    j = tl.arange(0, SLICE)
    tl.store(candidates + (row * slices + piece) * K + j, key, mask=j < K)


@triton.jit
def _row_top_kernel(candidates, values, indices, n_candidates, K: tl.constexpr, N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    key = tl.load(candidates + row * n_candidates + j, mask=j < n_candidates, other=-1)
    key = tl.sort(key, descending=True)
    first = j < K
    value = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(values + row * K + j, value.to(values.dtype.element_ty), mask=first)
    tl.store(indices + row * K + j, 0x7FFFFFFF - (key & 0xFFFFFFFF), mask=first)


def topk_relu_triton(pre: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(relu(pre), k) for pre [rows, width] (rows contiguous): the same values, in pre's
    dtype, descending; indices equal up to ties, the lower index first among equal values (ReLU's
    zeros tie whenever fewer than k latents fire). pre of 16 or 32 bits (lut_runtime.TRITON_DTYPES): the
    keys hold float32 bits, to which float64 values would be rounded."""
    rows, width = pre.shape
    size = max(SLICE, triton.next_power_of_2(k))  # a slice gives k candidates
    slices = triton.cdiv(width, size)
    candidates = torch.empty(rows, slices * k, dtype=torch.int64, device=pre.device)
    values = torch.empty(rows, k, dtype=pre.dtype, device=pre.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=pre.device)
    # The current device, as in weighted_rows_triton; on the CPU, triton's interpreter
    # (TRITON_INTERPRET=1) runs the kernels, which tests them without a GPU (its float32 -> bfloat16
    # casts truncate, so Step B's bfloat16 sums are tested on a GPU only).
    with torch.cuda.device(pre.device) if pre.is_cuda else nullcontext():
        _slice_top_kernel[(rows * slices,)](pre, candidates, width, pre.stride(0), K=k, SLICE=size)
        _row_top_kernel[(rows,)](candidates, values, indices, slices * k, K=k,
                                 N=triton.next_power_of_2(slices * k))
    return values, indices
