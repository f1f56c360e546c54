"""Review 62 of the image inputs (extract/inputs.py, extract/device_images.py, datasets/images.py,
datasets/folders.py): faults found reading them as a demanding user would."""
from __future__ import annotations

import gc
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from actstore.datasets import load_dataset
from actstore.errors import ConfigError
from actstore.extract.device_images import device_image_batches
from actstore.extract.inputs import image_batches
from test_images import FILES, photo, save


def folder_with_a_cut_jpeg(tmp_path: Path) -> tuple[Path, Path]:
    """Six images, the fourth a JPEG cut short: its header passes the check, its decoding (in a
    worker) fails."""
    folder = tmp_path / "images" / "x"
    folder.mkdir(parents=True)
    for i in range(6):
        (folder / f"img_{i}.png").write_bytes(save(photo(seed=i), "PNG"))
    cut = folder / "img_3.png"
    cut.write_bytes(FILES["baseline.jpg"][:len(FILES["baseline.jpg"]) * 3 // 10])
    return tmp_path / "images", cut


def loader_of_a_cut_jpeg(pipeline: str, tmp_path, model_dir, workers: int = 2):
    """The `pipeline`'s batches (`workers` workers) of a folder holding a cut JPEG, and that file."""
    from actstore.models import load_image_processor

    root, cut = folder_with_a_cut_jpeg(tmp_path)
    dataset = load_dataset(root)
    processor = load_image_processor(model_dir("dinov2"))
    batches = [[0, 1], [2, 3], [4, 5]]
    if pipeline == "cpu":
        return image_batches(processor, dataset.opener, dataset.samples, batches, workers, False, torch.float32), cut
    return device_image_batches(processor, dataset.opener, dataset.samples, batches, workers, torch.device("cpu"),
                                torch.float32), cut


@pytest.mark.parametrize("pipeline", ["cpu", "gpu"])
def test_an_image_a_worker_cannot_decode_is_named_first_not_after_the_workers_traceback(pipeline, tmp_path,
                                                                                         model_dir):
    """A worker's ConfigError reached the job as torch's re-raise, 'Caught ConfigError in DataLoader
    worker process 1. Original Traceback ...', the file named only on the traceback's last line."""
    loader, cut = loader_of_a_cut_jpeg(pipeline, tmp_path, model_dir)
    with pytest.raises(ConfigError) as caught:
        list(loader)
    assert str(caught.value).startswith(f"{cut}: cannot decode the image")


@pytest.mark.parametrize("pipeline", ["cpu", "gpu"])
def test_the_workers_of_a_loader_that_met_a_bad_image_end_at_once(pipeline, tmp_path, model_dir):
    """The error's traceback and the loader formed a reference cycle: the garbage collector later shut
    the workers down, each join waiting torch's MP_STATUS_CHECK_INTERVAL (5 s) for a worker that never
    got its stop signal, then killing it (a job stalled 5 s a worker, 80 s with 16). Three workers: that
    stall is 15 s at least, the bound 10 s (their exit took 5.7 s on a loaded 2-core VM)."""
    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    loader, _ = loader_of_a_cut_jpeg(pipeline, tmp_path, model_dir, workers=3)
    with pytest.raises(ConfigError):
        list(loader)
    began = time.perf_counter()
    del loader
    gc.collect()
    assert time.perf_counter() - began < 2 * MP_STATUS_CHECK_INTERVAL
    assert not multiprocessing.active_children()
