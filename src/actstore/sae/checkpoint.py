"""SAE checkpoints: actstore's own (save_sae / load_sae) and SAELens- or saev-style imports folded
into the LUT spec's form (encoder_bias = b_enc - b_dec @ W_enc when b_dec is subtracted first)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actstore.errors import ConfigError, FormatError
from actstore.io_utils import atomic_path
from actstore.safetensors_io import save_safetensors
from actstore.sae.model import SAE_KEYS, TopKSAE

SAE_FILE = "sae.safetensors"
REPORT_FILE = "report.json"
IMPORT_STYLES = ("saelens", "saev")


def import_sae(path: str | Path, style: str, k_active: int) -> TopKSAE:
    """Load a SAELens- or saev-style safetensors checkpoint (W_enc [d_in, d_sae], W_dec [d_sae, d_in],
    b_enc [d_sae], b_dec [d_in]) and fold `x - b_dec` into the encoder bias.

    SAELens: b_dec is subtracted before encoding unless cfg.json beside the file says
    apply_b_dec_to_input: false. saev: always subtracted.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if style not in IMPORT_STYLES:
        raise ConfigError(f"sae.import.style {style!r}: expected one of {IMPORT_STYLES}")
    if not path.is_file():
        raise ConfigError(f"sae.import.path {path}: no such file")
    raw = load_file(str(path))
    missing = [key for key in ("W_enc", "b_enc", "W_dec", "b_dec") if key not in raw]
    if missing:
        raise FormatError(f"{path}: {style} checkpoint lacks {missing}; has {sorted(raw)}")
    w_enc, b_enc, w_dec, b_dec = (raw[key].float() for key in ("W_enc", "b_enc", "W_dec", "b_dec"))
    d_in, d_sae = w_enc.shape
    expect = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    for key, shape in expect.items():
        if tuple(raw[key].shape) != shape:
            raise FormatError(f"{path}: {key} has shape {list(raw[key].shape)}, expected {list(shape)}")
    subtract = True
    cfg_path = path.with_name("cfg.json")
    if style == "saelens" and cfg_path.is_file():
        subtract = bool(json.loads(cfg_path.read_text()).get("apply_b_dec_to_input", True))
    bias = b_enc - b_dec @ w_enc if subtract else b_enc
    return TopKSAE.from_state({"encoder_weight": w_enc.T, "encoder_bias": bias,
                               "decoder_weight": w_dec, "decoder_bias": b_dec}, k_active)


def save_sae(sae: TopKSAE, path: str | Path, meta: dict[str, Any]) -> None:
    """float32 safetensors with the LUT key names; meta (hook, k_active, ...) in the header."""
    header = {key: str(value) for key, value in {**meta, "k_active": sae.k_active,
                                                 "num_basis": sae.num_basis, "d_in": sae.d_in}.items()}
    with atomic_path(path) as tmp:
        save_safetensors(sae.state(), tmp, header)


def load_sae(path: str | Path) -> tuple[TopKSAE, dict[str, str]]:
    """Read an actstore SAE checkpoint written by save_sae."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: SAE checkpoint missing")
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        missing = [key for key in SAE_KEYS if key not in fh.keys()]
        if missing or "k_active" not in meta:
            raise FormatError(f"{path}: not an actstore SAE checkpoint (missing {missing or ['k_active']})")
        state = {key: fh.get_tensor(key) for key in SAE_KEYS}
    return TopKSAE.from_state(state, int(meta["k_active"])), meta
