"""The Zarr activation logger (spec: ../shared/specs/zarr-activation-logger.md, docs/formats/zarr.md).

A run directory `{dump_to}/zarr/{hash}/` holds one self-contained Zarr v2 store per extraction part
(shards/shard-NNNN.zarr/, the spec's parallel writers), optionally one merged store over every sample
(merged/, Option B) and manifest.json, written last. Activations are (N, L, T_max, H) float16 in
uncompressed (1, 1, T_chunk, H) chunks, a file for each chunk holding a sample's tokens (those past
them are the fill value 0, with no file, as zarr leaves empty chunks out); the reader validates the
metadata once, then reads chunk files raw with os.preadv.

Rooms: layout (names, encoding, JSON documents), write (shards, manifest), merge (the merged store:
link_chunks jobs, then finish_merge), read (ZarrStore, ZarrRun, the torch Dataset and sampler),
check (detect, inspect, verify, read_vector).
"""
from actstore.formats.zarr.check import detect, inspect, read_vector, verify
from actstore.formats.zarr.layout import ACTS, FORMAT_NAME, MANIFEST, MERGED, choose_t_chunk, shard_name
from actstore.formats.zarr.read import (TrainingPatternSampler, ZarrActivationDataset, ZarrRun, ZarrStore,
                                        collate_padded, open_zarr)
from actstore.formats.zarr.merge import link_chunks, finish_merge, merge_stores
from actstore.formats.zarr.write import write_manifest, write_shard

__all__ = ["ACTS", "FORMAT_NAME", "MANIFEST", "MERGED", "TrainingPatternSampler", "ZarrActivationDataset",
           "ZarrRun", "ZarrStore", "choose_t_chunk", "collate_padded", "link_chunks", "detect", "finish_merge",
           "inspect", "merge_stores", "open_zarr", "read_vector", "shard_name", "verify", "write_manifest",
           "write_shard"]
