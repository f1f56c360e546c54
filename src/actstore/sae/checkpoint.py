"""SAE checkpoints: actstore's own (save_sae / load_sae), the same SAE as SAELens loads it
(save_saelens), and SAELens- or saev-style imports folded into the LUT spec's form
(encoder_bias = b_enc - b_dec @ W_enc when b_dec is subtracted first)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actstore.config import SAELENS_CFG, SAELENS_WEIGHTS, import_files
from actstore.errors import ConfigError, FormatError
from actstore.integrity import read_json, whole_number, whole_numbers
from actstore.io_utils import atomic_path, write_json_atomic
from actstore.safetensors_io import read_header_json, save_safetensors
from actstore.sae.model import SAE_KEYS, TopKSAE

SAE_FILE = "sae.safetensors"
REPORT_FILE = "report.json"
IMPORT_STYLES = ("saelens", "saev")
SAELENS_DIR = "saelens"  # beside sae.safetensors: the folder SAELens' SAE.load_from_disk reads
# The cfg.json layout written: SAELens reads a config without this version as a pre-6.0 one.
SAELENS_LAYOUT = "6.0.0"
SAELENS_DEFAULT_K = 100  # TopKSAEConfig.k when a 6.x cfg.json names none
SAEV_HEADER_LIMIT = 1 << 20  # bytes of a saev checkpoint's JSON header line read at most
# Each tensor's dimensions by name: a name's size is taken from the first tensor that has it, so every
# later tensor's shape is checked against the earlier ones (a swapped or cut decoder is named, not a
# broadcasting error when it is copied in).
SAE_DIMS = {"encoder_weight": ("num_basis", "d_in"), "encoder_bias": ("num_basis",),
            "decoder_weight": ("num_basis", "d_in"), "decoder_bias": ("d_in",)}
ACTSTORE_HOOK = re.compile(r"[A-Za-z0-9_.]+:(input|output)")  # a captured tensor's name (config schema: sae.hook)
IMPORT_DIMS = {"W_enc": ("d_in", "d_sae"), "b_enc": ("d_sae",), "W_dec": ("d_sae", "d_in"), "b_dec": ("d_in",)}


@dataclass(frozen=True)
class ImportHeader:
    """What import_sae reads of sae.import before its weights (read_import_header)."""
    path: Path  # the checkpoint file
    native: bool  # saev's own file (is_saev_checkpoint): torch.save's bytes after a JSON header line
    saev_header: dict[str, Any]  # that header line; {} for a safetensors file
    weights_at: int  # where a native file's weights start, after its header line
    subtract: bool  # b_dec is subtracted before encoding: folded into the encoder bias
    rescale: bool  # SAELens' rescale_acts_by_decoder_norm: folded in (fold_decoder_norms)


def read_import_header(path: str | Path, style: str, k_active: int, hook_width: int | None = None,
                       hook: str | None = None) -> ImportHeader:
    """Every check import_sae makes before it reads the weights, from the headers alone (a safetensors
    header, saev's JSON line, cfg.json): the style and file; a saev header's activation, top_k and width;
    a safetensors header's tensor names and shapes, d_in against `hook_width`, d_sae against k_active, and a
    SAELens cfg.json (check_saelens_hook, saelens_encoding). The dataset scan job runs it with the hook's
    width from the model's skeleton (extract.run.check_sae_import): an import the sae stage refuses was
    named by the import_sae job, after every extraction part had run."""
    path = Path(path)
    if style not in IMPORT_STYLES:
        raise ConfigError(f"sae.import.style {style!r}: expected one of {IMPORT_STYLES}")
    path, *saelens_cfg = import_files(path, style)
    if not path.is_file():
        raise ConfigError(f"sae.import.path {path}: no such file")
    if style == "saev" and is_saev_checkpoint(path):
        header, weights_at = read_saev_header(path, k_active, hook_width)
        return ImportHeader(path, True, header, weights_at, subtract=False, rescale=False)
    shapes = safetensors_shapes(path)
    check_import_keys(path, style, shapes)
    sizes = checked_sizes(path, shapes, IMPORT_DIMS)
    check_hook_width(path, sizes["d_in"], hook_width, "its safetensors header's W_enc shape")
    if saelens_cfg and hook is not None:
        check_saelens_hook(saelens_cfg[0], hook)
    check_latents(path, sizes["d_sae"], k_active)
    subtract, rescale = saelens_encoding(saelens_cfg[0], k_active, sizes) if saelens_cfg else (True, False)
    return ImportHeader(path, False, {}, 0, subtract, rescale)


def import_sae(path: str | Path, style: str, k_active: int, hook_width: int | None = None,
               hook: str | None = None) -> TopKSAE:
    """Load a SAELens- or saev-style checkpoint (W_enc [d_in, d_sae], W_dec [d_sae, d_in], b_enc
    [d_sae], b_dec [d_in]) and fold `x - b_dec` into the encoder bias where it is subtracted first.
    `hook_width`: the width of the hook it will encode, which d_in must be (check_hook_width); `hook`:
    that hook, which a cfg.json naming one of actstore's hooks must name (check_saelens_hook). Its
    headers are checked first (read_import_header), then the weights.

    SAELens (safetensors, or the folder holding sae_weights.safetensors): b_dec is subtracted before
    encoding unless cfg.json beside the file says apply_b_dec_to_input: false; a cfg.json must describe
    an SAE that encodes as TopKSAE does (saelens_encoding). saev: saev's own checkpoint file
    (read_saev_header) encodes x as saev's code does, without subtracting b_dec; a safetensors file
    with saev's names, as saev encoded before August 2025: b_dec subtracted.
    """
    found = read_import_header(path, style, k_active, hook_width, hook)
    path = found.path
    raw = read_saev_weights(path, found.weights_at) if found.native else read_safetensors(path)[1]
    # A safetensors file's names and shapes were its header's; a saev file's are known from here on.
    check_import_keys(path, style, raw)
    w_enc, b_enc, w_dec, b_dec = checked_tensors(path, raw, IMPORT_DIMS).values()
    d_in, d_sae = w_enc.shape
    check_hook_width(path, d_in, hook_width, "W_enc's shape")  # a header without the width: the weights'
    check_latents(path, d_sae, k_active)
    check_saev_sizes(path, found.saev_header, d_in, d_sae)
    if found.rescale:
        w_enc, b_enc, w_dec = fold_decoder_norms(path, w_enc, b_enc, w_dec)
    bias = b_enc - b_dec @ w_enc if found.subtract else b_enc
    check_folded(path, {"encoder_bias": bias}, "b_dec (b_enc - b_dec @ W_enc)")
    return TopKSAE.from_state({"encoder_weight": w_enc.T, "encoder_bias": bias,
                               "decoder_weight": w_dec, "decoder_bias": b_dec}, k_active)


def check_import_keys(path: Path, style: str, keys: dict[Any, Any]) -> None:
    """FormatError naming the file and the tensors it lacks of the four an import reads."""
    missing = [key for key in IMPORT_DIMS if key not in keys]
    if missing:  # str: a saev state dict's keys need not be strings, nor sortable together
        raise FormatError(f"{path}: {style} checkpoint lacks {missing}; has {sorted(map(str, keys))}")


def check_latents(path: Path, d_sae: int, k_active: int) -> None:
    """ConfigError naming the file when its SAE has fewer latents than sae.k_active keeps per token."""
    if k_active > d_sae:
        raise ConfigError(f"{path}: d_sae {d_sae}, fewer latents than sae.k_active {k_active}")


def check_hook_width(path: Path, d_in: Any, hook_width: int | None, source: str) -> None:
    """ConfigError naming the file and `source` (where d_in was read) when its SAE's d_in is not the
    hook's width. Checked from the file's header where it gives d_in, before its weights are read: a
    checkpoint of another model's width was loaded whole (gigabytes, from a cluster's shared file
    system) before it was refused. A `d_in` that is not a whole number is the later checks' to name."""
    if hook_width is not None and whole_number(d_in) and d_in != hook_width:
        raise ConfigError(f"sae.import.path {path}: d_in {d_in} ({source}), but the hook's width is {hook_width}: "
                          "an SAE of another model or hook")


def check_saelens_hook(cfg_path: Path, hook: str) -> None:
    """ConfigError naming the cfg.json and both hooks when its hook_name (metadata.hook_name from 6.0,
    hook_name before) is one of actstore's tensor names (module:input or module:output, as the sae
    stage's saelens/ folder records it) other than `hook`: an SAE of another layer of the same width
    imported silently, and its LUT evaluated the encoding of tensors it never saw. A TransformerLens
    hook name (blocks.0.hook_resid_pre) names no module of the model, and is not compared."""
    cfg = read_json(cfg_path)
    if not isinstance(cfg, dict):  # saelens_encoding names it
        return
    named = cfg_object(cfg_path, cfg, "metadata").get("hook_name", cfg.get("hook_name"))
    if isinstance(named, str) and ACTSTORE_HOOK.fullmatch(named) and named != hook:
        raise ConfigError(f"sae.import.path {cfg_path}: hook_name {named!r}, but sae.hook is {hook!r}: an SAE "
                          f"trained on another tensor; set sae.hook to {named!r} (capturing it in extract.hooks)")


def safetensors_shapes(path: Path) -> dict[str, Any]:
    """Each tensor's shape as the safetensors header of `path` gives it, read from the header alone: not
    the weights, which may be gigabytes on a cluster's shared file system (nor whether they are all there:
    read_safetensors' to name). FormatError naming the file for a header that is not one, or an entry
    without a shape of whole numbers."""
    with path.open("rb") as fh:
        try:
            header, _ = read_header_json(fh, path.stat().st_size)
        except ValueError as exc:
            raise FormatError(f"{path}: unreadable safetensors ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: unreadable safetensors (its header is a JSON {type(header).__name__})")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shapes[name] = entry.get("shape") if isinstance(entry, dict) else None
        if not whole_numbers(shapes[name]):
            raise FormatError(f"{path}: unreadable safetensors (tensor {name!r:.100} has no shape of whole numbers)")
    return shapes


def fold_decoder_norms(path: Path, w_enc: torch.Tensor, b_enc: torch.Tensor,
                       w_dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_enc, b_enc, W_dec) with SAELens' rescale_acts_by_decoder_norm folded in, as SAELens folds it:
    TopK of (x W_enc + b_enc) * |W_dec row|, decoded by W_dec / |W_dec row|. FormatError naming `path`
    and the row for a W_dec row of norm 0 (a pruned latent), which SAELens divides by: the fold made
    NaN weights, imported and written, that load_sae refused only at the lut stage."""
    norms = w_dec.norm(dim=1)
    zero = torch.nonzero(norms == 0).flatten().tolist()
    if zero:
        raise FormatError(f"{path}: W_dec row {zero[0]} has norm 0 ({len(zero)} such rows), which "
                          "rescale_acts_by_decoder_norm (cfg.json) divides by")
    folded = {"W_enc": w_enc * norms, "b_enc": b_enc * norms, "W_dec": w_dec / norms[:, None]}
    check_folded(path, folded, "rescale_acts_by_decoder_norm (cfg.json)")
    return folded["W_enc"], folded["b_enc"], folded["W_dec"]


def check_folded(path: Path, folded: dict[str, torch.Tensor], fold: str) -> None:
    """FormatError naming `path`, the tensor and the fold for a folded tensor that is not finite: finite
    weights whose fold overflows float32 were imported as infinite ones (a NaN held-out FVU), written,
    and refused by load_sae only at the lut stage, naming the stage's output, not the import."""
    for key, value in folded.items():
        # Its least and largest values, NaN if any is: as checked_tensors, without isfinite's masks.
        if value.numel() and not torch.stack(value.aminmax()).isfinite().all():
            raise FormatError(f"{path}: {key} overflows float32 with {fold} folded in: weights too large "
                              "for the LUT spec's float32 encoder")


def is_saev_checkpoint(path: Path) -> bool:
    """saev's own file (saev.nn.dump): a JSON header line, then torch.save's bytes. Not a safetensors
    file, which starts with its header's length (8 bytes, little-endian; its first byte can be "{" too)
    and then the header, "{"."""
    with path.open("rb") as fh:
        head = fh.read(9)
    header_length = int.from_bytes(head[:8], "little")
    safetensors = len(head) == 9 and head[8:] == b"{" and 8 + header_length <= path.stat().st_size
    return head[:1] == b"{" and not safetensors


def read_saev_header(path: Path, k_active: int, hook_width: int | None) -> tuple[dict[str, Any], int]:
    """(header, where the weights start) of saev's own checkpoint file (saev.nn.dump at commit 3d73f1f:
    one JSON line {"schema", "cfg", ...}, then torch.save of the state dict). ConfigError naming the
    file unless its activation is TopK with top_k = k_active: ReLU and BatchTopK SAEs (a threshold at
    inference) are not the LUT spec's Step A; or when the header's d_model (d_vit before it) is not
    `hook_width`."""
    with path.open("rb") as fh:
        line = fh.readline(SAEV_HEADER_LIMIT)
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply to parse
        raise FormatError(f"{path}: saev checkpoint header is not one JSON line ({exc})") from None
    activation, top_k = saev_activation(header)
    if activation != "TopK":
        raise ConfigError(f"{path}: a saev {activation} SAE; sae.import takes TopK SAEs (the LUT spec's "
                          "encoder is TopK(ReLU(x W + b)))")
    if not whole_number(top_k) or top_k != k_active:  # whole_number: true == 1 in Python
        raise ConfigError(f"{path}: top_k {top_k!r}, but sae.k_active is {k_active}: set sae.k_active to it")
    cfg = header.get("cfg") if isinstance(header.get("cfg"), dict) else {}
    field = "d_model" if "d_model" in cfg else "d_vit"
    check_hook_width(path, cfg.get(field), hook_width, f"its header's cfg.{field}")
    return header, len(line)


def read_saev_weights(path: Path, weights_at: int) -> dict[Any, Any]:
    """The state dict torch.save wrote at byte `weights_at` of saev's checkpoint file (after its header
    line), read from the file itself with torch's weights-only unpickler (a copy of its bytes first
    doubled the peak)."""
    with path.open("rb") as fh:
        fh.seek(weights_at)
        try:
            state = torch.load(fh, weights_only=True, map_location="cpu")
        except Exception as exc:  # the weights-only unpickler raises whatever the damaged bytes cause
            raise FormatError(f"{path}: saev checkpoint weights unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise FormatError(f"{path}: saev checkpoint weights are not a state dict")
    return state


def check_saev_sizes(path: Path, header: dict[str, Any], d_in: int, d_sae: int) -> None:
    """FormatError naming the file and field when a saev header's sizes (cfg.d_model, d_vit before it;
    cfg.d_sae, or exp_factor before it) are not those of the weights W_enc [d_in, d_sae] after it:
    saev.nn.load builds the SAE its header describes and refuses other weights, and read as they are,
    the top_k of another SAE's header would decide their encoding. A field the header lacks is not checked."""
    cfg = header.get("cfg") if isinstance(header.get("cfg"), dict) else {}
    factor = d_sae // d_in if d_sae % d_in == 0 else d_sae / d_in
    for field, size in {"d_model": d_in, "d_vit": d_in, "d_sae": d_sae, "exp_factor": factor}.items():
        if field in cfg and (not whole_number(cfg[field]) or cfg[field] != size):  # whole_number: true == 1
            raise FormatError(f"{path}: header cfg.{field} {cfg[field]!r:.40}, but the weights after it have "
                              f"{field} {size} (W_enc [{d_in}, {d_sae}]): the header of another SAE")


def saev_activation(header: dict[str, Any]) -> tuple[str | None, int | None]:
    """(activation class, top_k) of a saev checkpoint header, in each schema saev.nn.load reads: none
    (a ReLU SAE), 1 with the activation class as `cls`, and 1 to 5 with cfg.activation
    {"cls", "params": {"top_k"...}}."""
    if not isinstance(header, dict) or "schema" not in header:
        return "Relu", None
    cfg = header.get("cfg") if isinstance(header.get("cfg"), dict) else {}
    if header.get("cls") in ("Relu", "TopK", "BatchTopK"):
        return header["cls"], cfg.get("top_k", 32)
    activation = cfg.get("activation") if isinstance(cfg.get("activation"), dict) else {}
    params = activation.get("params") if isinstance(activation.get("params"), dict) else {}
    return activation.get("cls"), params.get("top_k")


def saelens_encoding(cfg_path: Path, k_active: int, sizes: dict[str, int]) -> tuple[bool, bool]:
    """(apply_b_dec_to_input, rescale_acts_by_decoder_norm) of the SAELens cfg.json at `cfg_path`, in
    its 6.x layout or the earlier one (activation_fn_str / activation_fn_kwargs, as SAELens reads it).
    ConfigError naming the file and field for an SAE TopKSAE would encode otherwise than SAELens: an
    architecture other than topk (standard, gated, jumprelu, batchtopk: the LUT spec's Step A is
    TopK(ReLU)), a k other than sae.k_active, normalised inputs; FormatError for a field of the wrong
    type, or a d_in or d_sae other than the weights' `sizes` (the cfg.json of another SAE, whose
    encoding it would decide). A decoder-norm rescaling is folded in by the caller, as SAELens folds it."""
    cfg = read_json(cfg_path)  # FormatError naming it: unreadable, too big, not JSON, nested too deeply
    if not isinstance(cfg, dict):
        raise FormatError(f"{cfg_path}: a SAELens cfg.json is a JSON object, got {type(cfg).__name__}")
    for field, size in sizes.items():  # whole_number: true == 1 in Python
        if not whole_number(cfg.get(field)) or cfg[field] != size:
            raise FormatError(f"{cfg_path}: {field} {cfg.get(field)!r:.40}, but the weights beside it have "
                              f"{field} {size}: the cfg.json of another SAE")
    version = cfg.get("sae_lens_version") or cfg_object(cfg_path, cfg, "metadata").get("sae_lens_version") or ""
    major = re.match(r"\d+", str(version))
    if major and int(major[0]) >= 6:
        architecture, k, k_field = cfg.get("architecture"), cfg.get("k", SAELENS_DEFAULT_K), "k"
    else:  # before 6.0 a TopK SAE was architecture standard with activation_fn_str topk; in another
        # architecture (jumprelu: TopK, then its threshold) the activation function is not all of the encoder
        kwargs, architecture = cfg_object(cfg_path, cfg, "activation_fn_kwargs"), cfg.get("architecture", "standard")
        topk = architecture == "standard" and (cfg.get("activation_fn_str") or cfg.get("activation_fn")) == "topk"
        architecture, k = ("topk", kwargs["k"]) if topk and "k" in kwargs else (architecture, None)
        k_field = "activation_fn_kwargs.k"
    if architecture != "topk":
        raise ConfigError(f"{cfg_path}: architecture {architecture!r}; sae.import takes TopK SAEs (architecture "
                          "topk): the LUT spec's encoder is TopK(ReLU(x W + b)), which this SAE's is not")
    if not whole_number(k, 1):  # "32", or true (== 1 in Python): the SAE's k is no count, whatever sae.k_active is
        raise ConfigError(f"{cfg_path}: {k_field} {k!r:.40}, but sae.k_active is {k_active}: that {k_field} is a "
                          f"{type(k).__name__}, where SAELens' k is a whole number (a JSON integer: 32, not \"32\")")
    if k != k_active:
        raise ConfigError(f"{cfg_path}: k {k!r}, but sae.k_active is {k_active}: set sae.k_active to the SAE's k")
    if cfg.get("normalize_activations", "none") not in ("none", False):
        raise ConfigError(f"{cfg_path}: normalize_activations {cfg['normalize_activations']!r}; sae.import takes "
                          "SAEs of the hook's raw activations (normalize_activations none)")
    if cfg.get("finetuning_scaling_factor"):
        raise ConfigError(f"{cfg_path}: finetuning_scaling_factor true; sae.import takes SAEs without one")
    return (cfg_switch(cfg_path, cfg, "apply_b_dec_to_input", True),
            cfg_switch(cfg_path, cfg, "rescale_acts_by_decoder_norm", False))


def cfg_switch(cfg_path: Path, cfg: dict[str, Any], field: str, default: bool) -> bool:
    """cfg.json's true-or-false `field` (null as false, as SAELens tests it); FormatError naming it for
    another value: bool("false") is true, and decided the encoding against what the file says."""
    value = cfg.get(field, default)
    if value is not None and not isinstance(value, bool):
        raise FormatError(f"{cfg_path}: {field} {value!r:.40} is a {type(value).__name__}, not true or false")
    return bool(value)


def cfg_object(cfg_path: Path, cfg: dict[str, Any], field: str) -> dict[str, Any]:
    """cfg.json's `field`, a JSON object; {} where it is absent or null, as SAELens reads it."""
    value = cfg.get(field) or {}
    if not isinstance(value, dict):
        raise FormatError(f"{cfg_path}: {field} is a {type(value).__name__}, not a JSON object")
    return value


def save_sae(sae: TopKSAE, path: str | Path, meta: dict[str, Any]) -> None:
    """float32 safetensors with the LUT key names; meta (hook, k_active, ...) in the header."""
    header = {key: str(value) for key, value in {**meta, "k_active": sae.k_active,
                                                 "num_basis": sae.num_basis, "d_in": sae.d_in}.items()}
    with atomic_path(path) as tmp:
        save_safetensors(sae.state(), tmp, header)


def load_sae(path: str | Path) -> tuple[TopKSAE, dict[str, str]]:
    """Read an actstore SAE checkpoint written by save_sae: FormatError naming the file and the key
    unless it holds the four float32 tensors, of shapes that agree and finite values, and a header
    k_active in 1..num_basis."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: SAE checkpoint missing")
    meta, raw = read_safetensors(path)
    missing = [key for key in SAE_KEYS if key not in raw]
    if missing or "k_active" not in meta:
        raise FormatError(f"{path}: not an actstore SAE checkpoint (missing {missing or ['k_active']})")
    state = checked_tensors(path, raw, SAE_DIMS, torch.float32)
    return TopKSAE.from_state(state, header_k_active(path, meta, state)), meta


def read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(header metadata, tensors) of a safetensors file; FormatError naming it when the library cannot
    read it (its own errors do not say which file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.metadata() or {}, {key: fh.get_tensor(key) for key in fh.keys()}
    except Exception as exc:  # a truncated or garbled file: safetensors raises its own error types
        raise FormatError(f"{path}: unreadable safetensors ({exc})") from None


def checked_tensors(path: Path, raw: dict[Any, Any], dims: dict[str, tuple[str, ...]],
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors `dims` names, as float32; FormatError naming `path` and the key for a value that
    is not a dense tensor, not of `dtype` (default: any floating point), not of the shape `dims` gives it
    (no dimension 0), or not finite (after the cast: a float64 value past float32's range is infinite in the SAE)."""
    for key in dims:
        value = raw[key]
        if not isinstance(value, torch.Tensor):
            raise FormatError(f"{path}: {key} is a {type(value).__name__}, not a tensor")
        if value.layout != torch.strided:  # torch's weights-only unpickler rebuilds sparse tensors too
            raise FormatError(f"{path}: {key} is a {str(value.layout).removeprefix('torch.')} tensor, not a dense one")
        if not value.is_floating_point() or dtype not in (None, value.dtype):
            raise FormatError(f"{path}: {key} is {str(value.dtype).removeprefix('torch.')}, "
                              f"expected {str(dtype).removeprefix('torch.') if dtype else 'floating point'}")
    checked_sizes(path, {key: list(raw[key].shape) for key in dims}, dims)
    checked = {}
    for key in dims:
        checked[key] = raw[key].float()
        # Its least and largest values, NaN if any is: isfinite's masks made 1.8x the tensor's bytes.
        if not torch.stack(checked[key].aminmax()).isfinite().all():
            raise FormatError(f"{path}: {key} holds NaN or infinite values")
    return checked


def checked_sizes(path: Path, shapes: dict[str, list[int]], dims: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Each dimension's size by name (d_in, num_basis...) from the `shapes` of the tensors `dims` names:
    a name's size is its first tensor's, which every later tensor's shape must agree with. FormatError
    naming `path` and the key for a shape that does not, or has a dimension of 0."""
    sizes: dict[str, int] = {}
    for key, names in dims.items():
        shape = list(shapes[key])
        want = [sizes.setdefault(name, size) for name, size in zip(names, shape)]
        if len(names) != len(shape) or want != shape:
            raise FormatError(f"{path}: {key} has shape {shape}, expected "
                              f"[{', '.join(str(sizes.get(name, name)) for name in names)}] ({', '.join(names)})")
        if 0 in shape:  # no SAE: a d_in of 0 was a ZeroDivisionError (check_saev_sizes), or LUT tables of it
            raise FormatError(f"{path}: {key} has shape {shape}, a dimension of 0")
    return sizes


def header_k_active(path: Path, meta: dict[str, str], state: dict[str, torch.Tensor]) -> int:
    """The header's k_active (a string, as every safetensors header value), which must be a whole
    number in 1..num_basis; the header's num_basis and d_in (save_sae writes them, `actstore inspect`
    reports them) must be the tensors'."""
    num_basis, d_in = state["encoder_weight"].shape
    text = meta["k_active"]
    # At most 18 digits: int() of over 4300 is a ValueError naming neither the file nor the field.
    if not re.fullmatch(r"[0-9]{1,18}", text) or not 0 < int(text) <= num_basis:
        raise FormatError(f"{path}: header k_active {text!r:.40} is not a whole number in 1..num_basis ({num_basis})")
    for key, size in (("num_basis", num_basis), ("d_in", d_in)):
        if key in meta and meta[key] != str(size):
            raise FormatError(f"{path}: header {key} {meta[key]!r:.40}, but the tensors' is {size}")
    return int(text)


def save_saelens(sae: TopKSAE, directory: str | Path, metadata: dict[str, Any]) -> None:
    """The SAE as SAELens (6.0 on) loads it, `SAE.load_from_disk(directory)`, encoding and decoding as
    TopKSAE does: architecture topk (its TopK keeps the k largest pre-activations, then ReLU: the same
    latents and values as ReLU then TopK), W_enc = encoder_weight.T, apply_b_dec_to_input false
    (encoder_bias already holds any centring), no rescaling or normalisation, float32.
    `metadata`: SAELens' metadata fields (model_name, hook_name...)."""
    state = sae.state()
    weights = {"W_enc": state["encoder_weight"].T.contiguous(), "b_enc": state["encoder_bias"],
               "W_dec": state["decoder_weight"], "b_dec": state["decoder_bias"]}
    config = {"architecture": "topk", "d_in": sae.d_in, "d_sae": sae.num_basis, "k": sae.k_active,
              "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": False, "normalize_activations": "none",
              "reshape_activations": "none", "rescale_acts_by_decoder_norm": False,
              "metadata": {**metadata, "sae_lens_version": SAELENS_LAYOUT}}
    directory = Path(directory)
    with atomic_path(directory / SAELENS_WEIGHTS) as tmp:
        save_safetensors(weights, tmp, {"format": "pt"})
    write_json_atomic(directory / SAELENS_CFG, config)
