"""Token log-probs without the (batch, tokens, vocab) logits.

The forward runs its LM head at each text's last token only (`logits_to_keep`, for the top-k);
log p(token t | tokens < t) comes from the final hidden states the base model returned, through the
model's own head a chunk of tokens at a time. "Its own head" is the causal LM's forward with the base
model answering the chunk's hidden states: the LM head and whatever that forward does after it
(Gemma's soft-capping, Cohere's logit scale, Granite's scaling...) run as the model wrote them.
At Gemma 3's 262,144-token vocabulary, 32 texts x 1,024 tokens of logits are 17 GB in bf16; a chunk
is LOGPROB_ELEMENTS logits.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn
from transformers.utils import ModelOutput

from actstore.errors import ConfigError
from actstore.models import LoadedModel, host_to_device

LOGPROB_ELEMENTS = 1 << 26  # logits per chunk: bounds the head's memory at 256 MiB of float32
# The head rerun at a batch's last tokens must give the forward's logits up to float rounding (the
# matmul has another shape): a few units in the last place of bf16 (2**-8) at the largest logit.
HEAD_TOLERANCE = 0.02


class TokenLogprobs:
    """While `attached`, keeps the base model's output of each forward; `packed` turns its final
    hidden states into the batch's log-probs. The first batch checks the head rerun against the
    forward's own logits, so a model whose forward the rerun does not follow stops the job instead
    of storing wrong log-probs."""

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        # The base model is the module the causal LM's forward calls for its final hidden states: its
        # child (`model`, `transformer`) or a grandchild (OPT calls `model.decoder`). Found as the
        # shallowest of those that ran and returned a last hidden state.
        self.depth = {module: name.count(".") for name, module in loaded.model.named_modules()
                      if name and name.count(".") <= 1}
        self.outputs: dict[nn.Module, ModelOutput] = {}
        self.vocab = 0  # known after the first batch's check

    @contextmanager
    def attached(self) -> Iterator[TokenLogprobs]:
        def keep(module, args, output):
            if ("forward" not in vars(module)  # the model's forward, not a head rerun
                    and isinstance(output, ModelOutput) and output.get("last_hidden_state") is not None):
                self.outputs[module] = output
        handles = [module.register_forward_hook(keep) for module in self.depth]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def base(self) -> tuple[nn.Module, ModelOutput]:
        if not self.outputs:
            raise ConfigError(f"{type(self.model).__name__}: no module below it returned a last hidden state, so "
                              "token log-probs cannot be computed chunk by chunk; set extract.token_logprobs: false")
        module = min(self.outputs, key=self.depth.__getitem__)
        return module, self.outputs[module]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) final hidden states -> (n, vocab) logits, by the model's own forward."""
        base, output = self.base()
        # The forward's own base output with the chunk as its last hidden state: what else the causal
        # LM's forward reads from it (Gemma 3's image_hidden_states, an MoE's router logits) is there.
        given = type(output)(**{**output, "last_hidden_state": hidden[None]})
        base.forward = lambda *args, **kwargs: given  # the instance attribute shadows the class's
        try:
            ids = torch.zeros((1, hidden.shape[0]), dtype=torch.long, device=hidden.device)
            return self.model(input_ids=ids, use_cache=False).logits[0]
        finally:
            del base.forward

    def packed(self, input_ids: torch.Tensor, keep: np.ndarray, n_tokens: np.ndarray,
               last_logits: torch.Tensor) -> torch.Tensor:
        """(kept tokens,) float32 log p(token t | tokens < t) at the flat positions `keep` of the
        (batch, width) `input_ids` (rows of `n_tokens` tokens), NaN at each text's first token.
        `last_logits`: the forward's logits at each row's last token (checked on the first batch).
        Indices are made on the host and copied through pinned memory: no host wait past the first
        batch's check."""
        final = self.base()[1].last_hidden_state
        hidden = final.reshape(-1, final.shape[-1])
        device = hidden.device
        starts = np.concatenate([[0], np.cumsum(n_tokens)[:-1]]).astype(np.int64)
        if not self.vocab:
            self.check(hidden.index_select(0, host_to_device(torch.from_numpy(keep[starts + n_tokens - 1]), device)),
                       last_logits)
        scored = np.ones(len(keep), dtype=bool)
        scored[starts] = False  # a text's first token has no prediction
        targets = input_ids.reshape(-1).index_select(0, host_to_device(torch.from_numpy(keep[scored]), device))
        sources = host_to_device(torch.from_numpy(keep[scored] - 1), device)
        values = torch.empty(len(sources), dtype=torch.float32, device=device)
        step = max(1, LOGPROB_ELEMENTS // self.vocab)
        for start in range(0, len(sources), step):
            logits = self.head(hidden.index_select(0, sources[start:start + step]))
            # One kernel that reads the logits in their dtype and writes float32, where a float32
            # copy and logsumexp's max, difference, exp and sum each passed over the chunk (CPU,
            # 256 x 262,144 logits: 1.3x faster; within 3e-5 of the float64 value either way).
            log_softmax = torch.log_softmax(logits, 1, dtype=torch.float32)
            values[start:start + step] = log_softmax.gather(1, targets[start:start + step, None])[:, 0]
        out = torch.full((len(keep),), float("nan"), dtype=torch.float32, device=device)
        out[host_to_device(torch.from_numpy(np.flatnonzero(scored)), device)] = values
        self.outputs.clear()
        return out

    def check(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        rerun, logits = self.head(hidden).float(), logits.float()
        if logits.isnan().any():
            raise ConfigError(
                f"{type(self.model).__name__}: its forward's logits at the first batch's last tokens hold NaN, "
                "computed by the model itself (not by the log-probs' head rerun); check model.torch_dtype, or "
                "set extract.token_logprobs: false")
        error = head_difference(rerun, logits)
        # Over the finite logits: a token the model masks with -inf made the scale, and so the
        # tolerance, infinite, which any difference passed.
        scale = max(1.0, float(logits.abs().nan_to_num(posinf=0.0).max()))
        if not error <= HEAD_TOLERANCE * scale:
            raise ConfigError(
                f"{type(self.model).__name__}: its LM head rerun on the final hidden states differs from the "
                f"forward's logits by {error:.3g} (largest logit {scale:.3g}), so token log-probs cannot be "
                "computed chunk by chunk for this model; set extract.token_logprobs: false")
        self.vocab = logits.shape[-1]


def head_difference(rerun: torch.Tensor, logits: torch.Tensor) -> float:
    """The largest |rerun - logits|: 0 where they are equal, the same infinity included (-inf - -inf
    is NaN, which refused a model masking tokens with -inf logits); NaN where the rerun gave NaN."""
    if rerun.shape != logits.shape:
        return float("inf")
    return float(torch.where(rerun == logits, 0.0, (rerun - logits).abs()).max())
