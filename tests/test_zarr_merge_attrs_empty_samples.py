"""Zarr logger writer and merge review: the merge refuses, by name, a shard whose attrs disagree with
its activations' .zarray (it built the merged store from the attrs and linked the .zarray's chunks),
and merges shards holding samples of no token (it renamed their directories, which do not exist)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, synthetic_extraction
from test_zarr_merged_sample_count import edited, parts  # noqa: F401 (parts: a fixture)


def written(parts: list[Path], root: Path, t_chunk: int = 4) -> list[Path]:
    shards = [root / "shards" / zs.shard_name(k) for k in range(len(parts))]
    for part, shard in zip(parts, shards):
        zs.write_shard(part, shard, t_chunk=t_chunk, progress=False)
    return shards


@pytest.mark.parametrize("edit, named", [
    (lambda a: a.update(T_chunk=8, chunk_shape=[1, 1, 8, 16], chunk_bytes=256), "T_chunk=8, but"),
    (lambda a: a.update(num_layers=3), "num_layers=3 != len(layers)"),
], ids=["t-chunk", "num-layers"])
def test_a_shard_whose_attrs_disagree_with_its_zarray_is_refused_by_the_merge(parts, tmp_path, edit, named):
    """finish_merge wrote the merged .zarray's chunks and shape from the first shard's .zattrs, beside
    the chunk files its .zarray's T_chunk made: it finished without an error, and every read of the
    merged store then failed ('128 bytes, expected 256'; a shape refused on opening)."""
    shards = written(parts, tmp_path)
    for shard in shards:
        edited(shard, ".zattrs", edit)
    with pytest.raises(FormatError, match=re.escape(f"{shards[0]}/.zattrs: {named}")):
        zs.merge_stores(shards, tmp_path / zs.MERGED, progress=False)
    assert not (tmp_path / zs.MERGED).exists()


def test_a_merge_of_shards_holding_samples_of_no_token_reads_as_the_shards(tmp_path):
    """A sample of no token (seq_len 0: a store that verifies clean) has no chunk file, so no directory:
    finish_merge renamed its directory all the same and failed with a bare FileNotFoundError."""
    extract = synthetic_extraction(tmp_path / "extract", 5_000, 2, 16, [1, 2], tokens=(0, 3))
    shards = written([part.dir for part in open_extraction(extract).parts], tmp_path, t_chunk=2)
    assert any(0 in zs.ZarrStore(shard).seq_len for shard in shards)
    zs.merge_stores(shards, tmp_path / zs.MERGED, progress=False)
    assert zs.verify(tmp_path / zs.MERGED) == []
    zarr = pytest.importorskip("zarr")
    merged = zarr.open_consolidated(str(tmp_path / zs.MERGED), mode="r")["arrays/activations"]
    g = 0
    for shard in map(zs.ZarrStore, shards):
        for i in range(shard.n_samples):
            for l, layer in enumerate(shard.layers):
                n = shard.seq_len[i]
                assert merged[g, l, :n].tobytes() == shard.read(i, layer).tobytes()
                assert not merged[g, l, n:].any()
            g += 1
    assert g == merged.shape[0]
