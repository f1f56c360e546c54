"""saev shard jobs carry their extraction's digest: a finisher refuses shards of another extraction."""
import pytest

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.extract import open_extraction
from test_saev import PPS, finish, scatter

# One extract_hash for both extractions (a reused stage hash): without one, `data` names each extraction's
# digest and the stores differ in name, so the job records' source is what tells them apart.
STAGE = "0" * 64


def test_shards_of_another_extraction_of_the_same_shape_are_refused(extracted, tmp_path):
    """float16 storage: the same samples, shapes and metadata (so the same store name, planned under one
    stage hash), other values. Its shards were linked into the float32 extraction's store, which then
    passed verify."""
    config, extract_dir = extracted("gpt2")
    _, other_dir = extracted("gpt2", extract={"storage_dtype": "float16"})
    section = {**config["saev"], "patches_per_shard": PPS, "tokens_per_window": 8}
    here, there = open_extraction(extract_dir), open_extraction(other_dir)
    plan = saev.plan_store(here, section, STAGE, model_config=None)
    assert plan.store_name == saev.plan_store(there, section, STAGE, model_config=None).store_name
    dirs = scatter(there, section, tmp_path / "jobs", 2, STAGE)
    with pytest.raises(FormatError, match=r"job-0000/job.json: shards of extraction \w{12}, not \w{12}, this "):
        finish(here, section, tmp_path / "store", dirs, STAGE)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("metadata.json"))
    assert saev.verify(finish(there, section, tmp_path / "store", dirs, STAGE)) == []
