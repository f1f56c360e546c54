"""Candidate CUDA kernels for the LUT runtime's decode-sized calls, timed by bench_lut.py against what
the runtime runs (actstore.lut_runtime) before any of them is moved into it.

- `weighted_rows_triton`: Step B, sum_j values[n, j] * table[indices[n, j]], as one Triton program per
  (row, block of output columns) that loads its k table rows as one [k, block] tile, so all of a
  row's gathers are in flight at once; float32 accumulation, output in the table's dtype, as
  `lut_runtime.weighted_rows` (embedding_bag) computes it. At 64 tokens embedding_bag read 117 MB of
  table rows at 0.65 TB/s, 14 % of an H200's bandwidth (bench/README.md `## lut`).
- `topk_two_stage`: Step A's TopK over the latents as the top k of each of many slices, then
  the top k of those candidates: the same values as one torch.topk (each of the k largest is among
  its own slice's k largest), indices the same up to ties. At one token a single 16,384-wide
  torch.topk row may run on one block of the card.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: bench_lut's CUDA rows are the only users
    triton = None


if triton is not None:
    @triton.jit
    def _weighted_rows_kernel(values, indices, table, out, n_cols, k, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, K)
        in_k = j < k
        idx = tl.load(indices + row * k + j, mask=in_k, other=0)
        weight = tl.load(values + row * k + j, mask=in_k, other=0.0).to(tl.float32)
        in_cols = cols < n_cols
        tile = tl.load(table + idx[:, None] * n_cols + cols[None, :], mask=in_k[:, None] & in_cols[None, :],
                       other=0.0)
        total = tl.sum(tile.to(tl.float32) * weight[:, None], axis=0)
        tl.store(out + row * n_cols + cols, total.to(out.dtype.element_ty), mask=in_cols)


def weighted_rows_triton(weights: torch.Tensor, indices: torch.Tensor, table: torch.Tensor,
                         block: int = 128) -> torch.Tensor:
    """[n, table.shape[1]] in table's dtype: lut_runtime.weighted_rows by one Triton kernel."""
    rows, k = indices.shape
    n_cols = table.shape[1]
    out = torch.empty(rows, n_cols, dtype=table.dtype, device=table.device)
    grid = (triton.cdiv(n_cols, block), rows)
    _weighted_rows_kernel[grid](weights.contiguous(), indices.contiguous(), table, out, n_cols, k,
                                K=triton.next_power_of_2(k), BLOCK=block)
    return out


def topk_two_stage(pre: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row of pre [rows, width], sorted descending, from
    the k largest of each of the most equal slices of at least 4k latents (128 slices of 128 for
    16,384 latents and k 32)."""
    rows, width = pre.shape
    groups = max(1, width // (4 * k))
    while width % groups:
        groups -= 1
    size = width // groups
    values, local = pre.view(rows, groups, size).topk(k, dim=-1)
    local = local + torch.arange(0, width, size, device=pre.device).view(1, groups, 1)
    top, pick = values.reshape(rows, -1).topk(k, dim=-1)
    return top, local.reshape(rows, -1).gather(1, pick)
