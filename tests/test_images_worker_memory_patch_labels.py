"""Review 64: an image worker's memory (one full-size image at a time, the pixels one processor call's for
all) and saev.patch_labels refused at parse time on a dataset that is no image folder."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tiny

# One decoding worker's item: 16 phone-camera-sized photos (4000 x 4000, 48 MB each decoded) run through
# extract.inputs.load_pixels, in a process of its own so its peak RSS is its own.
PEAK_SCRIPT = textwrap.dedent("""
    import io, resource
    import numpy as np
    import transformers as tf
    from PIL import Image
    from skimage import data
    from actstore.datasets.images import decoded_image
    from actstore.extract.inputs import load_pixels

    side = 4000
    buf = io.BytesIO()
    Image.fromarray(data.astronaut()).resize((side, side)).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    processor = tf.BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    load_pixels(processor, lambda s: decoded_image(io.BytesIO(jpeg), f"row {s}"), [0])  # warm: imports, caches
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pixels = load_pixels(processor, lambda s: decoded_image(io.BytesIO(jpeg), f"row {s}"), list(range(16)))
    assert tuple(pixels.shape) == (16, 3, 32, 32), pixels.shape
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, side * side * 3)
""")


@pytest.mark.slow
def test_a_decoding_worker_does_not_hold_an_items_full_size_images_at_once():
    """A worker's memory is what the job's mem_mb counts (resources.extract_part_mem_mb: processed pixels,
    224 x 224 for a ViT), not 16 full-size photos at once: 16 workers x 16 16-megapixel photos is 12 GB
    of decoded pixels, more than the processor's transients, in a job that asked Slurm for 4 GB."""
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak, decoded = map(int, proc.stdout.split()[-2:])
    assert peak < 8 * decoded, f"peak {peak / 1e6:.0f} MB for one item, {decoded / 1e6:.0f} MB a decoded photo"


@pytest.mark.parametrize("kind", tiny.VISION_KINDS)
def test_an_items_pixels_are_one_processor_call_over_all_its_images(kind, model_dir, image_folder):
    """load_pixels runs the processor an image at a time; the pixels are a whole item's call's, bit for bit,
    for each vision model's own processor, on photos of different sizes (so a resize or crop that looked at
    the batch would show)."""
    from actstore.datasets import load_dataset
    from actstore.extract.inputs import load_pixels
    from actstore.models import load_image_processor

    processor = load_image_processor(model_dir(kind))
    dataset = load_dataset(image_folder)
    sizes = {dataset.opener(sample).size for sample in dataset.samples}
    assert len(sizes) > 2, sizes
    whole_call = processor(images=[dataset.opener(s) for s in dataset.samples], return_tensors="pt")["pixel_values"]
    pixels = load_pixels(processor, dataset.opener, dataset.samples)
    assert pixels.dtype == whole_call.dtype and torch.equal(pixels, whole_call)


def test_a_processor_making_pixels_of_two_shapes_is_named_with_the_rows(image_folder):
    """A processor that leaves each image its own size (one that pads a batch to its largest image would,
    an image at a time) cannot fill a store: named, with two rows and both shapes, not torch.cat's error."""
    import transformers as tf

    from actstore.datasets import load_dataset
    from actstore.errors import ConfigError
    from actstore.extract.inputs import load_pixels

    processor = tf.BitImageProcessor(do_resize=False, do_center_crop=False)
    dataset = load_dataset(image_folder)
    first, other = next((dataset.samples[0], s) for s in dataset.samples
                        if dataset.opener(s).size != dataset.opener(dataset.samples[0]).size)
    width, height = dataset.opener(other).size
    with pytest.raises(ConfigError, match=rf"rows {first.sample_idx} .*and {other.sample_idx} .*"
                                          rf"\(BitImageProcessor\w*\).*\(3, {height}, {width}\)"):
        load_pixels(processor, dataset.opener, [first, other])


def dry_run_saev(tmp_path: Path, data: Path) -> subprocess.CompletedProcess:
    """`snakemake -n saev` with saev.patch_labels set (an empty masks folder) on a tiny DINOv2 and `data`."""
    model = tiny.build_model("dinov2", tmp_path / "dinov2")
    (tmp_path / "masks").mkdir()
    config = tiny.make_config(tmp_path, model, data, saev={"patch_labels": {"masks": str(tmp_path / "masks")}})
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path),
           "--configfile", str(configfile), "--cores", "1", "-n", "saev"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_patch_labels_on_an_image_table_is_refused_by_the_dry_run(tmp_path):
    """Masks mirror an image folder's files; a table's rows are no files. `snakemake -n` knows the dataset's
    format, so the config is refused there, not after the GPU jobs extracted the whole dataset."""
    table = tiny.image_table(tiny.write_image_folder(tmp_path / "photos", per_class=2), ["animal", "object"])
    data = tiny.write_parquet(tmp_path / "table", table, shards=2)
    proc = dry_run_saev(tmp_path, data)
    assert proc.returncode != 0, "the dry run planned the extraction of a table whose masks no row names"
    assert "saev.patch_labels" in proc.stdout + proc.stderr
    assert f"dataset.path {data} is parquet (dataset.format auto), no image folder" in proc.stdout + proc.stderr


def test_patch_labels_on_an_image_folder_passes_the_dry_run(tmp_path):
    """The check refuses what is no image folder, and nothing else."""
    proc = dry_run_saev(tmp_path, tiny.write_image_folder(tmp_path / "photos", per_class=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
