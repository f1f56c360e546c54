"""model.tower: vision reads only the vision tower's tensors from a vision-language checkpoint: the
tower equals, tensor for tensor and output for output, the one the whole checkpoint loads; the
language model's shards are never opened; a tower the checkpoint does not hold by name is named
before any tensor is read; and the load's peak memory is the tower's, not the checkpoint's."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

import tiny
from actstore.checkpoint import INDEX, SINGLE, load_weights
from actstore.errors import ConfigError
from actstore.models import TORCH_DTYPES, load_model, model_skeleton

VLM_KINDS = ("gemma3", "llava", "paligemma")  # every tiny vision-language kind whose tower actstore runs


def reference_tower(folder: Path, dtype: str = "float32") -> nn.Module:
    """The tower as the whole checkpoint loads it (how load_model loaded it before)."""
    from transformers import AutoModelForImageTextToText

    whole = AutoModelForImageTextToText.from_pretrained(folder, dtype=TORCH_DTYPES[dtype], local_files_only=True)
    return whole.model.vision_tower.eval()


def every_tensor(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, non-persistent ones (position ids) too."""
    return {**module.state_dict(), **dict(module.named_buffers())}


def assert_same_tensors(tower: nn.Module, reference: nn.Module) -> None:
    ours, theirs = every_tensor(tower), every_tensor(reference)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def hidden_states(tower: nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        out = tower(pixel_values=pixels.to(tower.dtype), output_hidden_states=True)
    return (*out.hidden_states, out.last_hidden_state)


def image_batch(folder: Path, image_folder: Path) -> torch.Tensor:
    from PIL import Image

    from actstore.models import load_image_processor

    images = [Image.open(path).convert("RGB") for path in sorted(image_folder.rglob("*.png"))[:4]]
    return load_image_processor(folder)(images=images, return_tensors="pt")["pixel_values"]


def rewrite_checkpoint(folder: Path, out: Path, rename) -> Path:
    """A copy of the model folder whose model.safetensors holds rename(tensors)."""
    shutil.copytree(folder, out)
    save_file(rename(load_file(out / SINGLE)), out / SINGLE, metadata={"format": "pt"})
    return out


def sharded_copy(folder: Path, out: Path) -> dict[str, str]:
    """The checkpoint saved again in shards of ~50 kB (its index's weight_map returned), beside the
    folder's other files (processors, tokenizer)."""
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).save_pretrained(
        out, max_shard_size=50_000)
    for path in folder.iterdir():
        if not (out / path.name).exists() and path.name != SINGLE:
            shutil.copy(path, out / path.name)
    return json.loads((out / INDEX).read_text())["weight_map"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", VLM_KINDS)
def test_the_tower_read_alone_equals_the_whole_checkpoints(kind, dtype, model_dir, image_folder):
    """Every parameter and buffer (position ids too) of the tower read alone equals, in value and dtype,
    the one the whole checkpoint's from_pretrained gives, and a batch of photographs runs to the same
    bits in every block."""
    folder = model_dir(kind)
    loaded = load_model(folder, dtype, "cpu", tower="vision")
    reference = reference_tower(folder, dtype)
    assert type(loaded.model) is type(reference) and loaded.model.dtype == TORCH_DTYPES[dtype]
    assert_same_tensors(loaded.model, reference)
    pixels = image_batch(folder, image_folder)
    assert all(torch.equal(a, b) for a, b in zip(hidden_states(loaded.model, pixels), hidden_states(reference, pixels),
                                                 strict=True))


@pytest.mark.parametrize("kind", ["gemma3", "llava"])
def test_a_checkpoint_named_as_the_hubs_reads_its_tower_under_its_own_prefix(kind, model_dir, tmp_path):
    """The Hub's LLaVA 1.5 and Gemma 3 checkpoints hold the tower as `vision_tower.vision_model.*`
    (transformers 5 saves `vision_tower.*`), with the position ids transformers 4 once saved: the
    tower's keys are found under that one prefix, the stray buffer is left as from_pretrained leaves it."""
    def hub_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        renamed = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
                   for name, tensor in tensors.items()}
        patches = renamed["vision_tower.vision_model.embeddings.position_embedding.weight"].shape[0]
        return {**renamed, "vision_tower.vision_model.embeddings.position_ids": torch.arange(patches)[None] + 7}

    folder = rewrite_checkpoint(model_dir(kind), tmp_path / kind, hub_names)
    tower = load_model(folder, device="cpu", tower="vision").model
    assert_same_tensors(tower, reference_tower(folder))
    assert_same_tensors(tower, reference_tower(model_dir(kind)))


def test_the_language_models_shards_are_never_read(model_dir, tmp_path):
    """A sharded checkpoint whose language-model-only shards are garbage: the whole checkpoint no longer
    loads, the tower still does, equal to the intact checkpoint's."""
    folder = tmp_path / "sharded"
    weight_map = sharded_copy(model_dir("llava"), folder)
    tower_files = {file for name, file in weight_map.items() if name.startswith("vision_tower.")}
    language_only = {file for file in weight_map.values()
                     if all(name.startswith("language_model.") for name, f in weight_map.items() if f == file)}
    assert language_only and tower_files and not language_only & tower_files
    for file in language_only:
        (folder / file).write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorError):
        reference_tower(folder)
    assert_same_tensors(load_model(folder, device="cpu", tower="vision").model, reference_tower(model_dir("llava")))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_shard_of_the_tower_is_named(damage, model_dir, tmp_path):
    folder = tmp_path / "sharded"
    weight_map = sharded_copy(model_dir("llava"), folder)
    shard = weight_map["vision_tower.encoder.layers.1.mlp.fc1.weight"]
    if damage == "missing":
        (folder / shard).unlink()
    else:
        (folder / shard).write_bytes((folder / shard).read_bytes()[:-100])
    with pytest.raises(ConfigError, match=f"model.path {folder}: {shard} cannot be read: "):
        load_model(folder, device="cpu", tower="vision")


@pytest.mark.parametrize("damage", [b"\x04\x00", b"\x10" + b"\x00" * 7 + b'{"a": 1}        ', b"\x08" + b"\x00" * 7 + b"[1, 2]  "])
def test_a_shard_header_slurm_sizing_cannot_read_is_named(damage, model_dir, tmp_path):
    """The tower's job is sized from the shards' headers alone (resources): a shard cut short or with a
    header that is not tensor entries is a ConfigError naming the file, not a Python error."""
    from actstore.checkpoint import tensor_bytes
    folder = tmp_path / "sharded"
    weight_map = sharded_copy(model_dir("llava"), folder)
    shard = weight_map["vision_tower.encoder.layers.1.mlp.fc1.weight"]
    (folder / shard).write_bytes(damage)
    with pytest.raises(ConfigError, match=f"model.path {folder}: {shard} has no readable safetensors header"):
        tensor_bytes(folder)


@pytest.mark.parametrize("offsets, twice", [
    ("[0, NaN]", False), ("[false, true]", False), ("[0, 3.2e10]", False), ("[{end}, {begin}]", False),
    ("[0, 3200000000000]", True), (None, False)], ids=["nan", "bool", "float", "backwards", "key-twice", "length"])
def test_a_shard_header_the_library_refuses_is_not_sized(offsets, twice, model_dir, tmp_path):
    """The tower's job was sized from what json.loads made of a shard's header: a NaN, True, a float
    or a negative byte count, the second of a tensor's two entries (3.2 TB), or a header length past
    the file allocated it (MemoryError). Whatever the safetensors library refuses to load is a
    ConfigError naming the file."""
    import struct

    from safetensors import safe_open

    from actstore.checkpoint import tensor_bytes
    folder = tmp_path / "sharded"
    key = "vision_tower.encoder.layers.1.mlp.fc1.weight"
    shard = folder / sharded_copy(model_dir("llava"), folder)[key]
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    if offsets is None:
        text, length = json.dumps(header).encode(), 1 << 62
    else:
        begin, end = header[key]["data_offsets"]
        entry = json.dumps({**header[key], "data_offsets": "OFFSETS"}).replace(
            '"OFFSETS"', offsets.format(begin=begin, end=end))
        rest = header if twice else {name: value for name, value in header.items() if name != key}
        text = (json.dumps(rest)[:-1] + f", {json.dumps(key)}: {entry}}}").encode()
        text += b" " * (-len(text) % 8)
        length = len(text)
    shard.write_bytes(struct.pack("<Q", length) + text + data)
    with pytest.raises(Exception):
        with safe_open(str(shard), framework="numpy") as f:
            f.get_tensor(key)
    with pytest.raises(ConfigError, match=f"model.path {folder}: {shard.name} has no readable safetensors header"):
        tensor_bytes(folder)


@pytest.mark.parametrize("file", [3, ["model-00001-of-00002.safetensors"]], ids=["number", "list"])
def test_a_weight_map_file_that_is_not_a_name_is_named(file, tmp_path):
    """A shard index mapping a tensor to a number or list was a TypeError out of sorting or hashing
    the files (Slurm sizing, the tower's load): a ConfigError naming the index and the tensor."""
    from actstore.checkpoint import tensor_bytes
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {
        "vision_tower.a.weight": "model-00001-of-00002.safetensors", "vision_tower.b.weight": file}}))
    with pytest.raises(ConfigError, match=f"model.path {tmp_path}: {INDEX} weight_map gives 'vision_tower.b.weight' "
                                          "the file .*, not a file name"):
        tensor_bytes(tmp_path)


def test_a_tower_key_the_checkpoint_renames_is_named(model_dir, tmp_path):
    """A tower weight saved under another name: the folder and the tower's own key are named."""
    key = "encoder.layers.1.mlp.fc1.weight"
    folder = rewrite_checkpoint(model_dir("llava"), tmp_path / "renamed", lambda tensors: {
        name.replace("mlp.fc1", "mlp.fc_in") if name == f"vision_tower.{key}" else name: t
        for name, t in tensors.items()})
    with pytest.raises(ConfigError, match=f"model.path {folder}: the vision tower's weight '{key}' is not in its "
                                          "safetensors checkpoint under 'vision_tower.', where its other weights are"):
        load_model(folder, device="cpu", tower="vision")


def test_the_tower_is_named_from_the_index_before_any_shard_is_read(model_dir, tmp_path):
    """The prefix is found from the names alone: with every shard garbage, the renamed key is what is named."""
    folder = tmp_path / "sharded"
    weight_map = sharded_copy(model_dir("gemma3"), folder)
    key = "vision_tower.post_layernorm.weight"
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {name.replace("post_layernorm", "post_norm"): file for name, file in weight_map.items()}
    (folder / INDEX).write_text(json.dumps(index))
    for file in set(weight_map.values()):
        (folder / file).write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=f"the vision tower's weight '{key.removeprefix('vision_tower.')}' is not"):
        load_model(folder, device="cpu", tower="vision")


def test_a_bin_only_checkpoint_is_named(model_dir, tmp_path):
    folder = tmp_path / "bin"
    shutil.copytree(model_dir("llava"), folder)
    torch.save(load_file(folder / SINGLE), folder / "pytorch_model.bin")
    (folder / SINGLE).unlink()
    first = next(iter(model_skeleton(folder, tower="vision").state_dict()))
    with pytest.raises(ConfigError, match=f"model.path {folder}: the vision tower's weight '{first}' is not in its "
                                          r"safetensors checkpoint; .* saved as .bin only"):
        load_model(folder, device="cpu", tower="vision")


class Tied(nn.Module):
    """A module whose head shares its embedding's weight, with a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.zeros(4))
        self.register_buffer("ids", torch.arange(5) + 3, persistent=False)


def test_a_tied_weight_is_read_once_under_either_name(tmp_path):
    weight = torch.randn(5, 4, dtype=torch.bfloat16)
    save_file({"model.toy.head.weight": weight, "model.toy.scale": torch.ones(4), "model.other.weight": torch.ones(2)},
              tmp_path / SINGLE)
    module = Tied()
    load_weights(module, tmp_path, "toy")
    assert module.embed.weight.dtype == torch.float32 and torch.equal(module.embed.weight, weight.float())
    assert module.head.weight.data_ptr() == module.embed.weight.data_ptr()
    assert torch.equal(module.scale, torch.ones(4)) and torch.equal(module.ids, torch.arange(5) + 3)


def test_a_module_found_under_two_prefixes_or_of_another_shape_is_named(tmp_path):
    weights = {"embed.weight": torch.ones(5, 4), "scale": torch.ones(4)}
    save_file({f"{prefix}.{name}": tensor.clone() for prefix in ("a", "b") for name, tensor in weights.items()},
              tmp_path / SINGLE)
    with pytest.raises(ConfigError, match=r"the toy's weights are in its checkpoint under more than one prefix "
                                          r"\('a.', 'b.'\)"):
        load_weights(Tied(), tmp_path, "toy")
    save_file({"embed.weight": torch.ones(5, 3), "scale": torch.ones(4)}, tmp_path / SINGLE)
    with pytest.raises(ConfigError, match="the toy's weights do not fit it: .*size mismatch for embed.weight"):
        load_weights(Tied(), tmp_path, "toy")


MEASURE = """
import json, sys
from pathlib import Path

import torch
import transformers
from actstore.models import load_model

transformers.LlavaForConditionalGeneration, transformers.CLIPVisionModel  # imported before the baseline


def peak_mb():
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


before = peak_mb()
if sys.argv[2] == "whole":  # as load_model loaded a tower before
    transformers.AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32, local_files_only=True)
else:
    load_model(sys.argv[1], "float32", "cpu", tower="vision")
print(json.dumps({"grow_mb": peak_mb() - before, "peak_mb": peak_mb()}))
"""


def big_language_model(out: Path) -> Path:
    """A LLaVA whose language model is 51M parameters (a 100k vocabulary, 256 wide, untied head) beside
    a 3.2M-parameter CLIP tower, saved in bfloat16 as the Hub's checkpoints are."""
    import transformers as tf

    torch.manual_seed(0)
    tf.CLIPImageProcessor(size={"shortest_edge": tiny.IMAGE_SIZE},
                          crop_size={"height": tiny.IMAGE_SIZE, "width": tiny.IMAGE_SIZE}).save_pretrained(out)
    tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=100_000, hidden_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                         max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=1024, image_size=tiny.IMAGE_SIZE, patch_size=tiny.PATCH),
        image_token_index=99_999)).to(torch.bfloat16).save_pretrained(out)
    return out


def grow_mb(folder: Path, how: str) -> float:
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(folder), how], capture_output=True, text=True,
                          check=True, timeout=300)
    return json.loads(proc.stdout.splitlines()[-1])["grow_mb"]


@pytest.mark.slow
def test_reading_the_tower_alone_takes_the_towers_memory_not_the_checkpoints(tmp_path):
    """Peak resident memory each load adds in a fresh process (imports before), at model.torch_dtype's
    default float32: the whole checkpoint's at least its language model cast (205 MB), the tower's a
    small fraction of that. (transformers 5 maps a checkpoint loaded in its own dtype, and pages in only
    what is touched: the cast is what reads the whole.)"""
    folder = big_language_model(tmp_path / "llava-big")
    whole, tower = grow_mb(folder, "whole"), grow_mb(folder, "tower")
    print(f"peak RSS added: whole checkpoint {whole:.0f} MB, vision tower alone {tower:.0f} MB")
    assert whole > 150 and tower < whole / 4


def whole_checkpoints_tower(path: Path, skeleton: nn.Module, dtype: torch.dtype) -> nn.Module:
    """How load_model loaded a vision tower before: the whole checkpoint, the tower kept (no skeleton)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True).model.vision_tower


def part_files(part: Path) -> dict[str, object]:
    """A part's files, part.json without its run's duration and waits."""
    files = {path.relative_to(part).as_posix(): path.read_bytes() for path in sorted(part.rglob("*")) if path.is_file()}
    meta = json.loads(files.pop("part.json"))
    meta.pop("extraction_duration_seconds")
    meta.pop("extraction_waits")
    return {**files, "part.json": meta}


@pytest.mark.parametrize("kind, dtype", [("gemma3", "float32"), ("llava", "bfloat16")])
def test_an_extraction_of_the_tower_read_alone_is_the_same_bytes(kind, dtype, model_dir, image_folder, tmp_path,
                                                                   monkeypatch):
    """Every file of a part extracted with the tower read alone equals, byte for byte, the part the
    whole checkpoint's tower extracts (part.json but its duration)."""
    import actstore.models
    from actstore.extract import run_part

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    config = tiny.make_config(tmp_path, model_dir(kind), image_folder, model={"tower": "vision", "torch_dtype": dtype},
                              extract={"layers": [0, 1], "parts": 1, "hooks": ["encoder.layers.1.mlp.fc1:input"]})
    run_part(config, 0, tmp_path / "alone", progress=False)
    monkeypatch.setattr(actstore.models, "_vision_tower", whole_checkpoints_tower)
    run_part(config, 0, tmp_path / "whole", progress=False)
    assert part_files(tmp_path / "alone") == part_files(tmp_path / "whole")


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_slurm_sizes_a_tower_job_by_the_tower(kind, model_dir, image_folder, tmp_path):
    """resources counts the tower's bytes from the safetensors headers (no torch, no data read), the
    bytes load_model reads, not the whole checkpoint's: a 27B checkpoint's tower job asks for GBs, not 80."""
    from actstore import resources

    folder = model_dir(kind)
    tower = load_model(folder, "float32", "cpu", tower="vision").model
    read = sum(t.numel() * t.element_size() for t in tower.state_dict().values())
    config = tiny.make_config(tmp_path, folder, image_folder, model={"tower": "vision"})
    whole = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert resources.workload(config).weight_bytes == read < whole
