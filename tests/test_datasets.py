"""The datasets users already have (Parquet, Arrow, CSV, save_to_disk, chat prompts, image tables)
extract exactly as the same rows in JSONL or an image folder; bad columns fail before weights load."""
from __future__ import annotations

import csv
import glob
import gzip
import json
import os
import re
import shutil
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tiny
from actstore.datasets import check_dataset, load_dataset, part_range, read_scan, scan_dataset, write_scan
from actstore.datasets.core import Fields, label_list
from actstore.datasets.jsonl import open_text, scan_jsonl
from actstore.datasets.scan import stamped
from actstore.datasets.source import resolve_source
from actstore.errors import ConfigError, FormatError
from actstore.extract import run_part
from actstore.formats.extract import open_extraction, write_index
from actstore.hashing import stage_hash, stage_payload

N_ROWS = 200
EXTRAS = ["module", "qualname"]  # the corpus's other JSONL fields: kept as metadata


def part_files(config, root: Path) -> list[dict[str, bytes]]:
    """Every file of every part but part.json (which records times and paths): samples.jsonl,
    offsets, token ids, activations."""
    parts = []
    for part in range(config["extract"]["parts"]):
        out = root / f"part-{part:04d}"
        run_part(config, part, out, progress=False)
        parts.append({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "part.json"})
    return parts


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tiny.write_jsonl(tmp_path_factory.mktemp("rows") / "docs.jsonl", N_ROWS)
    return path, [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tables(rows, tmp_path_factory):
    """The same 200 rows as Parquet (2 shards), CSV, Arrow and a save_to_disk DatasetDict (label a
    ClassLabel), each with the dataset keys that read it as the JSONL is read."""
    from pyarrow import csv

    root = tmp_path_factory.mktemp("tables")
    table = pa.Table.from_pylist(rows[1])
    csv.write_csv(table, root / "docs.csv")
    names = sorted({r["label"] for r in rows[1]})
    as_ids = table.set_column(1, "label", pa.array([names.index(r["label"]) for r in rows[1]], pa.int64()))
    features = {"text": {"dtype": "string", "_type": "Value"}, "label": {"names": names, "_type": "ClassLabel"},
                **{k: {"dtype": "string", "_type": "Value"} for k in EXTRAS}}
    keep = {"keep_fields": EXTRAS}
    return {
        "parquet": (tiny.write_parquet(root / "parquet", table, shards=2), keep),
        "csv": (root / "docs.csv", keep),
        "arrow": (tiny.write_arrow_stream(root / "docs.arrow", table), keep),
        "hf_disk": (tiny.write_hf_disk(root / "hf", {"train": as_ids, "test": as_ids.slice(0, 5)}, features), keep),
        "parquet_glob": (f"{root}/parquet/train-*.parquet", {**keep, "format": "parquet"}),
    }


@pytest.fixture(scope="module")
def jsonl_parts(rows, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jsonl")
    parts = part_files(tiny.make_config(tmp, model_dir("gpt2"), rows[0]), tmp)
    assert b'"metadata": {"module": "codecs", "qualname": "codecs"}' in parts[0]["samples.jsonl"]
    return parts


@pytest.mark.parametrize("kind", ["parquet", "csv", "arrow", "hf_disk", "parquet_glob"])
def test_every_table_format_extracts_the_jsonl_bytes(kind, rows, tables, jsonl_parts, model_dir, tmp_path):
    path, options = tables[kind]
    config = tiny.make_config(tmp_path, model_dir("gpt2"), path, dataset=options)
    assert load_dataset(path, **options).labels == load_dataset(rows[0]).labels
    assert part_files(config, tmp_path / kind) == jsonl_parts


def test_a_text_folder_extracts_as_the_same_rows_in_jsonl(rows, model_dir, tmp_path):
    """A folder of text files, as IMDB's aclImdb ships (train/{neg,pos,unsup}/<id>_<rating>.txt and
    other files beside them), picked with a glob: each file a sample in path order, labelled by its
    folder, extracts the bytes of the same rows as JSONL (text, label, and the file's name kept)."""
    from actstore import resources

    root = tmp_path / "aclImdb" / "train"
    for i, row in enumerate(rows[1][:45]):
        path = root / ["neg", "pos", "unsup"][i % 3] / f"{i}_{i % 10 + 1}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(row["text"] + ("<br /><br />ünïcode\n" if i % 4 == 0 else ""), encoding="utf-8")
    (root / "urls_pos.txt").write_text("http://www.imdb.com/title/tt0453418/usercomments\n")
    (root / "labeledBow.feat").write_bytes(b"9 0:9 1:1 \xff\n")
    picked = f"{root}/[np]*/*.txt"
    files = sorted(Path(p) for p in glob.glob(picked))
    lines = tmp_path / "same.jsonl"
    lines.write_text("".join(json.dumps({"text": p.read_text(encoding="utf-8"), "label": p.parent.name,
                                         "file": p.relative_to(root).as_posix()}) + "\n" for p in files))
    config = tiny.make_config(tmp_path / "folder", model_dir("gpt2"), picked, dataset={"format": "text_folder"})
    assert len(files) == 30 and load_dataset(picked, format="text_folder").labels == ["neg", "pos"]
    assert resources.workload(config).text_bytes == sum(p.stat().st_size for p in files)
    assert part_files(config, tmp_path / "folder") == part_files(
        tiny.make_config(tmp_path / "jsonl", model_dir("gpt2"), lines), tmp_path / "jsonl")


def test_a_text_folder_is_read_by_its_parts_folders_and_a_file_not_utf8_is_named_by_the_scan(tmp_path):
    root = tmp_path / "news"
    for i in range(20):
        path = root / (f"group{i % 3}" if i % 5 else ".") / f"{1000 + i}"  # 20 Newsgroups' names: no suffix
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"From: someone\n\npost {i}\n")
    whole = flat(load_dataset(root, format="text_folder"))
    assert [row[3]["file"] for row in whole][:2] == ["1000", "1005"] and whole[0][2] is None
    write_scan(scan_dataset(root, format="text_folder"), tmp_path / "scan.json")
    scan = read_scan(tmp_path / "scan.json")
    assert scan.folder_format == "text_folder" and [folder for folder, _, _ in scan.runs] == ["", "group0", "group1",
                                                                                             "group2"]
    assert [row for part in range(3) for row in flat(load_dataset(root, parts=(3, part), scan=scan))] == whole
    (root / "group1" / "2000").write_bytes("é ok\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"news/group1/2000: not utf-8 text \(byte 1: invalid continuation byte; "
                                          r"another encoding: dataset.encoding\)"):
        scan_dataset(root, format="text_folder")
    latin = load_dataset(root, format="text_folder", encoding="latin-1")  # 20 Newsgroups' posts are latin-1
    assert [s.text for s in latin.samples if s.metadata["file"] == "group1/2000"] == ["é ok\n"]
    with pytest.raises(ConfigError, match="dataset.encoding: 'latin-9x' is not an encoding Python knows"):
        check_dataset({"path": str(root), "format": "text_folder", "encoding": "latin-9x"})
    with pytest.raises(ConfigError, match=r"news/group1: its files changed .* \(7 files, 6 when scanned\)"):
        load_dataset(root, parts=(3, 1), scan=scan)
    with pytest.raises(ConfigError, match=r"dataset.path .*news holds no samples .*dataset.format: text_folder"):
        scan_dataset(root)  # auto never reads a folder as texts: any folder holds files


TEMPLATE = "Module {module} ({qualname}):\n{text}\n{{label}}:"


def test_a_prompt_template_makes_the_prompt_of_the_rows_fields(rows, tables, model_dir, tmp_path):
    """dataset.prompt_template fills plain {field} placeholders from each row, in JSONL and tables
    alike: the extraction stores exactly what the same prompts written out as text store."""
    prompts = [TEMPLATE.format_map(row) for row in rows[1]]
    assert prompts[0].startswith("Module codecs (codecs):\n") and prompts[0].endswith("\n{label}:")
    written = tmp_path / "written.jsonl"
    written.write_text("".join(json.dumps({"text": p, "label": r["label"]}) + "\n" for p, r in zip(prompts, rows[1])))
    stored = [part_files(tiny.make_config(tmp_path / "written", model_dir("gpt2"), written), tmp_path / "written")]
    for name, path in (("jsonl", rows[0]), ("parquet", tables["parquet"][0])):
        options = {"prompt_template": TEMPLATE, "keep_fields": []}
        assert [s.text for s in load_dataset(path, **options).samples] == prompts
        config = tiny.make_config(tmp_path / name, model_dir("gpt2"), path, dataset=options)
        check_dataset(config["dataset"])
        stored.append(part_files(config, tmp_path / name))
    assert stored[0] == stored[1] == stored[2]


def test_a_prompt_template_is_checked_at_parse_time_and_a_missing_field_named(tables, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "a", "n": 3}) + "\n" + json.dumps({"text": "b"}) + "\n")
    assert [s.text for s in load_dataset(path, prompt_template="{text} x{n}", limit=1).samples] == ["a x3"]
    with pytest.raises(ConfigError, match=r"docs.jsonl:2: line has no string or number field 'n' "
                                          r"\(dataset.prompt_template\)"):
        scan_dataset(path, prompt_template="{text} x{n}")
    for template, message in [("{text.upper}", r"placeholder \{text.upper\} is not a field's name alone"),
                              ("{0}", r"placeholder \{0\} is not"), ("{text!r}", r"placeholder \{text!r\} is not"),
                              ("{text:>9}", r"placeholder \{text:>9\} is not"), ("no field", "names no field"),
                              ("{text", "expected '}' before end of string")]:
        with pytest.raises(ConfigError, match=r"dataset.prompt_template: " + message):
            check_dataset({"path": str(path), "prompt_template": template})
    with pytest.raises(ConfigError, match=r"unset dataset.text_field \(name the field in the template: \{body\}\)"):
        check_dataset({"path": str(path), "prompt_template": "{body}", "text_field": "body"})
    parquet = tables["parquet"][0]
    with pytest.raises(ConfigError, match=r"no column 'title' \(dataset.prompt_template\); columns: text, label"):
        check_dataset({"path": str(parquet), "prompt_template": "{title}: {text}"})


def test_limit_counts_rows_across_shards_in_sorted_order(tables):
    path, options = tables["parquet"]
    dataset = load_dataset(path, limit=150, **options)
    assert [s.sample_idx for s in dataset.samples] == list(range(150))  # 100 rows per shard: crosses into shard 2
    whole = load_dataset(path, **options)
    assert [s.text for s in dataset.samples] == [s.text for s in whole.samples[:150]]


# --- Chat prompts. ---

MESSAGES = [[{"role": "system", "content": "You answer in one word."},
             {"role": "user", "content": f"What does module {name} do?"}] for name in ("codecs", "os", "re", "json")]


def test_chat_prompts_store_the_rendered_tokens_and_lmprobe_text(model_dir, tmp_path):
    from transformers import AutoTokenizer

    from actstore.formats import lmprobe

    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    data = tiny.write_parquet(tmp_path / "chat", pa.table({"messages": MESSAGES, "id": [1, 2, 3, 4]}))
    config = tiny.make_config(tmp_path, chat_model, data, dataset={"messages_field": "messages", "keep_fields": ["id"]},
                              extract={"max_seq_length": 128, "parts": 1})
    check_dataset(config["dataset"])  # the parse-time check needs no tokenizer
    out = tmp_path / "extract"
    run_part(config, 0, out / "part-0000", progress=False)
    write_index(out, out / "extract.json")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in MESSAGES]
    extraction = open_extraction(out)
    for part, local, row in extraction.iter_samples():
        ids = tokenizer.apply_chat_template(MESSAGES[row["sample_idx"]], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        assert row["text"] == rendered[row["sample_idx"]] and row["text"].endswith("assistant:")
        assert part.token_ids(local).tolist() == list(ids)
        assert list(ids).count(tokenizer.bos_token_id) == 3  # the template's own BOS tokens, none added
        assert row["metadata"] == {"id": row["sample_idx"] + 1}
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id  # it would have added one
    lmprobe.write_dataset(out, tmp_path / "lmprobe", {}, progress=False)
    index = pq.read_table(tmp_path / "lmprobe" / "index" / "train-00000-of-00001.parquet").to_pylist()
    assert {r["sample_idx"]: r["text"] for r in index} == dict(enumerate(rendered))


def test_chat_jsonl_renders_like_the_table(model_dir, tmp_path):
    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    lines = tmp_path / "chat.jsonl"
    lines.write_text("".join(json.dumps({"messages": m}) + "\n" for m in MESSAGES))
    no_prompt = load_dataset(lines, model_path=chat_model, messages_field="messages", add_generation_prompt=False)
    assert no_prompt.chat and not no_prompt.samples[0].text.endswith("assistant:")
    assert no_prompt.samples[0].text.startswith("<|endoftext|>system: You answer")


def test_a_chat_template_refusing_a_rows_messages_is_named_with_the_row(model_dir, tmp_path):
    """A chat template that raises (Mistral's and Llama 2's raise_exception when roles do not
    alternate, or for a system turn) is named with the file and line of the row (before: a bare
    jinja2 TemplateError naming no row)."""
    from transformers import AutoTokenizer

    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                               "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                               "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tokenizer.save_pretrained(chat_model)
    lines = tmp_path / "chat.jsonl"
    lines.write_text("".join(json.dumps({"messages": m[1:]}) + "\n" for m in MESSAGES[:2])
                     + json.dumps({"messages": MESSAGES[2]}) + "\n")
    with pytest.raises(ConfigError, match=r"chat\.jsonl:3: the chat template of .*chat-llama refuses these messages "
                                          r"\(Conversation roles must alternate user/assistant\)"):
        load_dataset(lines, model_path=chat_model, messages_field="messages")
    assert load_dataset(lines, model_path=chat_model, messages_field="messages", limit=2).samples[1].text == (
        "user: What does module os do?\n")


def test_sharegpt_conversations_render_as_the_same_role_content_messages(model_dir, tmp_path):
    """ShareGPT's {from, value} turns (FastChat, axolotl and LLaMA-Factory `sharegpt` data), in JSONL
    or a table, render as the {role, content} messages they are (human: user, gpt: assistant); a
    speaker that is no chat role is named."""
    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    shared = [[{"from": speakers[m["role"]], "value": m["content"]} for m in turns + [
        {"role": "assistant", "content": "Encodes."}]] for turns in MESSAGES]
    roles = tmp_path / "roles.jsonl"
    roles.write_text("".join(json.dumps({"messages": [*m, {"role": "assistant", "content": "Encodes."}]}) + "\n"
                             for m in MESSAGES))
    lines = tmp_path / "sharegpt.jsonl"
    lines.write_text("".join(json.dumps({"conversations": c, "id": i}) + "\n" for i, c in enumerate(shared)))
    table = tiny.write_parquet(tmp_path / "sharegpt", pa.table({"conversations": shared}))
    expected = [s.text for s in load_dataset(roles, model_path=chat_model, messages_field="messages").samples]
    assert len(set(expected)) == 4 and all("assistant: Encodes." in text for text in expected)
    for path in (lines, table):
        check_dataset({"path": str(path), "messages_field": "conversations"})
        read = load_dataset(path, model_path=chat_model, messages_field="conversations")
        assert [s.text for s in read.samples] == expected
    lines.write_text(json.dumps({"conversations": [{"from": "bing", "value": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"sharegpt.jsonl:1: message 0: a ShareGPT message from 'bing'; the "
                                          r"speakers that "
                                          r"are chat roles: human, gpt, system, user, assistant"):
        load_dataset(lines, model_path=chat_model, messages_field="conversations")


def test_a_tokenizer_without_a_chat_template_is_named_before_weights_load(model_dir, tmp_path, monkeypatch):
    import actstore.extract.run as ex
    lines = tmp_path / "chat.jsonl"
    lines.write_text(json.dumps({"messages": MESSAGES[0]}) + "\n")
    config = tiny.make_config(tmp_path, model_dir("llama"), lines, dataset={"messages_field": "messages"})
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=f"tokenizer at {model_dir('llama')} has no chat template"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)


# --- Image tables. ---

@pytest.mark.parametrize("storage, with_paths", [("parquet", True), ("parquet", False), ("hf_disk", True)])
def test_an_image_table_extracts_the_image_folder_bytes(storage, with_paths, model_dir, image_folder, tmp_path):
    table = tiny.image_table(image_folder, ["animal", "object"], with_paths)
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    data = (tiny.write_parquet(tmp_path / "images", table, shards=2, row_group_size=3) if storage == "parquet"
            else tiny.write_hf_disk(tmp_path / "images", {"train": table.replace_schema_metadata()}, features))
    folder = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, extract={"batch_size": 3})
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={"batch_size": 3, "num_workers": 2})
    expected, got = part_files(folder, tmp_path / "folder"), part_files(config, tmp_path / "table")
    if not with_paths:  # no path stored: the sample text names the shard and row instead
        texts = [json.loads(line)["text"] for p in got for line in p.pop("samples.jsonl").splitlines()]
        assert texts[:2] == ["train-00000-of-00002.parquet#0", "train-00000-of-00002.parquet#1"]
        [p.pop("samples.jsonl") for p in expected]
    assert got == expected
    assert load_dataset(data).labels == ["animal", "object"]  # ClassLabel names from the Hub metadata


def test_classlabel_names_keep_their_order_and_name_each_row(image_folder, tmp_path):
    table = tiny.image_table(image_folder, ["object", "animal"])  # not sorted: label_id = class index
    dataset = load_dataset(tiny.write_parquet(tmp_path / "images", table))
    assert dataset.labels == ["object", "animal"]
    assert [s.label for s in dataset.samples] == [s.text.split("/")[0] for s in dataset.samples]
    assert dataset.modality == "image" and dataset.samples[0].text == "animal/img_00.png"


def test_an_undecodable_image_in_a_table_names_file_and_column(model_dir, image_folder, tmp_path):
    table = tiny.image_table(image_folder, ["animal", "object"])
    broken = table.set_column(0, "image", pa.array([{"bytes": b"not a png", "path": "x.png"}] * table.num_rows))
    data = tiny.write_parquet(tmp_path / "broken", broken)
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, dataset={"format": "image_table"},
                              extract={"parts": 1, "num_workers": 0})
    with pytest.raises(ConfigError, match=r"train-00000-of-00001.parquet: x.png, column 'image': not a readable image"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)


# --- Errors before weights load (run_part) and at parse time (check_dataset, snakemake -n). ---

@pytest.fixture
def bad_inputs(tables):
    parquet, csv_path, hf = tables["parquet"][0], tables["csv"][0], tables["hf_disk"][0]
    return {
        "missing column": (parquet, {"text_field": "body"},
                           r"train-00000-of-00002.parquet: no column 'body' \(dataset.text_field\)"),
        "missing csv column": (csv_path, {"keep_fields": ["author"]},
                               r"docs.csv: no column 'author' \(dataset.keep_fields\)"),
        "wrong type": (hf, {"text_field": "label"},
                       r"data-00000-of-00002.arrow: column 'label' \(dataset.text_field\) is int64"),
        "missing split": (hf, {"split": "validation"},
                          r"dataset_dict.json: dataset.split 'validation' is not a split .*splits: train, test"),
    }


@pytest.mark.parametrize("case", ["missing column", "missing csv column", "wrong type", "missing split"])
def test_bad_columns_fail_before_weights_load_naming_file_and_column(case, bad_inputs, model_dir, tmp_path,
                                                                     monkeypatch):
    import actstore.extract.run as ex
    path, options, message = bad_inputs[case]
    config = tiny.make_config(tmp_path, model_dir("bert"), path, dataset=options)
    with pytest.raises(ConfigError, match=message):
        check_dataset(config["dataset"])
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=message):
        run_part(config, 0, tmp_path / "part-0000", progress=False)


def test_a_mistyped_image_column_is_named(model_dir, image_folder, tmp_path):
    table = tiny.image_table(image_folder, ["animal", "object"]).append_column("score", pa.array([0.5] * 8))
    data = tiny.write_parquet(tmp_path / "images", table)
    with pytest.raises(ConfigError, match=r"column 'score' \(dataset.image_field\) is double"):
        check_dataset({"path": str(data), "image_field": "score"})


def test_snakemake_dry_run_names_the_missing_column(tables, model_dir, tmp_path):
    config = tiny.make_config(tmp_path, model_dir("bert"), tables["parquet"][0], dataset={"text_field": "body"})
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    proc = subprocess.run([snakemake, "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
                           str(configfile), "--cores", "1", "-n"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "train-00000-of-00002.parquet: no column 'body' (dataset.text_field)" in proc.stdout + proc.stderr


# --- Dataset identity in the extract hash. ---

def test_earlier_configs_keep_their_hash_and_new_sources_hash_their_files(rows, tables, model_dir, image_folder,
                                                                          tmp_path):
    for data in (rows[0], image_folder):  # JSONL file and image folder, no new key: hashed as before
        config = tiny.make_config(tmp_path, model_dir("bert"), data)
        assert stage_payload(config, "extract")["config"]["dataset"] == config["dataset"]
    path, options = tables["parquet"]
    config = tiny.make_config(tmp_path, model_dir("bert"), path, dataset=options)
    assert "data_stat" in stage_payload(config, "extract")["config"]["dataset"]
    stated = tiny.make_config(tmp_path, model_dir("bert"), rows[0], dataset={"identity": "stat"})
    assert "data_stat" in stage_payload(stated, "extract")["config"]["dataset"]
    packed = tmp_path / "rows.jsonl.gz"  # a compressed file earlier releases could not read: hashed by its files
    packed.write_bytes(compressed(Path(rows[0]).read_bytes(), ".gz"))
    config = tiny.make_config(tmp_path, model_dir("bert"), packed)
    assert "data_stat" in stage_payload(config, "extract")["config"]["dataset"]


@pytest.mark.parametrize("identity, touch_changes, edit_changes", [
    (None, True, True), ("stat", True, True), ("content", False, True), ("path", False, False)])
def test_editing_the_data_changes_the_extract_hash(identity, touch_changes, edit_changes, rows, model_dir, tmp_path):
    data = tiny.write_parquet(tmp_path / "data", pa.Table.from_pylist(rows[1][:20]), shards=2)
    shard = data / "train-00001-of-00002.parquet"
    options = {"identity": identity} if identity else {}
    config = tiny.make_config(tmp_path, model_dir("bert"), data, dataset=options)
    before = stage_hash(config, "extract")
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert (stage_hash(config, "extract") != before) == touch_changes
    pq.write_table(pa.Table.from_pylist(rows[1][10:19]), shard)
    assert (stage_hash(config, "extract") != before) == edit_changes



def test_every_stage_hash_lists_and_stats_the_data_once(image_folder, model_dir, tmp_path, monkeypatch):
    """Every stage's hash depends on the data through extract's. Computed together, as a Snakefile
    parse does (in every Slurm job), they list and stat the data once, not once per stage and path:
    at 100,000 images that is ~1 s each time on a local disk, a metadata round trip a file on Lustre."""
    from actstore import hashing
    from actstore.datasets import source

    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, dataset={"identity": "stat"})
    listed, stated = [], []
    real_listing, real_stat = source.files_under, Path.stat
    monkeypatch.setattr(source, "files_under", lambda root: listed.append(root) or real_listing(root))
    monkeypatch.setattr(Path, "stat", lambda path, **kw: stated.append(path) or real_stat(path, **kw))
    dirs = hashing.stage_dirs(config)
    assert listed == [image_folder]
    assert sorted(p for p in stated if p.suffix == ".png") == sorted(image_folder.rglob("*.png"))
    assert dirs["validate"].parent == Path(config["dump_to"]) / "validate"


def test_a_snakefile_parse_lists_the_image_folder_once(image_folder, model_dir, tmp_path, monkeypatch):
    """The parse's checks, hashes and resource requests each resolve the dataset: after
    remember_sources() (rules/common.smk) the folder is listed once for all of them; without it
    (a part's job, the library) every resolve lists afresh, so a change since the scan is seen."""
    from actstore import hashing, resources
    from actstore.datasets import check_dataset, source

    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder)
    listed, real_listing = [], source.files_under
    monkeypatch.setattr(source, "files_under", lambda root: listed.append(root) or real_listing(root))
    monkeypatch.setattr(source, "_REMEMBERED", None)  # this process's, restored after the test
    resolve_source(str(image_folder)), resolve_source(str(image_folder))
    assert len(listed) == 2
    source.remember_sources()
    check_dataset(config["dataset"]), hashing.stage_dirs(config)
    resources.workload(config), resources.extract_scan_threads(config), resources.extract_part_mem_mb(config)
    assert len(listed) == 3


def parse_facts(config: dict, main_process: bool) -> tuple:
    """What a Snakefile parse (rules/common.smk) learns of the dataset: every stage's hash, and the
    Slurm requests that scale with the data."""
    from actstore import resources
    from actstore.workflow import parse_dataset

    return (parse_dataset(config, main_process), resources.workload(config), resources.extract_scan_threads(config),
            resources.extract_part_mem_mb(config), resources.extract_scan_mem_mb(config))


def test_a_jobs_parse_takes_the_main_processs_word_for_the_data(image_folder, model_dir, tmp_path, monkeypatch,
                                                                capsys):
    """Every Slurm job parses the Snakefile again. The main process hands over what its parse learnt of
    the data (parse_memo), so a job's parse neither lists nor stats the folder (1.28M images: ~30 s and
    ~1 GB a parse here) and names its outputs by the main process's hashes even when the data changed
    since; outside a parse (a rule's script, the library) everything is computed afresh."""
    from actstore import hashing, parse_memo, resources
    from actstore.datasets import source

    images = tmp_path / "images"
    shutil.copytree(image_folder, images)
    config = tiny.make_config(tmp_path, model_dir("dinov2"), images, dataset={"identity": "stat"})
    for name, value in (("_memo", None), ("_handed", {}), ("_written", None), ("_REMEMBERED", None)):
        monkeypatch.setattr(source if name == "_REMEMBERED" else parse_memo, name, value)
    monkeypatch.delenv(parse_memo.ENV, raising=False)
    listed, stated, real_listing, real_stat = [], [], source.files_under, Path.stat
    monkeypatch.setattr(source, "files_under", lambda root: listed.append(root) or real_listing(root))
    monkeypatch.setattr(Path, "stat", lambda path, **kw: stated.append(path) or real_stat(path, **kw))

    main = parse_facts(config, main_process=True)
    handed = parse_memo.hand_over(tmp_path / "dump" / "logs" / "parse")
    assert os.environ[parse_memo.ENV] == str(handed) and handed.is_file()
    assert listed == [images]

    picture = next(images.rglob("*.png"))  # touched: the data's stat digest, and so every hash, changes
    os.utime(picture, ns=(picture.stat().st_atime_ns, picture.stat().st_mtime_ns + 10**9))
    for cached in (resources._workload, hashing._auto_format):
        cached.cache_clear()
    monkeypatch.setattr(source, "_REMEMBERED", None)
    listed.clear(), stated.clear()
    assert parse_facts(config, main_process=False) == main  # a job: ACTSTORE_PARSE_MEMO inherited
    assert listed == [] and not [p for p in stated if images in p.parents]
    assert f"the dataset as the main process read it: {handed}" in capsys.readouterr().err

    monkeypatch.setattr(parse_memo, "_memo", None)  # a rule's script: afresh, the data as it is now
    monkeypatch.setattr(parse_memo, "_handed", {})
    monkeypatch.setattr(source, "_REMEMBERED", None)
    assert hashing.stage_hashes(config)["extract"] != main[0]["extract"]

    parse_memo.withdraw()  # the run is over
    assert not handed.exists() and parse_memo.ENV not in os.environ
    monkeypatch.setenv(parse_memo.ENV, str(handed))  # a job whose file is gone reads the data itself
    assert parse_facts(config, main_process=False)[0]["extract"] == hashing.stage_hashes(config)["extract"]
    assert f"{parse_memo.ENV}={handed} cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["parquet", "csv", "arrow", "hf_disk", "parquet_glob", "jsonl_shards", "jsonl_zst"])
def test_slurm_sizing_counts_the_rows_of_every_table_format(kind, tables, rows, model_dir, tmp_path):
    from actstore import resources
    if kind.startswith("jsonl"):  # the same rows cut into two JSONL files, read through a glob
        lines = rows[0].read_text().splitlines(keepends=True)
        suffix = ".zst" if kind == "jsonl_zst" else ""
        for i, shard in enumerate((lines[:N_ROWS // 3], lines[N_ROWS // 3:])):
            (tmp_path / f"docs-{i}.jsonl{suffix}").write_bytes(compressed("".join(shard).encode(), suffix))
        path, options = f"{tmp_path}/docs-*.jsonl{suffix}", {}
    else:
        path, options = tables[kind]
    config = tiny.make_config(tmp_path, model_dir("gpt2"), path, dataset=options)
    load = resources.workload(config)
    assert load.rows == N_ROWS and load.tokens == N_ROWS * config["extract"]["max_seq_length"]
    if kind.startswith("jsonl"):  # the text, decompressed: what the scan reads and a part holds
        assert load.text_bytes == rows[0].stat().st_size
    # The scan's processes: a JSONL file each; a table's scan reads its metadata, in one.
    threads = resources.extract_scan_threads(config)
    assert threads == (2 if kind.startswith("jsonl") else 1)
    assert resources.extract_scan_mem_mb(config, threads=threads) >= resources.extract_scan_mem_mb(config) + \
        (threads - 1) * resources.SCAN_WORKER_MB
    config["dataset"]["limit"] = 7
    assert resources.workload(config).rows == 7 and resources.extract_scan_threads(config) == 1  # one pass, to the limit


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_the_sizing_estimate_reads_the_starts_of_a_few_files_and_scales(suffix, monkeypatch, tmp_path):
    """Every Snakemake parse, on every node, sizes the jobs: a large JSONL dataset is estimated from
    the starts of a few files spread over it (the first and the last among them), within a few
    percent for rows of one kind, and no other file is opened."""
    from actstore.datasets import jsonl

    monkeypatch.setattr(jsonl, "ESTIMATE_FILES", 3)
    monkeypatch.setattr(jsonl, "ESTIMATE_BYTES", 3000)
    files, n = [], 0
    for i in range(10):
        text = "".join(json.dumps({"text": f"row {n + j} " + "word " * (j % 9)}) + "\n" for j in range(400))
        files.append(tmp_path / f"docs-{i:02d}.jsonl{suffix}")
        files[-1].write_bytes(compressed(text.encode(), suffix))
        n += 400
    opened, real_open = [], Path.open
    monkeypatch.setattr(Path, "open", lambda path, *a, **kw: opened.append(path.name) or real_open(path, *a, **kw))
    lines, text = jsonl.size_estimate(tuple(files))
    assert sorted(set(opened)) == [f"docs-{i:02d}.jsonl{suffix}" for i in (0, 4, 9)]
    whole = 0
    for path in files:
        with jsonl.open_text(path) as fh:
            whole += len(fh.read().encode())
    assert abs(lines / n - 1) < 0.1 and abs(text / whole - 1) < 0.1, (lines, n, text, whole)


def tricky_folder(tmp_path: Path) -> Path:
    """Images whose names sort in surprising ways (case, dots, spaces, a folder named like a file's
    stem, so that folder a's images come before and after its subfolder b's), links to a file, to
    a folder and to nothing, a fifo, a file that is no image, and hidden files and folders (a macOS
    ._ copy, __MACOSX/, Jupyter's .ipynb_checkpoints/)."""
    root = tmp_path / "photos"
    names = ["a-b/x.jpg", "a/b.jpg", "a.b/c.jpg", "A/z.jpg", "a/b/c.jpg", "a/b/c/d.png", ".hidden/h.jpg",
             "ü/u.jpg", "a b/s.jpg", "top.jpg", "a/b.jpg.txt", "a0/e.JPG", "a/a.jpg", "a/._a.jpg",
             "__MACOSX/a/._a.jpg", ".ipynb_checkpoints/top-checkpoint.jpg", "a/__init__.jpg"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deep").mkdir(parents=True)
    (elsewhere / "deep" / "y.jpg").write_bytes(b"y")
    (root / "a" / "link.jpg").symlink_to(elsewhere / "deep" / "y.jpg")  # a link to a file: listed
    (root / "linked").symlink_to(elsewhere / "deep")  # a linked folder: not entered
    (root / "a" / "broken.jpg").symlink_to(tmp_path / "gone.jpg")  # a broken link: left out
    os.mkfifo(root / "a" / "pipe.jpg")  # not a file: left out
    return root


def test_an_image_folder_lists_its_files_in_the_order_pathlib_sorts_them(tmp_path):
    """sample_idx = row in path order: the stat-free listing must order and pick exactly the files
    `sorted(p for p in root.rglob("*") if p.is_file())` does, whatever the names and links, less
    what Hugging Face datasets leaves out too: hidden files and folders, and __ folders (a __ file
    is kept, as there)."""
    from actstore.datasets.source import files_under
    root = tricky_folder(tmp_path)
    names = ["a-b/x.jpg", "a/b.jpg", "a.b/c.jpg", "A/z.jpg", "a/b/c.jpg", "a/b/c/d.png",
             "ü/u.jpg", "a b/s.jpg", "top.jpg", "a/b.jpg.txt", "a0/e.JPG", "a/a.jpg", "a/__init__.jpg"]
    expected = sorted(p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(".") or (part.startswith("__") and part != p.name) for part in p.relative_to(root).parts))
    assert files_under(root) == expected
    assert len(expected) == len(names) + 1  # and the link to a file
    assert {p.parts[0] for p in map(lambda p: p.relative_to(root), expected)}.isdisjoint(
        {".hidden", "__MACOSX", ".ipynb_checkpoints"}) and root / "a" / "._a.jpg" not in expected
    assert not {".hidden", "__MACOSX", ".ipynb_checkpoints"} & set(load_dataset(root).labels)  # no such class
    assert [s.text for s in load_dataset(root).samples] == [
        p.relative_to(root).as_posix() for p in expected if p.suffix.lower() in (".jpg", ".png")]
    (root / "locked").mkdir()
    (root / "locked").chmod(0)
    try:
        if not os.access(root / "locked", os.R_OK):  # root reads it anyway
            with pytest.raises(ConfigError, match="cannot list .*locked"):
                files_under(root)
    finally:
        (root / "locked").chmod(0o755)


def test_an_image_folder_part_lists_only_the_folders_of_its_rows(tmp_path, monkeypatch):
    """A part's job of a folder of images reads its rows from the scan's runs (consecutive images of
    one folder): it lists only the folders of its rows, each once and not into its subfolders, and
    gets the samples the whole listing gives, in any number of parts, through the scan file too."""
    from actstore.datasets import source

    root = tricky_folder(tmp_path)
    whole = flat(load_dataset(root))
    write_scan(scan_dataset(root), tmp_path / "scan.json")
    scan = read_scan(tmp_path / "scan.json")
    folders = [folder for folder, _, _ in scan.runs]
    assert folders.count("a") == 2 and "" in folders and sum(count for _, count, _ in scan.runs) == len(whole)
    assert scan_dataset(f"{root}/*/*.jpg", format="image_folder").runs == ()  # not the folders' listings
    listed, scandir = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(Path(path)) or scandir(path))
    monkeypatch.setattr(source, "files_under", lambda folder: pytest.fail(f"{folder} listed whole"))
    for parts in (1, 2, 3, 4, 7):  # none empty (13 images): an empty part has no last sample to open
        read = []
        for part in range(parts):
            listed.clear()
            dataset = load_dataset(root, parts=(parts, part), scan=scan)
            assert sorted(listed) == sorted({(root / s.text).parent for s in dataset.samples})
            assert dataset.n_samples == len(whole)
            with pytest.raises(ConfigError, match=re.escape(f"{root / dataset.samples[-1].text}: cannot decode")):
                dataset.opener(dataset.samples[-1])  # opened by its name in the root (the files hold no image)
            read += flat(dataset)
        assert read == whole


def test_an_image_folder_part_read_from_the_scan_file_extracts_the_same_bytes(model_dir, image_folder, tmp_path):
    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, extract={"batch_size": 3})
    write_scan(scan_dataset(image_folder), tmp_path / "scan.json")
    for part in range(config["extract"]["parts"]):
        outs = [tmp_path / where / f"part-{part:04d}" for where in ("listed", "runs")]
        run_part(config, part, outs[0], progress=False)
        run_part(config, part, outs[1], progress=False, scan=tmp_path / "scan.json")
        listed, runs = ({p.name: p.read_bytes() for p in out.iterdir() if p.name != "part.json"} for out in outs)
        assert listed == runs and len(listed) >= 4


def test_an_image_folder_part_refuses_its_folders_changed_since_the_scan(image_folder, tmp_path):
    """Each part checks the folders it reads against the scan (their images' count and names), so the
    parts together check every folder; a folder turned into a link, or gone, is named; a scan
    file naming a folder outside the dataset is refused; a scan without runs (earlier releases)
    reads as before, checking the whole listing."""
    import shutil

    photos = shutil.copytree(image_folder, tmp_path / "photos")  # animal: rows 0-3, object: rows 4-7
    scan = scan_dataset(photos)
    (photos / "animal" / "img_00.png").rename(photos / "animal" / "img_99.png")
    assert len(load_dataset(photos, parts=(2, 1), scan=scan).samples) == 4  # object's folder is as scanned
    with pytest.raises(ConfigError, match=r"photos/animal: its files changed since the dataset was scanned; "
                                          r"scan it again \(the workflow: snakemake --forcerun extract_scan\)"):
        load_dataset(photos, parts=(2, 0), scan=scan)
    (photos / "object" / "img_00.png").unlink()
    with pytest.raises(ConfigError, match=r"photos/object: its files changed .* \(3 files, 4 when scanned\)"):
        load_dataset(photos, parts=(2, 1), scan=scan)
    shutil.rmtree(photos / "object")
    with pytest.raises(ConfigError, match=r"photos/object: its files changed .* \(gone\)"):
        load_dataset(photos, parts=(2, 1), scan=scan)
    (photos / "object").symlink_to(image_folder / "object")
    with pytest.raises(ConfigError, match=r"photos/object: its files changed .* \(no longer a folder\)"):
        load_dataset(photos, parts=(2, 1), scan=scan)
    write_scan(scan, tmp_path / "scan.json")
    data = json.loads((tmp_path / "scan.json").read_text())
    for folder in ("../outside", "/etc", "object/../..", "object//x"):
        (tmp_path / "bad.json").write_text(json.dumps(data | {"runs": [[folder, 8, "0" * 64]]}))
        with pytest.raises(FormatError, match=r"bad\.json: runs must be a list of \[folder inside the dataset"):
            read_scan(tmp_path / "bad.json")
    old = {k: v for k, v in data.items() if k not in ("runs", "folder_format", "sealed")}  # unsealed, as scans were
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError, match=r"photos: its files changed since the dataset was scanned"):
        load_dataset(photos, parts=(2, 0), scan=read_scan(tmp_path / "old.json"))


# --- An image folder's metadata file (Hugging Face's imagefolder convention). ---

CAPTIONS = {"animal": "a cat, cropped", "object": "a thing, cropped"}


def write_metadata(photos: Path, suffix: str, rows: list[dict]) -> Path:
    """metadata.jsonl or metadata.csv at the folder's root, the rows in the order given; the CSV as
    Excel saves it, with a byte order mark."""
    path = photos / f"metadata{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        with open(path, "w", newline="", encoding="utf-8-sig") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def described_photos(image_folder: Path, tmp_path: Path, suffix: str) -> tuple[Path, list[dict]]:
    """A copy of the photos with a metadata file: a row per image, newest image first (the file's
    order is not the samples'), a caption, a kind (the label to probe for) and a size as text."""
    photos = shutil.copytree(image_folder, tmp_path / "photos")
    names = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.png"))
    rows = [{"file_name": name, "caption": f"{CAPTIONS[name.split('/')[0]]} #{i}",
             "kind": "striped" if i % 3 == 0 else "plain", "size": str(i * 10)} for i, name in enumerate(names)]
    write_metadata(photos, suffix, rows[::-1])
    return photos, rows


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_an_image_folder_metadata_file_gives_each_image_its_fields_and_label(suffix, image_folder, model_dir,
                                                                            tmp_path):
    """Each image gets its own row's fields (every one but file_name, or dataset.keep_fields) and,
    with dataset.label_field, its label from the row instead of its folder; samples stay in path
    order; each part reads the rows of its images; the extraction's samples carry them."""
    photos, rows = described_photos(image_folder, tmp_path, suffix)
    whole = load_dataset(photos)
    assert [(s.text, s.label, s.metadata) for s in whole.samples] == [
        (r["file_name"], r["file_name"].split("/")[0], {k: r[k] for k in ("caption", "kind", "size")}) for r in rows]
    probed = load_dataset(photos, label_field="kind", keep_fields=["caption"])
    assert probed.labels == ["plain", "striped"]
    assert [(s.label, s.metadata) for s in probed.samples] == [(r["kind"], {"caption": r["caption"]}) for r in rows]
    scan = scan_dataset(photos, label_field="kind", keep_fields=["caption"])
    assert scan.metadata == f"metadata{suffix}" and scan.labels == ["plain", "striped"]
    parts = [load_dataset(photos, parts=(3, p), scan=scan, label_field="kind", keep_fields=["caption"]) for p in range(3)]
    assert [flat(d) for d in parts] == [flat(d) for d in (load_dataset(photos, parts=(3, p), label_field="kind",
                                                                       keep_fields=["caption"]) for p in range(3))]
    assert sum((flat(d) for d in parts), []) == flat(probed)

    config = tiny.make_config(tmp_path, model_dir("dinov2"), photos, dataset={"label_field": "kind"},
                              extract={"batch_size": 3})
    write_scan(scan_dataset(photos, label_field="kind"), tmp_path / "scan.json")
    run_part(config, 1, tmp_path / "part-0001", progress=False, scan=tmp_path / "scan.json")
    stored = [json.loads(line) for line in (tmp_path / "part-0001" / "samples.jsonl").read_text().splitlines()]
    assert [(r["sample_idx"], r["text"], r["label"], r["label_id"], r["metadata"]) for r in stored] == [
        (i, rows[i]["file_name"], rows[i]["kind"], ["plain", "striped"].index(rows[i]["kind"]),
         {k: rows[i][k] for k in ("caption", "size")}) for i in range(4, 8)]


def test_an_image_folder_metadata_file_is_checked_against_every_image(image_folder, model_dir, tmp_path):
    """An image without a row, a row for no image, a second row, a row without file_name or a field
    the config reads, and lines that are not rows are each named with file and line; a metadata file
    below the root (it would be left out) or two of them are refused, as are label and kept fields
    for a folder without one; a part refuses the file changed since the scan; and the file is part of
    the data the extract hash records."""
    photos, rows = described_photos(image_folder, tmp_path, ".jsonl")
    path = photos / "metadata.jsonl"
    cases = [
        (rows[1:], r"metadata\.jsonl: no row for the image 'animal/img_00\.png' \(1 images have none\)"),
        (rows + [{"file_name": "animal/img_09.png"}], r"metadata\.jsonl:9: file_name 'animal/img_09\.png' is not an image"),
        (rows + [rows[2]], r"metadata\.jsonl:9: a second row for 'animal/img_02\.png'"),
        ([*rows[:3], {"caption": "x"}, *rows[3:]], r"metadata\.jsonl:4: no 'file_name' naming the image"),
        ([*rows[:5], {**rows[5], "kind": ["a"]}, *rows[6:]], r"metadata\.jsonl:6: field 'kind' is a JSON list"),
        ([*rows[:6], {k: v for k, v in rows[6].items() if k != "kind"}, *rows[7:]],
         r"metadata\.jsonl:7: no field 'kind' \(dataset\.label_field\)"),
    ]
    for written, error in cases:
        write_metadata(photos, ".jsonl", written)
        with pytest.raises(ConfigError, match=error):
            scan_dataset(photos, label_field="kind")
    path.write_text(json.dumps(rows[0]) + "\n[1]\n")
    with pytest.raises(ConfigError, match=r"metadata\.jsonl:2: not a JSON object"):
        scan_dataset(photos)
    path.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"metadata\.jsonl:2: not valid JSON"):
        scan_dataset(photos)
    path.unlink()
    csv_path = write_metadata(photos, ".csv", [{"name": r["file_name"], "caption": r["caption"]} for r in rows])
    with pytest.raises(ConfigError, match=r"metadata\.csv: the header names no 'file_name' column"):
        scan_dataset(photos)
    csv_path.write_text("file_name,caption\nanimal/img_00.png,a,b\n")
    with pytest.raises(ConfigError, match=r"metadata\.csv:2: more values than the header has columns"):
        scan_dataset(photos)
    csv_path.unlink()

    with pytest.raises(ConfigError, match=r"dataset\.label_field: .*photos is an image folder without a metadata "
                                          r"file \(metadata\.jsonl or metadata\.csv at its root\)"):
        check_dataset({"path": str(photos), "label_field": "kind"})
    write_metadata(photos / "animal", ".jsonl", rows[:4])
    with pytest.raises(ConfigError, match=r"animal/metadata\.jsonl is a metadata file below the folder's root"):
        check_dataset({"path": str(photos)})
    (photos / "animal" / "metadata.jsonl").unlink()
    write_metadata(photos, ".jsonl", rows), write_metadata(photos, ".csv", rows)
    with pytest.raises(ConfigError, match=r"holds both metadata\.csv and metadata\.jsonl; keep one"):
        check_dataset({"path": str(photos)})
    (photos / "metadata.csv").unlink()

    scan = scan_dataset(photos)
    write_metadata(photos, ".jsonl", [{**r, "caption": "edited"} for r in rows])
    for scanned in (scan, None):  # from the scan's runs, and from a scan taken now: the rows as edited
        if scanned:
            with pytest.raises(ConfigError, match=r"metadata\.jsonl: changed since the dataset was scanned"):
                load_dataset(photos, parts=(2, 1), scan=scanned)
        else:
            assert {s.metadata["caption"] for s in load_dataset(photos, parts=(2, 1)).samples} == {"edited"}

    config = tiny.make_config(tmp_path, model_dir("dinov2"), photos)  # no new key, but a file earlier releases
    assert "data_stat" in stage_payload(config, "extract")["config"]["dataset"]  # did not read: hashed by its files
    before = stage_hash(config, "extract")
    write_metadata(photos, ".jsonl", rows)
    assert stage_hash(config, "extract") != before


# --- Part jobs: each reads its own rows; sample_idx and label ids stay those of the whole dataset. ---

def flat(dataset) -> list[tuple]:
    return [(s.sample_idx, s.text, s.label, s.metadata, s.ref) for s in dataset.samples]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "arrow", "hf_disk", "parquet_glob", "images",
                                  "image_table"])
@pytest.mark.parametrize("limit", [None, 5, 150])
def test_the_parts_rows_are_the_whole_datasets_rows_in_order(kind, limit, rows, tables, image_folder, tmp_path):
    """Loading part p of P gives exactly rows part_range(N, P, p) of the whole dataset (text, label,
    kept fields, image block reference), with the whole dataset's row count and label list."""
    if kind in tables:
        path, options = tables[kind]
    elif kind == "image_table":  # row groups of 3 images: parts start and end inside blocks
        table = tiny.image_table(image_folder, ["object", "animal"])
        path, options = tiny.write_parquet(tmp_path / "images", table, row_group_size=3), {}
    else:
        path, options = {"jsonl": rows[0], "images": image_folder}[kind], {}
    whole = load_dataset(path, limit, **options)
    assert [s.sample_idx for s in whole.samples] == list(range(whole.n_samples))
    write_scan(scan_dataset(path, limit, **options), tmp_path / "scan.json")
    for parts in (2, 3, 7):
        read = []
        for part in range(parts):
            scan = read_scan(tmp_path / "scan.json") if part % 2 else None  # the workflow's, or scanned here
            dataset = load_dataset(path, limit, parts=(parts, part), scan=scan, **options)
            assert (dataset.n_samples, dataset.labels) == (whole.n_samples, whole.labels)
            assert [s.sample_idx for s in dataset.samples] == list(part_range(whole.n_samples, parts, part))
            read += flat(dataset)
        assert read == flat(whole)


def test_a_part_job_holds_its_rows_not_the_dataset(model_dir, tmp_path):
    """A part's job parses every line once for the row count and labels, keeping none: its peak
    follows its part, and stays under the share extract_part_mem_mb counts for it."""
    from actstore import resources
    path = tmp_path / "long.jsonl"
    with path.open("w") as fh:
        for i in range(4000):
            fh.write(json.dumps({"text": f"row {i} " + "word " * 200, "label": f"class-{i % 7}", "n": i}) + "\n")

    def peak(parts: int, part: int) -> int:
        dataset, held = tiny.traced_peak(lambda: load_dataset(path, parts=(parts, part)))
        assert dataset.labels == [f"class-{i}" for i in range(7)]
        return held

    config = tiny.make_config(tmp_path, model_dir("gpt2"), path, extract={"parts": 8})
    part_peak, whole_peak = peak(8, 3), peak(1, 0)
    assert part_peak < resources.dataset_bytes(config)
    assert whole_peak > 5 * part_peak, (whole_peak, part_peak)


def compressed(data: bytes, suffix: str) -> bytes:
    """`data` as a .gz or .zst file holds it ("": as it is)."""
    import gzip

    import zstandard
    return {"": lambda: data, ".gz": lambda: gzip.compress(data),
            ".zst": lambda: zstandard.ZstdCompressor().compress(data)}[suffix]()


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_the_scan_names_a_bad_line_anywhere_in_a_jsonl(suffix, tmp_path):
    """The row count and labels come from every line, so the scan (the workflow's, before any part's
    job; or a part's own) stops at a bad line in the last part, naming it; a label that is a list,
    or bytes that are not UTF-8, too; in a compressed file alike, and a damaged one is named."""
    cases = {'{"text": "x", "label": ["a", "b"]}': r"bad.jsonl%s:4: field 'label' is a JSON list; a label is a string",
             '{"label": "x"}': r"bad.jsonl%s:4: line has no string field 'text'",
             "not json": r"bad.jsonl%s:4: not valid JSON",
             '{"text": "caf\xe9"}': r"bad.jsonl%s:4: not UTF-8 text \(byte 14 of the line"}
    path = tmp_path / f"bad.jsonl{suffix}"
    for line, message in cases.items():
        path.write_bytes(compressed(b"".join(b'{"text": "fine %d"}\n' % i for i in range(3)) + line.encode("latin-1")
                                    + b"\n", suffix))
        for read in (scan_dataset, lambda p: load_dataset(p, parts=(4, 0))):
            with pytest.raises(ConfigError, match=message % suffix.replace(".", r"\.")):
                read(path)
    if suffix:  # cut short: the stream ends before its end marker
        path.write_bytes(compressed(b'{"text": "fine"}\n' * 1000, suffix)[:-9])
        with pytest.raises(ConfigError, match=rf"bad\.jsonl\{suffix}: cannot be decompressed after line \d+"):
            scan_dataset(path)


@pytest.mark.parametrize("suffix", ["", ".zst"])
def test_a_json_array_reads_as_the_same_rows_in_jsonl(suffix, rows, jsonl_parts, model_dir, tmp_path):
    """A file holding one JSON array of objects (Alpaca's alpaca_data.json, ShareGPT dumps), pretty
    printed or on one line, plain or compressed, is read element by element: the same samples and
    extraction bytes as the rows in JSON lines; the scan's marks fall between elements, and every
    part read from them is the whole read's share."""
    pretty = tmp_path / f"pretty.json{suffix}"
    pretty.write_bytes(compressed(json.dumps(rows[1], indent=2, ensure_ascii=False).encode(), suffix))
    one_line = tmp_path / "one_line.json"
    one_line.write_text(" [" + ",".join(json.dumps(r) for r in rows[1]) + "]\n")
    from actstore import resources

    config = tiny.make_config(tmp_path, model_dir("gpt2"), pretty)
    assert part_files(config, tmp_path / "parts") == jsonl_parts
    whole = flat(load_dataset(rows[0]))
    for path in (pretty, one_line):
        source = resolve_source(str(path))
        assert source.format == "jsonl" and flat(load_dataset(path)) == whole
        # The Slurm sizing counts elements, not lines (one line holds them all, or an element spans 6).
        assert resources.workload(tiny.make_config(tmp_path, model_dir("gpt2"), path)).rows == N_ROWS
        scan = stamped(scan_jsonl(source.files, Fields(), None, mark_chars=3000), source)
        assert len(scan.marks) > 10
        for parts in (1, 4, 7):
            assert [r for part in range(parts) for r in flat(load_dataset(path, parts=(parts, part), scan=scan))] \
                == whole


def test_a_json_array_read_a_few_bytes_at_a_time_gives_the_same_rows_and_marks(tmp_path, monkeypatch):
    """Elements, multi-byte characters and numbers cut by the read's chunks; the text dropped as it
    is passed: the same rows, and marks (byte positions) from which every part reads its share. The
    file starts with a UTF-8 byte order mark, as Windows saves it."""
    from actstore.datasets import json_array

    rows = [{"text": f"row {i} " + "\u00e9\u4e16" * (i % 4), "label": i % 3, "n": 10 ** (i % 7)} for i in range(40)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8-sig")
    whole = flat(load_dataset(path))
    assert [(text, label, meta) for _, text, label, meta, _ in whole] == [(r["text"], r["label"], {"n": r["n"]})
                                                                            for r in rows]
    monkeypatch.setattr(json_array, "CHUNK", 7)
    source = resolve_source(str(path))
    scan = stamped(scan_jsonl(source.files, Fields(), None, mark_chars=60), source)
    assert len(scan.marks) > 15 and flat(load_dataset(path)) == whole
    for parts in (3, 40):
        assert [r for part in range(parts) for r in flat(load_dataset(path, parts=(parts, part), scan=scan))] == whole


def test_a_long_json_array_element_is_parsed_a_few_times_not_once_a_chunk(tmp_path, monkeypatch):
    """An element (a whole book in one row) was parsed again from its start after every chunk read:
    quadratic, 3 s for a 64 MiB element, minutes for 200 MB. The text read for it doubles each time:
    a few parses, the values json.loads gives, and one longer than MAX_ELEMENT_CHARS still named."""
    from actstore.datasets import json_array

    rows = [{"text": "w\u00e9\u4e16 " * 300000, "nested": [[i, {"k": "v" * i}] for i in range(300)]},
            {"text": "short", "n": 12345}, 3.25e10, "\U0001f600" * 70000]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    expected = json.loads(path.read_text(encoding="utf-8"))
    parses = []
    raw_decode = json.JSONDecoder.raw_decode
    monkeypatch.setattr(json.JSONDecoder, "raw_decode", lambda self, s, i=0: parses.append(i) or raw_decode(self, s, i))
    for chunk in (json_array.CHUNK, 4096):  # 2 MB: a few chunks; 4096 bytes: 500 of them
        monkeypatch.setattr(json_array, "CHUNK", chunk)
        parses.clear()
        with path.open("rb") as fh:
            assert [value for _, value, _, _ in json_array.elements(fh)] == expected
        assert len(parses) < 30, len(parses)  # a parse a chunk: 597 for 4096 bytes
    monkeypatch.setattr(json_array, "MAX_ELEMENT_CHARS", 100000)
    with path.open("rb") as fh, pytest.raises(json_array.ArrayError, match=r"element 1 \(byte 1\): not valid JSON "
                                                                          r"\(longer than 100000 characters"):
        next(json_array.elements(fh))


@pytest.mark.slow
def test_a_json_array_is_scanned_and_read_in_bounded_memory(tmp_path):
    """The scan of an array on one line holds a few chunks of it, however long the file (json.load
    held 2.5x the file); a part's job holds its rows and the chunks it reads through."""
    def peaks(rows: int) -> tuple[int, int, int]:
        path = tmp_path / f"{rows}.json"
        path.write_text(json.dumps([{"text": f"row {i} " + "word " * 100, "label": i % 3} for i in range(rows)]))
        scan, scan_peak = tiny.traced_peak(lambda: scan_dataset(path))
        part, part_peak = tiny.traced_peak(lambda: load_dataset(path, parts=(8, 5), scan=scan))
        assert scan.n_samples == rows and len(part.samples) == rows // 8
        return path.stat().st_size, scan_peak, part_peak

    small, large = peaks(24000), peaks(96000)  # 12.9 MB and 51.4 MB on one line: scan peaks 6.4 and 6.3 MB
    assert large[1] < small[1] + (1 << 20) and large[1] < large[0] / 6, (small, large)
    assert large[2] < 2 * large[0] / 8 + small[1], (small, large)  # its rows' text, twice, and the chunks


def test_a_json_array_that_is_not_one_is_named_with_its_element(tmp_path):
    path = tmp_path / "data.json"
    good = [{"text": f"row {i}", "label": i % 2} for i in range(5)]
    cases = {json.dumps(good)[:-30]: r"element 5 \(byte \d+\): not valid JSON \(the file ends inside it",
             json.dumps(good)[:-1] + " ": r"after element 5 \(byte \d+\): expected , or \], the file ends",
             json.dumps(good).replace("}, {", "} {", 1): r"after element 1 \(byte 31\): expected , or \], found '\{'",
             json.dumps(good) + " []": r"byte \d+: '\[' after the array's closing \]",
             json.dumps(good[:2] + [3]): r"data.json: element 3: element is not a JSON object",
             json.dumps(good[:2] + [{"label": 1}]): r"data.json: element 3: element has no string field 'text'"}
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            scan_dataset(path)
    path.write_text("[]")
    with pytest.raises(ConfigError, match="holds no samples"):
        scan_dataset(path)
    path.write_text(json.dumps(good, indent=1))
    assert scan_dataset(path, limit=2).n_samples == 2


def awkward_jsonl(root: Path, suffix: str = "") -> Path:
    """Three JSONL files with blank lines (first, last, doubled, whitespace only), CRLF endings,
    non-ASCII text, a UTF-8 byte order mark (as Windows saves) and a file of blank lines only: rows
    start at every kind of place. `suffix`: .gz or .zst files."""
    root.mkdir()
    rows = [{"text": f"row {i} " + "\u00e9\u4e16" * (i % 5), "label": f"l{i % 3}", "i": i} for i in range(60)]
    lines = [json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(rows)]
    for name, text in [("a", "\n" + "\n\n".join(lines[:25]) + "\n  \n"),
                       ("b", "\r\n".join(lines[25:40])),  # no final newline
                       ("c", "\n\n"), ("d", "\ufeff" + "\n".join(lines[40:]) + "\n")]:
        (root / f"{name}.jsonl{suffix}").write_bytes(compressed(text.encode(), suffix))
    return root


def test_compressed_json_lines_read_as_the_text_they_hold(tmp_path):
    """A folder of .jsonl.gz, .json.zst and plain .jsonl shards (the Pile, C4, Dolma) reads as its
    text does, in sorted path order; other compressed files are not data; a glob picks its own."""
    lines = [json.dumps({"text": f"row {i}", "label": i % 2}) + "\n" for i in range(30)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(lines))
    folder = tmp_path / "shards"
    folder.mkdir()
    shards = [("a.jsonl", ".gz", lines[:10]), ("b.json", ".zst", lines[10:25]), ("c.jsonl", "", lines[25:])]
    for name, suffix, part in shards:
        (folder / f"{name}{suffix}").write_bytes(compressed("".join(part).encode(), suffix))
    (folder / "notes.txt.gz").write_bytes(compressed(b"not data", ".gz"))
    source = resolve_source(str(folder), "auto", "train")
    assert source.format == "jsonl" and [p.name for p in source.files] == ["a.jsonl.gz", "b.json.zst", "c.jsonl"]

    def samples(dataset) -> list:
        return [(s.sample_idx, s.text, s.label) for s in dataset.samples]

    assert samples(load_dataset(folder)) == samples(load_dataset(plain))
    assert samples(load_dataset(folder, parts=(3, 1))) == samples(load_dataset(plain, parts=(3, 1)))
    assert [s.text for s in load_dataset(str(folder / "*.zst")).samples] == [f"row {i}" for i in range(10, 25)]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_csv_reads_as_the_plain_csv_and_a_cut_file_is_named(suffix, tmp_path):
    text = "text,label\n" + "".join(f"row {i},{i % 3}\n" for i in range(3000))
    (tmp_path / "docs.csv").write_text(text)
    (tmp_path / f"docs.csv{suffix}").write_bytes(compressed(text.encode(), suffix))

    def samples(dataset) -> list:
        return [(s.sample_idx, s.text, s.label) for s in dataset.samples]

    for parts in [None, (3, 1)]:
        assert samples(load_dataset(tmp_path / f"docs.csv{suffix}", parts=parts)) == \
               samples(load_dataset(tmp_path / "docs.csv", parts=parts))
    (tmp_path / f"cut.csv{suffix}").write_bytes(compressed(text.encode(), suffix)[:-20])
    with pytest.raises(ConfigError, match=rf"cut\.csv\{suffix}: cannot read as csv"):
        scan_dataset(tmp_path / f"cut.csv{suffix}")


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
@pytest.mark.parametrize("limit", [None, 33])
def test_a_part_read_from_the_scans_marks_is_the_same_rows(limit, suffix, tmp_path):
    """Marks every few lines (the scan marks every MARK_CHARS of text; 40 characters here) land
    after blank lines, at file ends and inside CRLF files: every part read from the mark before it,
    after the scan went through its file, is the rows the whole read gives, named by their lines;
    in .gz and .zst files too, whose marks are positions in the decompressed text."""
    root = awkward_jsonl(tmp_path / "docs", suffix)
    whole = load_dataset(root, limit)
    assert [s.metadata["i"] for s in whole.samples] == list(range(limit or 60))
    source = resolve_source(str(root), "auto", "train")
    files = source.files
    scan = stamped(scan_jsonl(files, Fields(), limit, mark_chars=40), source)
    assert len(scan.marks) > 20 and any(m.file == 1 for m in scan.marks)
    for mark in scan.marks:  # a mark's line: the lines before its position (errors name lines from it)
        with open_text(files[mark.file]) as fh, open_text(files[mark.file]) as whole_file:
            fh.seek(mark.position)
            rest, text = fh.read(), whole_file.read()
        before = text[:len(text) - len(rest)]
        assert text.endswith(rest) and before.count("\n") + (before[-1:] not in ("", "\n")) == mark.line
    write_scan(scan, tmp_path / "scan.json")
    assert read_scan(tmp_path / "scan.json") == scan
    for parts in (1, 4, 7, 60):
        read = [s for part in range(parts) for s in load_dataset(root, limit, parts=(parts, part),
                                                                  scan=read_scan(tmp_path / "scan.json")).samples]
        assert [(s.sample_idx, s.text, s.label, s.metadata) for s in read] == \
               [(s.sample_idx, s.text, s.label, s.metadata) for s in whole.samples]
    with open_text(root / f"b.jsonl{suffix}") as fh:
        changed = fh.read().replace("row 30", "row XX").encode()
    (root / f"b.jsonl{suffix}").write_bytes(compressed(changed, suffix))
    with pytest.raises(ConfigError, match=rf"b\.jsonl{re.escape(suffix)}: changed since the dataset was scanned"):
        load_dataset(root, limit, parts=(4, 3), scan=scan)


@pytest.mark.parametrize("suffix", ["", ".zst"])
def test_files_scanned_at_once_give_the_one_pass_rows_labels_and_errors(suffix, tmp_path):
    """The workflow's scan takes a corpus's JSONL files one per process (extract_scan's threads):
    the joined scan counts the rows and labels one pass counts (1 and "1", in two files, in the
    order they first appear), every part read from its marks is the whole read's rows, a file of
    blank lines only is passed over, and of two bad files the first in order is named; with a
    limit, one pass stops there and reads nothing after it."""
    root = awkward_jsonl(tmp_path / "docs", suffix)
    for name, label in (("0", 1), ("e", "1")):
        row = json.dumps({"text": name, "label": label}).encode()
        (root / f"{name}.jsonl{suffix}").write_bytes(compressed(row, suffix))
    one_pass, at_once = scan_dataset(root), scan_dataset(root, workers=3)
    assert (at_once.n_samples, at_once.labels) == (one_pass.n_samples, one_pass.labels) == \
           (62, [1, "1", "l0", "l1", "l2"])
    assert sorted({m.file for m in at_once.marks if m.position == 0}) == list(range(6))  # each file from its start
    whole = load_dataset(root)
    for parts in (1, 4, 7, 62):
        read = [s for part in range(parts) for s in load_dataset(root, parts=(parts, part), scan=at_once).samples]
        assert [(s.sample_idx, s.text, s.label, s.metadata) for s in read] == \
               [(s.sample_idx, s.text, s.label, s.metadata) for s in whole.samples]
    for name in ("d", "b"):
        with open_text(root / f"{name}.jsonl{suffix}") as fh:
            text = fh.read()
        (root / f"{name}.jsonl{suffix}").write_bytes(compressed(text.replace('"text"', '"txt"', 1).encode(), suffix))
    with pytest.raises(ConfigError, match=rf"b\.jsonl{re.escape(suffix)}:1: line has no string field 'text'"):
        scan_dataset(root, workers=3)
    assert scan_dataset(root, limit=26, workers=3).n_samples == 26  # 0.jsonl's row and a.jsonl's 25, before b's


def test_data_changed_since_the_scan_is_refused_by_a_part(tables, image_folder, tmp_path):
    """Rows found from a scan of data that changed since would be other rows, silently: a part's job
    refuses a data file whose size or mtime changed (naming it), a table folder with a file more,
    and an image folder whose listing changed."""
    import shutil

    shards = shutil.copytree(tables["parquet"][0], tmp_path / "parquet")
    photos = shutil.copytree(image_folder, tmp_path / "photos")
    for path, change, message in [
            (shards, lambda: os.utime(next(shards.glob("*00001*")), ns=(1, 1)), r"00001-of-00002\.parquet: changed since"),
            (shards, lambda: shutil.copy(next(shards.glob("*00001*")), shards / "train-00002.parquet"),
             r"holds 3 data files, 2 when the dataset was scanned"),
            (photos, lambda: (photos / "object" / "img_00.png").rename(photos / "moved.png"),
             r"photos/object: its files changed since the dataset was scanned")]:
        refused_once_changed(path, change, message)


def refused_once_changed(path: Path, change, message: str) -> None:
    """A part read from a scan of `path` reads; after `change()` it is refused with `message`."""
    scan = scan_dataset(path)
    load_dataset(path, parts=(2, 1), scan=scan)
    change()
    with pytest.raises(ConfigError, match=message + r".*snakemake --forcerun extract_scan"):
        load_dataset(path, parts=(2, 1), scan=scan)


def test_a_damaged_scan_file_is_named_not_read(tmp_path):
    """A scan that is not JSON, counts nothing, or whose marks do not start at the first row is a
    FormatError naming the file and the field."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(5)))
    write_scan(scan_dataset(path), tmp_path / "scan.json")
    good = json.loads((tmp_path / "scan.json").read_text())
    cases = {"truncated": (None, "not valid JSON"), "n_samples": (0, "n_samples must be a whole number"),
             "labels": ("a", "labels must be a list"), "marks": ([[1, 0, 0, 0]], "marks must start at row 0"),
             "stamps": ([[-1, 2]], "stamps must be a list of lists of 2 whole numbers"),
             "listing": (None, "listing must be a string")}
    for field, (value, message) in cases.items():
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps(good)[:20] if field == "truncated" else json.dumps(good | {field: value}))
        with pytest.raises(FormatError, match=rf"{bad.name}: {message}"):
            read_scan(bad)


def test_labels_equal_as_text_are_numbered_alike_in_every_process(tmp_path):
    """label_id = position in the sorted label list (integers first); the same in every process (a
    set's order changed with each process's string hashing)."""
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": "t", "label": label}) + "\n" for label in ["b", "1", 1, "a", 1, None]))
    script = "from actstore.datasets import load_dataset; import sys; print(load_dataset(sys.argv[1]).labels)"
    seen = {subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(6)}
    assert seen == {"[1, '1', 'a', 'b']\n"}


@pytest.mark.parametrize("options, row", [({}, {"text": "a lone \ud800 surrogate"}),
                                          ({"prompt_template": "Q: {q}"}, {"q": "bad \udfff"}),
                                          ({}, {"label": "a lone \ud800", "text": "fine"})])
def test_a_text_with_an_unpaired_surrogate_is_named_by_the_scan(options, row, tmp_path):
    """JSON's \\ud800 escape parses to a lone surrogate, which no tokenizer encodes (a TypeError that
    names no row) and no writer stores as a label name (pyarrow's UnicodeEncodeError, after the model
    ran): the scan names the line and field; an escaped pair (an emoji) is fine."""
    path = tmp_path / "scraped.jsonl"
    good = {name: "ok \U0001F600 \u00e9" for name in row}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    assert "\\ud83d\\ude00" in path.read_text()  # json.dumps escapes the emoji as a surrogate pair
    name = next(iter(row))
    with pytest.raises(ConfigError, match=rf"scraped.jsonl:2: field {name!r} holds an unpaired surrogate"):
        scan_dataset(path, **options)
    path.write_text(json.dumps(good) + "\n")
    assert scan_dataset(path, **options).n_samples == 1


def test_a_chat_with_an_unpaired_surrogate_is_named_when_rendered(model_dir, tmp_path):
    """A message's content with a lone surrogate: the rendered chat is named with its line."""
    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": "fine"}]}, {"messages": [{"role": "user", "content": "x \ud800"}]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ConfigError, match=r"chats.jsonl:2: the rendered chat holds an unpaired surrogate"):
        load_dataset(path, model_path=chat_model, messages_field="messages")


def test_a_pandas_categorical_text_column_reads_as_its_strings(tmp_path):
    """pandas writes a Categorical column as a dictionary of strings: as a text column or a template
    field it reads as the same strings as a plain one (it was refused as 'not a string column')."""
    import pandas as pd

    rows = {"text": ["alpha", "beta", "alpha"], "topic": ["x", "y", "x"], "label": [0, 1, 0]}
    pd.DataFrame(rows).to_parquet(tmp_path / "plain.parquet")
    pd.DataFrame({k: pd.Categorical(v) if k != "label" else v for k, v in rows.items()}).to_parquet(
        tmp_path / "categorical.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "categorical.parquet").field("text").type)
    for options in ({}, {"prompt_template": "{topic}: {text}"}):
        plain, categorical = (load_dataset(tmp_path / f"{name}.parquet", **options).samples
                              for name in ("plain", "categorical"))
        assert [(s.text, s.label) for s in categorical] == [(s.text, s.label) for s in plain]

@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_integer_labels_are_their_own_label_ids(suffix, tmp_path):
    """Class ids 0..11 as plain integers (no ClassLabel): label_id = the integer, where sorting them
    as text numbered 10 and 11 before 2; strings still sort by text, after the integers."""
    labels = [7, 11, 2, 0, 10, 1, 3, 4, 5, 6, 8, 9, 2]
    rows = [{"text": f"row {i}", "label": label} for i, label in enumerate(labels)]
    path = tmp_path / f"ids{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = load_dataset(path)
    assert dataset.labels == list(range(12))
    assert [dataset.labels.index(s.label) for s in dataset.samples] == labels
    assert label_list([3, "b", 12, "a", -1, True]) == [-1, 3, 12, True, "a", "b"]


def test_float_labels_number_as_integers_do_and_nan_is_named(image_folder, tmp_path):
    """pandas writes an integer column with a missing value as floats (0.0 .. 11.0, null): they are
    numbered as the integers are, where sorting them as text put 10.0 and 11.0 before 2.0. NaN, which
    Python's json reads, made each of its rows a class of its own: it is refused, naming the line, in
    a JSONL file and in an image folder's metadata file."""
    labels = [7.0, 11.0, 2.0, 0.0, 10.0, 1.0, 3.0, 4.0, 5.0, 6.0, 8.0, 9.0, None]
    path = tmp_path / "floats.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}", "label": label}) + "\n" for i, label in enumerate(labels)))
    dataset = load_dataset(path)
    assert dataset.labels == [float(i) for i in range(12)]
    assert [dataset.labels.index(s.label) if s.label is not None else -1 for s in dataset.samples] == [
        7, 11, 2, 0, 10, 1, 3, 4, 5, 6, 8, 9, -1]
    path.write_text(path.read_text().replace('"label": 3.0', '"label": NaN'))
    with pytest.raises(ConfigError, match=r"floats.jsonl:7: field 'label' is nan; a row without a label has null"):
        load_dataset(path)
    photos, _ = described_photos(image_folder, tmp_path, ".jsonl")
    metadata = photos / "metadata.jsonl"
    first, *rest = metadata.read_text().splitlines()
    metadata.write_text("\n".join([first.replace('"kind": "striped"', '"kind": NaN').replace(
        '"kind": "plain"', '"kind": NaN'), *rest]) + "\n")
    with pytest.raises(ConfigError, match=r"metadata.jsonl:1: field 'kind' is nan"):
        load_dataset(photos, label_field="kind")


@pytest.mark.parametrize("kind", ["parquet", "parquet_no_stats", "arrow", "messages"])
def test_the_scan_names_a_null_prompt_in_a_table_before_any_part_reads_it(kind, model_dir, tmp_path):
    """A null text (or messages list) in the last shard of a table is named by the scan, as the
    part's job reading that row names it; a limit that stops before it lets it be. Parquet string
    columns are checked from the row groups' null counts; without them, and in Arrow, the prompt
    column is read. (A CSV's empty field is an empty string, never null.)"""
    texts = [f"row {i}" for i in range(90)]
    texts[77] = None
    column = "messages" if kind == "messages" else "text"
    values = [None if t is None else [{"role": "user", "content": t}] for t in texts] if kind == "messages" else texts
    table = pa.table({column: values, "label": [i % 3 for i in range(90)]})
    options = {"messages_field": "messages"} if kind == "messages" else {}
    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama") if options else None
    if kind == "arrow":
        path = tiny.write_arrow_stream(tmp_path / "data.arrow", table, batch_rows=16)
        where = "data.arrow#77"
    else:
        path = tmp_path / "shards"
        path.mkdir()
        for i, rows in enumerate((range(0, 50), range(50, 90))):
            pq.write_table(table.slice(rows.start, len(rows)), path / f"train-{i}.parquet", row_group_size=16,
                           write_statistics=kind != "parquet_no_stats")
        where = "train-1.parquet#27"
    message = rf"{where}, column '{column}': null where a prompt is needed"
    with pytest.raises(ConfigError, match=message):
        scan_dataset(path, **options)
    scan = scan_dataset(path, 77, **options)  # rows 0-76: no null among them
    assert scan.n_samples == 77
    with pytest.raises(ConfigError, match=message):  # the part's job reading the row names it alike
        load_dataset(path, parts=(2, 1), scan=replace(scan, n_samples=90), model_path=chat_model, **options)


# --- dataset.split in a folder: the files Hugging Face `datasets` reads as that split -------------

def _rows(start: int, n: int) -> list[dict]:
    return [{"text": f"row {i}"} for i in range(start, start + n)]


def _parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _texts(path: Path, split: str) -> list[str]:
    return [s.text for s in load_dataset(path, split=split).samples]


def test_a_hub_snapshot_is_read_as_its_split_not_whole(tmp_path):
    """data/{split}-NNNNN-of-NNNNN files, as `huggingface-cli download` leaves a Hub dataset: each
    split reads its own shards in order (before: every shard, train and test mixed, whatever the
    split); any split name; a split the folder lacks is named with those it has."""
    _parquet(tmp_path / "data/train-00000-of-00002.parquet", _rows(0, 3))
    _parquet(tmp_path / "data/train-00001-of-00002.parquet", _rows(3, 2))
    _parquet(tmp_path / "data/test-00000-of-00001.parquet", _rows(5, 2))
    _parquet(tmp_path / "data/train_sft-00000-of-00001.parquet", _rows(7, 1))
    assert _texts(tmp_path, "train") == [f"row {i}" for i in range(5)]
    assert _texts(tmp_path, "test") == ["row 5", "row 6"]
    assert _texts(tmp_path, "train_sft") == ["row 7"]
    with pytest.raises(ConfigError, match=r"dataset.split 'validation' is not a split of .* train, test, train_sft"):
        load_dataset(tmp_path, split="validation")


@pytest.mark.parametrize("layout", [
    {"train/a.jsonl": 2, "train/b.jsonl": 2, "test/c.jsonl": 1, "validation/d.jsonl": 3},  # split folders
    {"train.jsonl": 4, "test.jsonl": 1, "dev.jsonl": 3},                                   # split file names
    {"my_train_01.jsonl": 4, "my_eval_01.jsonl": 1, "my_val_01.jsonl": 3},                 # keywords between separators
    {"nested/train-part/a.jsonl": 4, "nested/x_test/b.jsonl": 1, "nested/valid_x/c.jsonl": 3},
])
def test_split_keywords_in_folder_and_file_names(layout, tmp_path):
    """train/training, validation/valid/dev/val, test/testing/eval/evaluation in a folder or file name,
    alone or between `-._ 0-9`, as datasets' default patterns find them."""
    start = 0
    expected = {"train": [], "test": [], "validation": []}
    for rel, n in layout.items():
        _jsonl(tmp_path / rel, _rows(start, n))
        split = "train" if n == 4 or n == 2 else "test" if n == 1 else "validation"
        expected[split] += [f"row {i}" for i in range(start, start + n)]
        start += n
    for split, texts in expected.items():
        assert sorted(_texts(tmp_path, split), key=lambda t: int(t.split()[1])) == texts, split


def test_readme_configs_choose_the_files(tmp_path):
    """README.md's YAML configs: the default config's data_files per split (a list of {split, path},
    one pattern, or several), files outside them left out; several configs need a default."""
    _parquet(tmp_path / "data/train-00000-of-00001.parquet", _rows(0, 3))
    _parquet(tmp_path / "data/test-00000-of-00001.parquet", _rows(3, 2))
    _parquet(tmp_path / "extra/more.parquet", _rows(5, 1))
    readme = tmp_path / "README.md"
    readme.write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
                      "  - split: test\n    path:\n    - data/test-*\n    - extra/*.parquet\n---\n# card\n")
    assert _texts(tmp_path, "train") == ["row 0", "row 1", "row 2"]
    assert _texts(tmp_path, "test") == ["row 3", "row 4", "row 5"]
    readme.write_text("---\nconfigs:\n- config_name: small\n  data_files: extra/*.parquet\n"
                      "- config_name: main\n  default: true\n  data_files:\n  - split: train\n    path: data/test-*\n---\n")
    assert _texts(tmp_path, "train") == ["row 3", "row 4"]
    readme.write_text("---\nconfigs:\n- config_name: a\n  data_files: extra/*\n- config_name: b\n  data_files: data/*\n---\n")
    with pytest.raises(ConfigError, match=r"README.md lists the configs a, b and none is the default"):
        load_dataset(tmp_path)
    readme.write_text("---\nconfigs:\n- config_name: default\n  data_files: ../elsewhere/*.parquet\n---\n")
    with pytest.raises(ConfigError, match=r"data_files pattern '../elsewhere/\*.parquet' is not a path inside"):
        load_dataset(tmp_path)


def test_a_folder_that_names_no_split_is_read_whole(tmp_path):
    """No split in any name (and no README configs): every file, whatever dataset.split records,
    as before."""
    _jsonl(tmp_path / "shard-a.jsonl", _rows(0, 2))
    _jsonl(tmp_path / "shard-b.jsonl", _rows(2, 2))
    for split in ("train", "validation"):
        assert _texts(tmp_path, split) == ["row 0", "row 1", "row 2", "row 3"]


def test_an_image_folder_with_split_folders_reads_its_split(tmp_path):
    """train/<label>/..., validation/<label>/... (Hugging Face's imagefolder layout): the split's
    folder is read and the labels are the folders below it (before: every split, labelled by split
    name). A class folder that only contains a keyword stays a class; an unknown split is named."""
    import numpy as np
    from PIL import Image

    for split, n in (("train", 3), ("validation", 2)):
        for label in ("angular", "healthy"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(tmp_path / split / label / f"{i}.png")
    for split, n in (("train", 3), ("validation", 2)):
        dataset = load_dataset(tmp_path, split=split)
        assert [(s.text, s.label) for s in dataset.samples] == [
            (f"{label}/{i}.png", label) for label in ("angular", "healthy") for i in range(n)]
        assert dataset.labels == ["angular", "healthy"]
    with pytest.raises(ConfigError, match=r"dataset.split 'test' is not a split of the image folder .* train, validation"):
        load_dataset(tmp_path, split="test")
    classes = tmp_path / "classes"
    for label in ("test_tube", "beaker"):
        (classes / label).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(classes / label / "0.png")
    assert load_dataset(classes).labels == ["beaker", "test_tube"]


def test_a_load_dataset_cache_folder_reads_its_split(tmp_path):
    """load_dataset's cache folder (dataset_info.json listing the splits, `{name}-{split}.arrow` and
    `{name}-{split}-NNNNN-of-NNNNN.arrow`, no state.json): the split's files only (before: every
    split's, test rows first); a split it lacks is named with those it has."""
    tmp_path.mkdir(exist_ok=True)
    tiny.write_arrow_stream(tmp_path / "json-train-00000-of-00002.arrow", pa.Table.from_pylist(_rows(0, 3)))
    tiny.write_arrow_stream(tmp_path / "json-train-00001-of-00002.arrow", pa.Table.from_pylist(_rows(3, 2)))
    tiny.write_arrow_stream(tmp_path / "json-test.arrow", pa.Table.from_pylist(_rows(5, 2)))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"splits": {
        "train": {"name": "train", "num_examples": 5}, "test": {"name": "test", "num_examples": 2}}}))
    assert _texts(tmp_path, "train") == [f"row {i}" for i in range(5)]
    assert _texts(tmp_path, "test") == ["row 5", "row 6"]
    with pytest.raises(ConfigError, match=r"dataset.split 'validation' is not a split of this dataset \(splits: train, test\)"):
        load_dataset(tmp_path, split="validation")


def test_images_checked_in_processes_name_the_first_bad_one_in_sample_order(tmp_path):
    """Enough images for 3 checking processes are checked in forked processes; whichever finishes
    first, the error names the first bad image in sample order, and a folder of good ones passes."""
    from PIL import Image

    from actstore.datasets.images import CHECK_CHUNK, CHECK_PER_PROCESS, check_images
    n = 3 * CHECK_PER_PROCESS
    for i in range(n):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        Image.new("RGB", (4, 4), (i % 256, 0, 0)).save(tmp_path / f"c{i % 2}" / f"img_{i:04d}.png")
    dataset = load_dataset(tmp_path)
    check_images(dataset.opener, dataset.samples, 3)
    first_bad, later_bad = dataset.samples[5].text, dataset.samples[2 * CHECK_CHUNK + 5].text
    for name in (first_bad, later_bad):
        (tmp_path / name).write_bytes(b"not a png")
    for processes in (3, 1):
        with pytest.raises(ConfigError, match=f"{first_bad}: not a readable image"):
            check_images(dataset.opener, dataset.samples, processes)


def test_an_image_folder_reads_every_format_pillow_decodes_by_itself(tmp_path):
    """Netpbm (GTSRB ships .ppm), JPEG's .jfif and .jpe, JPEG 2000, TGA, AVIF... were left out of an
    image folder without a word: every suffix Hugging Face's ImageFolder lists that Pillow decodes
    without a handler or program is a sample now, checked and decoded to RGB like a .jpg."""
    from PIL import Image

    from actstore.datasets.images import check_images
    from actstore.datasets.source import IMAGE_SUFFIXES
    colour = (10, 200, 30)
    saved = {}
    for suffix in sorted(IMAGE_SUFFIXES):
        fmt = Image.registered_extensions()[suffix]
        image = Image.new("RGB", (16, 16), colour)
        try:
            image.convert("1" if fmt == "XBM" else "RGB").save(tmp_path / f"img{suffix}", format=fmt)
        except (KeyError, OSError, ValueError):  # Pillow reads but cannot write it (.cur, .psd, .pcd...)
            continue
        saved[f"img{suffix}"] = fmt
    assert len(saved) >= 30 and {"img.ppm", "img.jfif", "img.jp2", "img.tga", "img.avif"} <= set(saved)
    (tmp_path / "README.md").write_text("not a sample")
    dataset = load_dataset(tmp_path, format="image_folder")
    assert sorted(s.text for s in dataset.samples) == sorted(saved)
    check_images(dataset.opener, dataset.samples, 1)
    for sample in dataset.samples:
        image = dataset.opener(sample)
        assert image.mode == "RGB" and (image.size == (16, 16) or saved[sample.text] == "ICNS"), sample.text
        if saved[sample.text] in ("PNG", "BMP", "PPM", "TIFF", "TGA", "SGI", "PCX", "DDS"):
            assert image.getpixel((3, 5)) == colour, sample.text


# --- Names a dataset file holds are resolved inside the dataset. ---

def test_an_image_tables_path_is_read_inside_its_shards_folder_only(tmp_path):
    """A {bytes: null, path} row is read relative to its shard's folder; one naming a file elsewhere
    (`..`, an absolute path, a folder linked out) is refused naming the file, sample, column and
    name (before, the image outside was opened and extracted)."""
    import numpy as np
    from PIL import Image

    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    Image.fromarray(np.full((4, 4, 3), 10, np.uint8)).save(data / "images" / "in.png")
    Image.fromarray(np.full((4, 4, 3), 200, np.uint8)).save(tmp_path / "outside" / "private.png")
    (data / "linked").symlink_to(tmp_path / "outside", target_is_directory=True)
    names = ["images/in.png", "../outside/private.png", str(tmp_path / "outside" / "private.png"),
             "linked/private.png"]
    column = pa.array([{"bytes": None, "path": name} for name in names],
                      pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"image": column, "label": [0, 1, 0, 1]}), data / "train.parquet")
    dataset = load_dataset(data / "train.parquet", format="image_table")
    inside, *outside = dataset.samples
    dataset.opener.check(inside)
    assert dataset.opener(inside).getpixel((0, 0)) == (10, 10, 10)
    for sample, name in zip(outside, names[1:]):
        refused = (rf"train\.parquet: sample {sample.sample_idx}, column 'image': {re.escape(repr(name))} "
                   rf"(is not a relative path inside|leads outside) {re.escape(str(data))}")
        for read in (dataset.opener.check, dataset.opener):
            with pytest.raises(ConfigError, match=refused):
                read(sample)


@pytest.mark.parametrize("name", ["../outside.arrow", "/outside.arrow"])
def test_a_save_to_disk_state_naming_a_file_outside_is_refused(name, tmp_path):
    """state.json's `_data_files[].filename` is resolved inside the folder: one naming a file elsewhere
    is refused naming state.json, the entry and the name (before, its rows were read as the dataset's)."""
    folder = tmp_path / "ds"
    folder.mkdir()
    outside = tmp_path / "outside.arrow"
    tiny.write_arrow_stream(outside, pa.table({"text": ["a row from outside the dataset"]}))
    tiny.write_arrow_stream(folder / "data-00000-of-00001.arrow", pa.table({"text": ["a row of the dataset"]}))
    filename = str(outside) if name.startswith("/") else name
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}, {"filename": filename}]}
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=rf"ds/state\.json: _data_files\[1\]\.filename: {re.escape(repr(filename))} "
                                          rf"is not a relative path inside {re.escape(str(folder))}"):
        load_dataset(folder)
    state["_data_files"].pop()
    (folder / "state.json").write_text(json.dumps(state))
    assert [s.text for s in load_dataset(folder).samples] == ["a row of the dataset"]



@pytest.mark.parametrize("how", ["climbs", "absolute", "link", "not a list"])
def test_a_save_to_disk_dict_naming_a_split_folder_outside_is_refused(how, tmp_path):
    """dataset_dict.json's split is resolved inside the DatasetDict's folder: a split named `../x`, an
    absolute path, or a split folder that is a link out is refused naming the file and the split
    (before, the other folder's rows were read as the dataset's); splits that are no list of names
    are named too (a string matched any split it contained)."""
    outside = tmp_path / "x"
    tiny.write_hf_disk(outside, {"train": pa.table({"text": ["a row from outside the dataset"]})}, {})
    folder = tmp_path / "ds"
    tiny.write_hf_disk(folder, {"train": pa.table({"text": ["a row of the dataset"]})}, {})
    split, splits, refused = {
        "climbs": ("../x/train", ["train", "../x/train"], "'../x/train' is not a relative path inside"),
        "absolute": (str(outside / "train"), ["train", str(outside / "train")], "is not a relative path inside"),
        "link": ("linked", ["train", "linked"], "'linked' leads outside"),
        "not a list": ("train", "train_and_test", "splits must be a list of split names, got 'train_and_test'"),
    }[how]
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    (folder / "linked").symlink_to(outside / "train")
    with pytest.raises(ConfigError, match=rf"ds/dataset_dict\.json: .*{refused}"):
        load_dataset(folder, split=split)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert [s.text for s in load_dataset(folder, split="train").samples] == ["a row of the dataset"]


def test_a_csv_of_multi_line_values_past_one_block_reads_and_a_bad_row_is_named(monkeypatch, tmp_path):
    """A quoted CSV value may hold line breaks (csv.writer and pandas write multi-line texts so): past
    one block, pyarrow read them only with newlines_in_values (before: a bare ArrowInvalid, 'parser got
    out of sync'); a row pyarrow cannot parse, or a .csv.gz cut short past the first block, is named
    with its file, not raised as ArrowInvalid or OSError."""
    from actstore.datasets import tables

    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 4096)  # a 16 MiB block's boundary, in a small file
    rows = [{"text": f"row {i} " + "line one\nline two " * (i % 3), "label": f"l{i % 2}"} for i in range(2000)]
    path = tmp_path / "multi.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, ["text", "label"])
        writer.writeheader()
        writer.writerows(rows)
    assert [(s.text, s.label) for s in load_dataset(path).samples] == [(r["text"], r["label"]) for r in rows]
    path.write_text("text,label\n" + "".join(f"row {i},a\n" for i in range(2000)) + "oops,a,extra\nlast,b\n")
    with pytest.raises(ConfigError, match=r"multi\.csv: cannot be read as CSV past its first \d+ rows "
                                          r"\(CSV parse error: Expected 2 columns, got 3: oops,a,extra"):
        load_dataset(path)
    packed = gzip.compress(b"text,label\n" + b"".join(b"row %d,a\n" % i for i in range(50000)))
    (tmp_path / "cut.csv.gz").write_bytes(packed[:len(packed) // 2])
    with pytest.raises(ConfigError, match=r"cut\.csv\.gz: cannot be read as CSV past its first \d+ rows "
                                          r"\(the file ends inside a compressed gz stream \(cut short\)"):
        scan_dataset(tmp_path / "cut.csv.gz")


def test_a_jsonl_line_past_the_longest_row_is_named_not_read_whole(monkeypatch, tmp_path):
    """A JSON lines line is read up to MAX_LINE_CHARS: a file of one JSON object on one line (SQuAD's
    {"data": [...]}) of gigabytes was read whole, twice over in memory, before any field was checked."""
    from actstore.datasets import jsonl

    monkeypatch.setattr(jsonl, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 1000}) + "\n")
    with pytest.raises(ConfigError, match=r"rows\.jsonl:2: a line longer than 1000 characters"):
        scan_dataset(path)
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 900}) + "\n")
    assert [len(s.text) for s in load_dataset(path).samples] == [5, 900]


def test_a_class_id_past_the_classlabel_names_is_named_by_the_scan(tmp_path):
    """A ClassLabel column's ids are looked up in its names: an id past them (or below -1, Hugging
    Face's row without a label) is named with its shard, row and column by the scan (before, each such
    label was None, as if the row had none); -1 stays a row without a label, and a column of strings
    is read as its names."""
    features = {"text": {"dtype": "string", "_type": "Value"},
                "label": {"names": ["neg", "pos"], "_type": "ClassLabel"}}
    metadata = {"huggingface": json.dumps({"info": {"features": features}})}
    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a", "b"], "label": [0, 1]}).replace_schema_metadata(metadata),
                   folder / "train-0.parquet")
    pq.write_table(pa.table({"text": ["c", "d", "e"], "label": [-1, 1, 2]}).replace_schema_metadata(metadata),
                   folder / "train-1.parquet")
    with pytest.raises(ConfigError, match=r"train-1\.parquet#2, column 'label': class id 2 names no class "
                                          r"\(its ClassLabel has 2 names"):
        scan_dataset(folder)
    dataset = load_dataset(folder, limit=4)
    assert [(s.text, s.label) for s in dataset.samples] == [("a", "neg"), ("b", "pos"), ("c", None), ("d", "pos")]
    pq.write_table(pa.table({"text": ["c"], "label": ["pos"]}).replace_schema_metadata(metadata),
                   folder / "train-1.parquet")
    assert scan_dataset(folder).labels == ["neg", "pos"]
    assert [(s.text, s.label) for s in load_dataset(folder).samples] == [("a", "neg"), ("b", "pos"), ("c", "pos")]


@pytest.mark.parametrize("messages", ["hello", None, [{"role": "user", "content": None}],
                                      [{"from": "bing", "value": "x"}]])
def test_the_scan_names_a_jsonl_row_whose_messages_are_no_chat(messages, tmp_path):
    """A JSONL row whose messages_field is not a list of {role, content} (or ShareGPT {from, value})
    messages is named by the scan, with its line, no tokenizer needed (before, only its presence was
    checked: each part's job found it, after the parts before it had run)."""
    lines = tmp_path / "chat.jsonl"
    lines.write_text(json.dumps({"messages": MESSAGES[0]}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ConfigError, match=r"chat\.jsonl:2: (messages must be a list|message 0: (needs string role "
                                          r"and content|a ShareGPT message from 'bing'))"):
        scan_dataset(lines, messages_field="messages")
    assert scan_dataset(lines, messages_field="messages", limit=1).n_samples == 1


def test_a_metadata_csv_row_cut_short_is_named_not_read_as_nulls(tmp_path):
    """A metadata.csv row with fewer values than the header's columns is named with its line and the
    first column it lacks (before, those fields and the label read as None, as if the image had no
    label); an empty value written as such is read as the empty text it is."""
    from PIL import Image

    for name in ("cat/1.png", "cat/2.png", "dog/3.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    csv_path = tmp_path / "metadata.csv"
    csv_path.write_text("file_name,caption,species\ncat/1.png,a cat,felis\ncat/2.png\ndog/3.png,a dog,canis\n")
    with pytest.raises(ConfigError, match=r"metadata\.csv:3: fewer values than the header has columns \(none for "
                                          r"'caption'"):
        scan_dataset(tmp_path, label_field="species")
    csv_path.write_text("file_name,caption,species\ncat/1.png,a cat,felis\ncat/2.png,,felis\ndog/3.png,a dog,canis\n")
    assert [(s.label, s.metadata) for s in load_dataset(tmp_path, label_field="species").samples] == [
        ("felis", {"caption": "a cat"}), ("felis", {"caption": ""}), ("canis", {"caption": "a dog"})]


def test_an_arrow_file_cut_short_is_named(tmp_path):
    """An Arrow stream cut inside a record batch (a copy interrupted) is named with its file by the
    scan (before: pyarrow's OSError or ArrowInvalid, naming no file)."""
    path = tiny.write_arrow_stream(tmp_path / "cut.arrow", pa.table({"text": [f"row {i} " * 20 for i in range(1000)]}),
                                   batch_rows=100)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 3):
        path.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=r"cut\.arrow: cannot be read as Arrow, cut short or damaged"):
            scan_dataset(path)


def test_a_damaged_parquet_row_group_is_named_with_its_file(tmp_path):
    """A Parquet row group whose data is damaged (its footer intact, so the scan counts its rows) is
    named with its file and group when read (before: pyarrow's OSError, naming no file)."""
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(1000)]}), path, row_group_size=100,
                   compression="snappy")
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 200):
        data[i] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"bad\.parquet: row group \d+ cannot be read as Parquet, damaged"):
        load_dataset(path)


@pytest.mark.parametrize("fmt", ["image_folder", "text_folder"])
def test_a_file_name_that_is_not_utf8_is_named_by_the_scan(fmt, tmp_path):
    """A folder's file named in another encoding (latin-1 café) is listed with a surrogate, which no
    writer stores as UTF-8 text (the sample's text or kept name): the scan names the folder and file
    (before, the extraction failed after the model ran)."""
    from PIL import Image

    (tmp_path / "cat").mkdir()
    for name in (b"a.png", b"caf\xe9.png"):
        with open(os.path.join(os.fsencode(tmp_path / "cat"), name), "wb") as fh:
            Image.new("RGB", (4, 4)).save(fh, format="png")
    with pytest.raises(ConfigError, match=r"the file name 'cat/caf\\udce9\.png' \(not UTF-8 on disk\) holds an "
                                          r"unpaired surrogate"):
        scan_dataset(tmp_path, format=fmt, encoding="latin-1")
    assert scan_dataset(tmp_path, format=fmt, encoding="latin-1", limit=1).n_samples == 1


def test_a_jsonl_row_without_the_label_field_set_is_named(tmp_path):
    """With dataset.label_field set, a JSONL row lacking that field is named with its line, as a table
    without the column, a metadata row or a tar sample without it are (before, a misspelt label_field
    read every label as None); a row with null there has no label."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "a", "category": "x"}) + "\n" + json.dumps({"text": "b", "category": None})
                    + "\n")
    with pytest.raises(ConfigError, match=r"rows\.jsonl:1: line has no field 'categroy' \(dataset\.label_field"):
        scan_dataset(path, label_field="categroy")
    assert [s.label for s in load_dataset(path, label_field="category").samples] == ["x", None]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_metadata_file_not_utf8_is_named_with_its_line(suffix, tmp_path):
    """A byte that is not UTF-8 in an image folder's metadata file is named with its line (before:
    the file alone, as text mode decodes ahead by blocks)."""
    from PIL import Image

    for name in ("cat/1.png", "cat/2.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    rows = ([b'{"file_name": "cat/1.png"}', b'{"file_name": "cat/2.png", "caption": "caf\xe9"}'] if suffix == ".jsonl"
            else [b"file_name,caption", b"cat/1.png,a cat", b"cat/2.png,caf\xe9"])
    (tmp_path / f"metadata{suffix}").write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(ConfigError, match=rf"metadata\{suffix}:{len(rows)}: not UTF-8 text \(byte \d+ of the line"):
        scan_dataset(tmp_path)


def stream_ends(data: bytes) -> list[int]:
    """The byte where each record batch of an Arrow stream ends."""
    source = pa.BufferReader(data)
    reader = pa.ipc.open_stream(source)
    return [source.tell() for _ in reader]


def test_an_arrow_stream_cut_where_a_record_batch_ends_is_refused_naming_the_file(tmp_path):
    """save_to_disk's data files are Arrow streams, which pyarrow reads to the end of the file with
    or without their end-of-stream marker: a file cut where a record batch ends (a copy or a write
    stopped there) read as fewer rows, without a word, and so did one holding a second stream after
    the first's end. The scan names the file and the rows before the cut; the whole file, and one
    with the 4-byte end marker of pyarrow before 0.15, read as before."""
    table = pa.table({"text": [f"row {i}" for i in range(100)], "label": [i % 3 for i in range(100)]})
    root = tiny.write_hf_disk(tmp_path / "hf", {"train": table}, {})
    path = root / "train" / "data-00001-of-00002.arrow"  # rows 50-99: record batches of 32 and 18
    data = path.read_bytes()
    assert scan_dataset(root).n_samples == 100
    cut = stream_ends(data)[0]
    path.write_bytes(data[:cut])
    with pytest.raises(ConfigError, match=rf"data-00001-of-00002\.arrow: after its 32 rows \(byte {cut}\) the Arrow "
                                          r"stream's end marker is missing \(the file ends\): cut short"):
        scan_dataset(root)
    path.write_bytes(data + data)
    with pytest.raises(ConfigError, match=rf"after its 50 rows \(byte {len(data) - 8}\) the Arrow stream's end "
                                          rf"marker is missing \({len(data) + 8} more bytes\)"):
        scan_dataset(root)
    with pa.ipc.new_stream(path, table.schema, options=pa.ipc.IpcWriteOptions(use_legacy_format=True)) as writer:
        writer.write_table(table.slice(50), max_chunksize=32)
    assert path.read_bytes()[-4:] == bytes(4)
    assert [s.text for s in load_dataset(root).samples] == table.column("text").to_pylist()


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
@pytest.mark.parametrize("messages", [[{"role": "user", "content": None}], [None],
                                      [{"from": "bing", "value": "x"}]])
def test_the_scan_names_a_table_row_whose_messages_are_no_chat(kind, messages, tmp_path):
    """A table row whose messages column holds no list of {role, content} (or ShareGPT {from,
    value}) strings (a null content, a null message, a speaker that is no chat role) is named by the
    scan with its shard and row, as a JSONL row is (before, only a null list was: the row was found
    when a part's job rendered it, after the parts before had run); a limit before it lets it be."""
    good = [{"from": "human", "value": "hi"}] if "from" in (messages[0] or {}) else [{"role": "user", "content": "hi"}]
    table = pa.table({"messages": [good] * 70 + [messages] + [good] * 9})
    if kind == "arrow":
        path = tiny.write_arrow_stream(tmp_path / "chat.arrow", table, batch_rows=16)
        where = "chat.arrow#70"
    else:
        path = tiny.write_parquet(tmp_path / "chat", table, shards=2, row_group_size=16)
        where = "train-00001-of-00002.parquet#30"
    with pytest.raises(ConfigError, match=rf"{where}, column 'messages': (messages must be a list|message 0: "
                                          rf"(a NoneType, not|needs string role and content|a ShareGPT message "
                                          rf"from 'bing'))"):
        scan_dataset(path, messages_field="messages")
    assert scan_dataset(path, messages_field="messages", limit=70).n_samples == 70
