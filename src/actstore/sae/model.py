"""The TopK SAE module in the LUT spec's layout, its Gao et al. initialisation and the AuxK loss.

The encoder is exactly the LUT spec's Step A — ReLU(x @ encoder_weight.T + encoder_bias), then TopK —
so the LUT built from this SAE reproduces the trained encoder.
"""
from __future__ import annotations

import torch
from torch import nn

from actstore.errors import ConfigError
from actstore.lut_runtime import embedding_bag_rows

# The LUT spec's key names; an actstore SAE checkpoint stores these four in float32.
SAE_KEYS = ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias")
# A variance at most this fraction of the mean square norm is none: the rounding of equal rows.
ZERO_VARIANCE = 1e-12


class TopKSAE(nn.Module):
    """x -> TopK(ReLU(x W_enc^T + b_enc)) -> z W_dec + b_dec, weights in the LUT spec's layout."""

    def __init__(self, d_in: int, num_basis: int, k_active: int):
        super().__init__()
        if not 0 < k_active <= num_basis:
            raise ConfigError(f"sae.k_active {k_active} must be in 1..num_basis ({num_basis})")
        self.k_active = k_active
        self.encoder_weight = nn.Parameter(torch.empty(num_basis, d_in))
        self.encoder_bias = nn.Parameter(torch.zeros(num_basis))
        self.decoder_weight = nn.Parameter(torch.empty(num_basis, d_in))
        self.decoder_bias = nn.Parameter(torch.zeros(d_in))

    @property
    def num_basis(self) -> int:
        return self.encoder_weight.shape[0]

    @property
    def d_in(self) -> int:
        return self.encoder_weight.shape[1]

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """ReLU(x @ encoder_weight.T + encoder_bias): the spec's sparse_act before TopK."""
        return torch.relu(x @ self.encoder_weight.T + self.encoder_bias)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices) of the k_active largest post-ReLU activations (spec Step A)."""
        return torch.topk(self.pre_acts(x), self.k_active, dim=-1)

    def decode(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_j values_j * decoder_weight[indices_j] + decoder_bias: the LUT runtime's fused row sum on
        the CPU, here on every device (the runtime's Triton kernel on CUDA has no backward)."""
        return embedding_bag_rows(values, indices, self.decoder_weight) + self.decoder_bias

    def decode_dense(self, values: torch.Tensor, indices: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """Same as decode via a scattered dense code: faster on CPU for training and its backward."""
        code = torch.zeros(values.shape[0], self.num_basis, dtype=values.dtype, device=values.device)
        out = code.scatter(1, indices, values) @ self.decoder_weight
        return out + self.decoder_bias if bias else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(*self.encode(x))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.decoder_weight /= self.decoder_weight.norm(dim=1, keepdim=True).clamp_min(1e-8)

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Keep decoder rows on the unit sphere: drop each row gradient's radial component."""
        w, g = self.decoder_weight, self.decoder_weight.grad
        if g is not None:
            g -= (g * w).sum(dim=1, keepdim=True) * w

    def state(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key).detach().float().cpu().contiguous() for key in SAE_KEYS}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], k_active: int) -> "TopKSAE":
        """The SAE whose parameters are `state`'s tensors themselves (as float32, contiguous: a copy only
        of those that are not), whose shapes the caller checked: copying each into a new parameter held
        the checkpoint twice, an import's memory peak."""
        with torch.device("meta"):  # the constructor's parameters are replaced: allocate none
            sae = cls(state["encoder_weight"].shape[1], state["encoder_weight"].shape[0], k_active)
        for key in SAE_KEYS:
            setattr(sae, key, nn.Parameter(state[key].float().contiguous()))
        return sae


def init_sae(sae: TopKSAE, mean: torch.Tensor, seed: int) -> None:
    """Unit-norm random decoder rows, encoder = decoder (tied init), b_dec = data mean and
    encoder_bias = -encoder_weight @ mean so the first encodings see centred data."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sae.decoder_weight.copy_(torch.randn(sae.num_basis, sae.d_in, generator=gen))
        sae.normalize_decoder()
        sae.encoder_weight.copy_(sae.decoder_weight)
        sae.decoder_bias.copy_(mean)
        sae.encoder_bias.copy_(-(sae.encoder_weight @ mean))


def auxk_loss(sae: TopKSAE, x: torch.Tensor, x_hat: torch.Tensor, pre: torch.Tensor,
              dead: torch.Tensor, aux_k: int) -> torch.Tensor:
    """Gao et al.'s AuxK: the top-aux_k dead latents reconstruct the residual, scaled by its variance.
    Never reads a value back to the host: live latents are masked to 0, so with fewer than aux_k dead
    latents the extra picks add 0, and with none the loss is multiplied by 0."""
    masked = pre.masked_fill(~dead, 0.0)
    values, indices = torch.topk(masked, min(aux_k, sae.num_basis), dim=-1)
    residual = (x - x_hat).detach()
    recon = sae.decode_dense(values, indices, bias=False)
    loss = normalised((recon - residual).pow(2).sum(-1).mean(), residual.var(0).sum(), residual)
    return loss * dead.any()


def normalised(error: torch.Tensor, variance: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """error / variance (of `x`, rows of d), the variance floored at ZERO_VARIANCE of x's mean square
    norm (at least float32's least normal number, not 0: an exact reconstruction's 0 / 0): a floor
    relative to the data, as a fixed 1e-8 made the loss of activations of standard deviation 1e-5
    (width 8) their error over 1e-8, not their FVU. Above the floor it is error / variance exactly."""
    floor = (ZERO_VARIANCE * x.pow(2).sum(-1).mean()).clamp_min(torch.finfo(torch.float32).tiny)
    return error / variance.clamp_min(floor)
