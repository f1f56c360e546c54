"""Review 62 follow-ups in the readers: damage a reader meets is a FormatError naming the file."""
import pytest

from actstore.errors import FormatError
from actstore.formats import zarr
from actstore.formats.extract import synthetic_extraction
from test_extract import write_real_store


def test_a_zarr_chunk_that_is_a_loop_of_links_is_a_format_error_naming_it(tmp_path):
    """A chunk replaced by a link to itself: verify names it, and the reader raised a bare OSError (ELOOP),
    which readers' callers do not take as a damaged store."""
    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    store = write_real_store("zarr", root, tmp_path / "zarr")
    shard = store / "shards" / "shard-0000.zarr"
    chunk = shard / "arrays" / "activations" / "3" / "0" / "0" / "0"
    chunk.unlink()
    chunk.symlink_to(chunk.name)
    with pytest.raises(FormatError, match=f"{chunk}: a link that cannot be resolved"):
        zarr.ZarrStore(shard).read(3, 1)


def test_truncated_images_stay_refused_until_the_last_decoder_leaves(tmp_path):
    """Two decoders (threads) inside whole_images_only, the first leaving while the second decodes, in a
    process where PIL's LOAD_TRUNCATED_IMAGES was set: the first's exit restored True under the second,
    which then decoded a truncated file (its missing rows gray), and the second's exit left False."""
    from PIL import Image, ImageFile

    from actstore.datasets.images import whole_images_only

    path = tmp_path / "cut.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(path)
    path.write_bytes(path.read_bytes()[:-40])
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        first, second = whole_images_only(), whole_images_only()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        with pytest.raises(OSError), Image.open(path) as img:
            img.load()
        second.__exit__(None, None, None)
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_a_zarr_link_job_record_of_a_tree_hash_alone_is_named_by_the_merge(tmp_path):
    """The job records' reader takes a chunk recorded with a sha256_tree alone; the merge's finisher then
    read its sha256 as a bare KeyError naming nothing."""
    import json

    from actstore.formats import zarr as zs
    from actstore.formats.extract import open_extraction
    from actstore.jobs import JOB_RECORD

    extract = synthetic_extraction(tmp_path / "extract", 100_000, 2, 16, [1, 2], tokens=(3, 20))
    stores = [tmp_path / "run" / "shards" / zs.shard_name(k) for k in range(2)]
    for part, store in zip(open_extraction(extract).parts, stores):
        zs.write_shard(part.dir, store, t_chunk=4, progress=False)
    job_dir = tmp_path / "merge-0"
    zs.link_chunks(stores, job_dir, 1, 0, progress=False)
    record = json.loads((job_dir / JOB_RECORD).read_text())
    name = next(iter(record["files"]))
    record["files"][name] = {"bytes": record["files"][name]["bytes"], "sha256_tree": record["files"][name]["sha256"]}
    (job_dir / JOB_RECORD).write_text(json.dumps(record))
    with pytest.raises(FormatError, match=f"{job_dir / JOB_RECORD}: sha256 of {name} is missing"):
        zs.finish_merge(stores, [job_dir], tmp_path / "run" / "merged", progress=False)
