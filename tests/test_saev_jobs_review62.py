"""saev shard jobs carry their extraction's digest: a finisher refuses shards of another extraction."""
import pytest

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.extract import open_extraction
from test_saev import PPS, finish, scatter


def test_shards_of_another_extraction_of_the_same_shape_are_refused(extracted, tmp_path):
    """float16 storage: the same samples, shapes and metadata (so the same store name), other values.
    Its shards were linked into the float32 extraction's store, which then passed verify."""
    config, extract_dir = extracted("gpt2")
    _, other_dir = extracted("gpt2", extract={"storage_dtype": "float16"})
    section = {**config["saev"], "patches_per_shard": PPS, "tokens_per_window": 8}
    here, there = open_extraction(extract_dir), open_extraction(other_dir)
    plan = saev.plan_store(here, section, None, model_config=None)
    assert plan.store_name == saev.plan_store(there, section, None, model_config=None).store_name
    dirs = scatter(there, section, tmp_path / "jobs", 2)
    with pytest.raises(FormatError, match=r"job-0000/job.json: shards of extraction \w{12}, not \w{12}, this "):
        finish(here, section, tmp_path / "store", dirs)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("metadata.json"))
    assert saev.verify(finish(there, section, tmp_path / "store", dirs)) == []
