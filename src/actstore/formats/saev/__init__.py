"""The saev sharded activation protocol 2.1 (../shared/specs/saev-protocol.md), to the byte.

Store layout (flavor spec: `<dump_to>/saev/<HASH>/`, HASH = full sha256 of the canonical metadata.json;
flavor upstream: `<dump_to>/saev/shards/<8 hex>/`, saev's hash of its own field set):
  metadata.json    the spec's 12 fields, nothing else (so HASH depends on spec fields only); upstream:
                   saev's 13 (two renamed, pixel_agg added)
  shards.json      [{"name": "acts000000.bin", "n_examples": S}, ...], exactly the spec's fields
  acts%06d.bin     raw C-order float32 (S, L, T, D), no header; upstream pads the last shard to
                   examples_per_shard with a hole (sparse), n_examples in shards.json stays true
  labels.bin       optional per-patch labels: raw C-order uint8 (n_examples, patches_per_ex), no CLS
                   column (saev's layout); written from segmentation masks by the caller's PatchLabeler
                   (saev.patch_labels; actstore.patch_labels in the workflow) or attached later with
                   write_labels()
  windows.npy      text stores only (optional extension): int64 (n_examples, 3) rows
                   (sample_idx, token_start, n_valid): example e = tokens token_start..+n_valid of
                   dataset row sample_idx; tokens n_valid..T-1 are zero padding
  actstore.json    optional extension: sizes and checksums of every shard (SHA-256 tree hash; a plain
                   sha256 in older stores) and windows.npy / labels.bin (sha256),
                   the source extraction, registers; not part of HASH (stores saev wrote have none)
Text models: each sample's tokens are cut into windows of T = tokens_per_window tokens that never
cross samples; a sample's last, shorter window is zero-padded (n_valid in windows.npy says where).

Rooms: layout (names, fields, dtype, shard arithmetic, the `data` encoding), write (plan + shards +
labels), read (SaevStore: spec §4 addressing, ordered reads), check (detect / inspect / verify /
read_vector), loader (ShuffledActivations, the shuffled torch training loader; import it from
actstore.formats.saev.loader, so that opening a store does not import torch).
"""
from actstore.formats.saev.check import detect, inspect, read_vector, verify
from actstore.formats.saev.layout import (METADATA_FIELDS, PROTOCOL, SIDECAR, UPSTREAM_FIELDS, decode_data,
                                          encode_data, metadata_hash, upstream_hash)
from actstore.formats.saev.read import SaevStore, open_store, resolve
from actstore.formats.saev.write import (PatchLabeler, Plan, check_options, extraction_fill, finish_store, plan_store,
                                         write_labels, write_pointer, write_raw_store, write_shards, write_store)

__all__ = [
    "METADATA_FIELDS", "PROTOCOL", "SIDECAR", "UPSTREAM_FIELDS", "PatchLabeler", "Plan", "SaevStore", "check_options",
    "decode_data", "detect", "encode_data", "extraction_fill", "finish_store", "inspect", "metadata_hash", "open_store",
    "plan_store", "read_vector", "resolve", "upstream_hash", "verify", "write_labels", "write_pointer",
    "write_raw_store", "write_shards", "write_store",
]
