"""Capture hooks: block outputs ("layer i" = output of block i) and named module inputs/outputs."""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from actstore.errors import ConfigError
from actstore.formats.extract import layer_tensor
from actstore.model_config import TOKENS_FIRST_TYPES
from actstore.models import LoadedModel, first_tensor, get_module


def parse_hook(spec: str) -> tuple[str, str]:
    module_path, _, io = spec.rpartition(":")
    if io not in ("input", "output") or not module_path:
        raise ConfigError(f"extract.hooks: {spec!r} must be '<module path>:input' or ':output'")
    return module_path, io


@contextmanager
def capture(loaded: LoadedModel, layers: list[int], hooks: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Register forward hooks for block outputs and module inputs/outputs; yield the capture dict
    (tensor name -> the (batch, tokens, dim) tensor of the last forward, left on the device, a hook's copied; the
    (tokens, batch, dim) tensors of a TOKENS_FIRST_TYPES model's inner modules transposed to it).
    A block or hooked module that runs more than once in one forward of the model (ALBERT's shared
    layer, T5's encoder dropout on the embeddings then on the output) is a ConfigError at the end of
    that forward: each call overwrites the capture, which would store the last call's tensor as its."""
    captured: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}  # tensor name -> its module's calls in the model's forward under way
    handles = []

    def keep(name: str, use_input: bool, tokens_first: bool = False, copy: bool = False):
        def hook(module, args, kwargs, output):
            tensor = first_tensor(called_input(module, args, kwargs, name) if use_input else output)
            tensor = tensor.transpose(0, 1) if tokens_first else tensor
            captured[name] = tensor.clone() if copy else tensor
            calls[name] = calls.get(name, 0) + 1
        return hook

    def check_ran_once(module, args, output):
        if repeated := {name: n for name, n in calls.items() if n > 1}:
            raise ConfigError(ran_more_than_once(repeated, layers, hooks, loaded))

    tokens_first = tokens_first_modules(loaded)
    # Registered inside the try: a hook path refused after the blocks' hooks were on the model left
    # them there, each holding its last forward's tensor.
    try:
        for layer_idx in layers:
            block = loaded.blocks[layer_idx]
            handles.append(block.register_forward_hook(
                keep(layer_tensor(layer_idx), False, block in tokens_first), with_kwargs=True))
        for spec in hooks:
            module_path, io = parse_hook(spec)
            module = get_module(loaded.model, module_path)
            # A hooked tensor is copied: the model may change it in place after the module ran (Falcon's
            # `mlp_output += attention_output`, Llama 4's shared expert), which the stored one showed. A
            # block's output is the residual stream the next block reads, changed in place by none tested.
            handles.append(module.register_forward_hook(
                keep(spec, io == "input", module in tokens_first, copy=True), with_kwargs=True))
        # Counted per forward of the model itself, so the token log-probs' head rerun (a forward of its
        # own, after the batch is packed) starts from zero.
        handles.append(loaded.model.register_forward_pre_hook(lambda module, args: calls.clear()))
        handles.append(loaded.model.register_forward_hook(check_ran_once))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def tokens_first_modules(loaded: LoadedModel) -> set[nn.Module]:
    """The modules whose inputs and outputs are (tokens, batch, ...): in a TOKENS_FIRST_TYPES model,
    every module below the one holding the blocks (XLNet's embedding, blocks and their attention and
    feed-forward parts), which transposes its input to that and its output back (so it, and the LM
    head after it, are (batch, tokens, ...)). A hook inside a block was stored tokens-first, laid
    over the wrong samples and tokens where a batch held as many samples as tokens."""
    if loaded.config.get("model_type") not in TOKENS_FIRST_TYPES:
        return set()
    holder = loaded.model.get_submodule(loaded.blocks_path.rpartition(".")[0])
    return set(holder.modules()) - {holder}


def called_input(module: nn.Module, args: tuple, kwargs: dict[str, Any], spec: str) -> Any:
    """What `module` was called with as its input: the argument of its forward's first parameter (after
    self; the class's forward, as the log-probs' head rerun gives the base model a forward of its own).
    Not the first tensor among keyword arguments: a vision-language model calls its language model
    with attention_mask= (LLaVA, Qwen2.5-VL) or position_ids= (PaliGemma) before inputs_embeds=."""
    if args:
        return args[0]
    first = list(inspect.signature(type(module).forward).parameters)[1]
    value = kwargs.get(first)
    if value is None and first == "input_ids":  # HF's models take inputs_embeds in its place
        value = kwargs.get("inputs_embeds")
    if value is None:
        raise ConfigError(f"extract.hooks {spec!r}: {type(module).__name__} was called without its input "
                          f"{first!r} (given {sorted(kwargs)}), so there is no input to capture")
    return value


def described(layers: list[int], hooks: list[str], loaded: LoadedModel) -> dict[str, str]:
    """Each captured tensor's name -> the config entry that asked for it, as errors name it."""
    rules = {layer_tensor(i): f"extract.layers {i} (block {i} of {type(loaded.model).__name__}.{loaded.blocks_path})"
             for i in layers}
    return rules | {spec: f"extract.hooks {spec!r}" for spec in hooks}


def ran_more_than_once(repeated: dict[str, int], layers: list[int], hooks: list[str], loaded: LoadedModel) -> str:
    what = described(layers, hooks, loaded)
    runs = "; ".join(f"{what[name]}: its module ran {n} times in one forward" for name, n in repeated.items())
    return (f"{runs}. A capture holds one call's tensor per forward, and which call is meant is not known: "
            "hook a module that runs once (a shared module's caller, or the module just after it)")


def check_reached(captured: dict[str, torch.Tensor], layers: list[int], hooks: list[str], loaded: LoadedModel) -> None:
    """Every block and hooked module ran in the forward (a block of a tower the input never reaches
    would leave nothing to store)."""
    missing = [name for name in [*map(layer_tensor, layers), *hooks] if name not in captured]
    if missing:
        raise ConfigError(f"{type(loaded.model).__name__}: the forward never ran {missing} "
                          f"(blocks found at {loaded.blocks_path}); check extract.layers and extract.hooks")


def check_shapes(captured: dict[str, torch.Tensor], layers: list[int], hooks: list[str], loaded: LoadedModel,
                 n_samples: int, width: int) -> None:
    """Every captured tensor is (batch, tokens, hidden) for this batch of `n_samples` padded to `width`
    tokens: packing takes dim 1 as the token axis, so any other shape (a pooler's (batch, hidden),
    attention weights' 4 dims) would be stored as values laid over the wrong tokens. Checked on the
    host (shapes need no device sync), before any of the batch is packed or written."""
    for name, what in described(layers, hooks, loaded).items():
        shape = tuple(captured[name].shape)
        if len(shape) != 3 or shape[:2] != (n_samples, width):
            rule = ("extract.hooks entries must name a module whose input/output is" if name in hooks
                    else "extract.layers must name blocks whose output is")
            raise ConfigError(f"{what} produced shape {shape}, expected ({n_samples}, {width}, hidden) for a batch "
                              f"of {n_samples} samples of {width} tokens: {rule} (batch, tokens, hidden)")
