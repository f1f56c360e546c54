"""model.trust_remote_code reaches every load of a model folder's tokenizer or image processor, not
only extraction's: the chat-template renderer, lmprobe's token_strings and saev's patch labels. A
folder whose classes are its own Python (auto_map) loads its own class when trusted and is refused,
naming the folder and the key, when not (never a prompt, never a built-in class in its place)."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoImageProcessor, AutoTokenizer

import tiny
from actstore.datasets import load_dataset
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.formats import lmprobe
from actstore.formats.extract import open_extraction, open_part, write_index
from actstore.patch_labels import image_patch_labels

MESSAGES = [[{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is zlib?"}],
            [{"role": "user", "content": "And json?"}]]


def refused(folder) -> str:
    """The ConfigError model_config.check_remote_code raises for `folder` without the key."""
    return rf"model.path {re.escape(str(folder))}: its config.json maps .* set model.trust_remote_code: true"


def custom_tokenizer(folder):
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TinyCustomTokenizer"  # the folder's own class
    return tokenizer


@pytest.fixture
def chat_model(model_dir, tmp_path):
    """A copy of the custom_code model (its tokenizer's class is its own code) with a chat template."""
    folder = shutil.copytree(model_dir("custom_code"), tmp_path / "chat-custom")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": tiny.CHAT_TEMPLATE}))
    return folder


def test_chat_messages_render_with_a_custom_code_tokenizer_only_when_trusted(chat_model, tmp_path):
    """dataset.messages_field: load_dataset's renderer, and the extraction job's through configured_dataset."""
    lines = tmp_path / "chat.jsonl"
    lines.write_text("".join(json.dumps({"messages": m, "label": i}) + "\n" for i, m in enumerate(MESSAGES)))
    with pytest.raises(ConfigError, match=refused(chat_model)):
        load_dataset(lines, model_path=chat_model, messages_field="messages")
    tokenizer = custom_tokenizer(chat_model)
    rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in MESSAGES]
    read = load_dataset(lines, model_path=chat_model, messages_field="messages", trust_remote_code=True)
    assert [s.text for s in read.samples] == rendered
    # The extraction job reads the config's key (configured_dataset), then tokenizes what was rendered.
    config = tiny.make_config(tmp_path, chat_model, lines, model={"trust_remote_code": True},
                              dataset={"messages_field": "messages"}, extract={"max_seq_length": 128, "parts": 1})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    for local, text in enumerate(rendered):
        assert part.token_ids(local).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_lmprobe_token_strings_decode_with_a_custom_code_tokenizer_only_when_trusted(model_dir, text_jsonl,
                                                                                      tmp_path):
    """token_strings in write_dataset and in the workflow's finishing job (finish_dataset)."""
    folder = model_dir("custom_code")
    config = tiny.make_config(tmp_path, folder, text_jsonl, model={"trust_remote_code": True})
    custom_extraction = tmp_path / "extract"
    for part in range(config["extract"]["parts"]):
        run_part(config, part, custom_extraction / f"part-{part:04d}", progress=False)
    write_index(custom_extraction, custom_extraction / "extract.json")
    with pytest.raises(ConfigError, match=refused(folder)):
        lmprobe.write_dataset(custom_extraction, tmp_path / "refused", {"storage": "pooled"}, progress=False)
    assert not (tmp_path / "refused").exists()
    lmprobe.write_dataset(custom_extraction, tmp_path / "ds", {"storage": "pooled"}, progress=False,
                          trust_remote_code=True)
    # The workflow's path: scattered tensor jobs, then the finishing job that writes the index.
    jobs = [tmp_path / "scatter" / f"job-{job}" for job in range(2)]
    for job, job_dir in enumerate(jobs):
        lmprobe.write_job(custom_extraction, job_dir, {"storage": "pooled"}, jobs=2, job=job, progress=False)
    lmprobe.finish_dataset(custom_extraction, jobs, tmp_path / "finished", {"storage": "pooled"},
                           trust_remote_code=True)
    tokenizer = custom_tokenizer(folder)
    extraction = open_extraction(custom_extraction)
    for root in (tmp_path / "ds", tmp_path / "finished"):
        rows = pq.read_table(lmprobe.find_index(root)).to_pylist()
        assert len(rows) == 30
        for row in rows:
            part, local = extraction.locate(row["sample_idx"])
            ids = part.token_ids(local).tolist()
            assert row["token_ids"] == ids and row["token_strings"] == [tokenizer.decode([i]) for i in ids]


CUSTOM_PROCESSOR = """from PIL import ImageOps
from transformers import SiglipImageProcessor


class TinyCustomImageProcessor(SiglipImageProcessor):
    # The folder's own step before SigLIP's: each image mirrored, so its patches are too.
    def __call__(self, images, **kwargs):
        return super().__call__([ImageOps.mirror(image) for image in images], **kwargs)
"""


def custom_processor_model(siglip, out):
    """A copy of the tiny SigLIP whose image processor is Python in its folder (auto_map)."""
    folder = shutil.copytree(siglip, out)
    (folder / "image_processing_tiny_custom.py").write_text(CUSTOM_PROCESSOR)
    where = "image_processing_tiny_custom.TinyCustomImageProcessor"
    for name, key in (("preprocessor_config.json", "image_processor_type"), ("config.json", None)):
        config = json.loads((folder / name).read_text())
        config = {**config, "auto_map": {"AutoImageProcessor": where}}
        (folder / name).write_text(json.dumps({**config, key: "TinyCustomImageProcessor"} if key else config))
    return folder


def test_patch_labels_run_a_custom_code_image_processor_only_when_trusted(model_dir, tmp_path):
    """saev.patch_labels: the masks go through the folder's own processor (here one that mirrors),
    as the pixels did, never SigLIP's in its place."""
    images, masks, _ = tiny.write_segmentation_folder(tmp_path / "seg", (32, 32), (2, 3), n_images=2)
    folder = custom_processor_model(model_dir("siglip"), tmp_path / "custom-siglip")
    processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True, trust_remote_code=True)
    assert type(processor).__name__ == "TinyCustomImageProcessor"
    rels = sorted(str(p.relative_to(images)) for p in images.rglob("*.png"))
    section = {"masks": str(masks), "mask_suffix": ".png", "pixel_agg": "majority", "bg_label": 0}
    grid = tiny.IMAGE_SIZE // tiny.PATCH

    def labels(model, **trust):
        return image_patch_labels(images, rels, model, tiny.PATCH, section, grid * grid, 0, progress=False, **trust)

    with pytest.raises(ConfigError, match=refused(folder)):
        labels(folder)
    plain = labels(model_dir("siglip")).reshape(len(rels), grid, grid)
    assert not np.array_equal(plain, plain[:, :, ::-1])  # a mirrored mask labels other patches
    mirrored = labels(folder, trust_remote_code=True).reshape(len(rels), grid, grid)
    assert np.array_equal(mirrored, plain[:, :, ::-1])


def test_a_tokenizer_that_is_folder_code_beside_a_standard_model_is_refused_at_parse_time(model_dir, tmp_path):
    """config.json holds no auto_map, tokenizer_config.json does (a custom tokenizer beside a standard
    model): refused by the parse-time check naming that file, and loaded as the folder's own class
    once trusted."""
    from actstore.model_config import run_config
    from actstore.models import load_tokenizer

    folder = shutil.copytree(model_dir("bert"), tmp_path / "bert-custom-tokenizer")
    tiny.custom_code_tokenizer(folder)
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=rf"model.path {re.escape(str(folder))}: its tokenizer_config.json maps "
                                          r"AutoTokenizer .* set model.trust_remote_code: true"):
        run_config({"path": str(folder)})
    assert run_config({"path": str(folder), "trust_remote_code": True})["model_type"] == "bert"
    assert type(load_tokenizer(folder, trust_remote_code=True)).__name__ == "TinyCustomTokenizer"
