"""Pickle shard stores (spec ../shared/specs/pickle-shard-format.md, version 1.0).

One store = `metadata.json` + gzipped pickle shards; each extraction part (machine) writes its own
store `machine-NNNN/` and a merged `metadata.json` references their shards in place. Shards are
only ever loaded after their size and sha256 check, through a restricted unpickler.

Rooms: layout (file names, metadata keys, bytes), write (per-machine writer, merge), unpickler
(restricted unpickling), read (verified loading, Dataset), check (detect / inspect / verify /
read_vector). Docs: docs/formats/pickle.md.
"""
from actstore.formats.pickle.check import detect, inspect, read_vector, verify
from actstore.formats.pickle.layout import machine_dirname, shard_filename
from actstore.formats.pickle.read import (ActivationDataset, collate_padded, item_tokens, iter_activations,
                                          iter_layer_items, load_metadata, load_shard)
from actstore.formats.pickle.unpickler import safe_loads
from actstore.formats.pickle.write import LEVELS, dump_shard, merge_machines, shard_items, write_machine

__all__ = ["LEVELS", "ActivationDataset", "collate_padded", "detect", "dump_shard", "inspect", "item_tokens",
           "iter_activations", "iter_layer_items", "load_metadata", "load_shard", "machine_dirname",
           "merge_machines", "read_vector", "safe_loads", "shard_filename", "shard_items", "verify", "write_machine"]
