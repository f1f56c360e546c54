"""SAE lookup tables (LUTs), exactly per ../shared/specs/lut-format.zh.md v1.0: one safetensors file
per target linear layer (the SAE encoder and decoder plus the decoder rows multiplied through the
target's weight) and a metadata.json. The runtime that uses them is `actstore.lut_runtime`; the stage
that builds them from an SAE is `actstore.lut`.

Rooms: layout (names, keys, shapes, dtypes: the only place that knows the bytes), write (precompute,
write_lut), read (LutStore), check (detect / inspect / verify / read_vector).
"""
from actstore.formats.lut.check import (detect, inspect, metadata_problems, read_metadata, read_vector, table_problems,
                                        verify)
from actstore.formats.lut.layout import (BIAS_KEY, DTYPES, LUT_DIR, META_FILE, REQUIRED_KEYS, SUFFIX, VERSION,
                                         expected_shapes, layer_index, lut_dir, lut_file)
from actstore.formats.lut.read import LutStore, open_lut
from actstore.formats.lut.write import precompute, write_lut

__all__ = ["BIAS_KEY", "DTYPES", "LUT_DIR", "META_FILE", "REQUIRED_KEYS", "SUFFIX", "VERSION", "LutStore",
           "detect", "expected_shapes", "inspect", "layer_index", "lut_dir", "lut_file", "metadata_problems",
           "open_lut", "precompute", "read_metadata", "read_vector", "table_problems", "verify", "write_lut"]
