"""Padding-sensitive families found by comparing, for text encoders and decoders actstore extracts, each
stored vector of a batch of 8 mixed-length texts with the text run alone. Nystromformer's attention adds
a depthwise convolution (kernel 65) over the values, pads' too: short texts' vectors were 0.85 to 1.3
off (relative). Every other family surveyed stayed under 2e-6 (LED, LongT5 transient-global and local,
T5, UMT5, Switch, T5Gemma's sliding encoder, RoFormer, X-MOD, MRA, ERNIE, Megatron-BERT, DeBERTa v1/v2,
ELECTRA, MPNet, ESM, RemBERT, I-BERT, Splinter, LUKE, MarkupLM, LayoutLM, Marian, M2M-100, Pegasus,
NLLB-MoE, MVP and causal LMs with sliding windows narrower than the batch: Mistral, Mixtral, Qwen2,
Phi-3, Starcoder2, Cohere2, Gemma 2/3, OLMo 3, EXAONE 4)."""
from __future__ import annotations

import pytest

from test_extract import rel_err
from test_models_batch_dependent_families import extracted_at_batch_sizes

# Settings on top of tiny.FAMILY_COMMON. Nystromformer's defaults, as its released checkpoints':
# num_landmarks == segment_means_seq_len (64), so its attention is exact and the convolution the only leak.
FAMILIES = {"nystromformer": {}}
# Batches of one length hold the same tokens as the text alone, yet this model's first forward in a process
# sometimes rounds differently from its later ones on the same input (2.6e-5 relative seen): bytes may
# differ by that, the pads' leak was 0.85 or more.
BATCH_TOL = 1e-4


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_conv_attention_familys_vectors_do_not_depend_on_its_batch(model_type, monkeypatch, text_jsonl, tmp_path):
    """Batches of 1 and of 8 store the same vectors of blocks 0 and 2 for every text. Batches of 8 mixed
    lengths gave the short texts vectors 0.85 to 1.3 off (relative): the padding ran through the convolution."""
    _, parts = extracted_at_batch_sizes(model_type, FAMILIES[model_type], monkeypatch, text_jsonl, tmp_path)
    assert len({row["num_tokens"] for row in parts[8].samples}) >= 10  # batches of 8 would mix lengths
    for local in range(len(parts[8].samples)):
        for i in (0, 2):
            batched, alone = (parts[size].activations(f"layer_{i}", local) for size in (8, 1))
            assert batched.shape == alone.shape and rel_err(batched, alone) <= BATCH_TOL, (model_type, i, local)
