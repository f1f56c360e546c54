"""The extraction intermediate (stage `extract`): one token-packed, lossless directory per part,
`{dump_to}/extract/{hash}/part-NNNN/`, and `extract.json` over all parts. Every format stage reads
it; `actstore.extract` writes it. Reference: docs/formats/extract.md.

Rooms: layout (file names, dtypes, .npy headers: the only place that knows the bytes), contract
(PartInfo: part.json typed, what every format writer reads), write
(PartWriter, write_part, write_index), read (Part, Extraction, open_part, open_extraction), check
(detect / inspect / verify / read_vector).
"""
from actstore.casts import to_float32
from actstore.formats.extract.check import detect, inspect, read_vector, verify
from actstore.formats.extract.contract import DatasetInfo, ModelInfo, PartInfo
from actstore.formats.extract.layout import (COUNT_KEYS, CUT_FIELD, FORMAT_NAME, FORMAT_VERSION, INDEX,
                                             NON_FINITE_KEY, NON_FINITE_LOGITS_KEY, OVERFLOW_KEY, PART_META,
                                             STORAGE_DESCR, layer_tensor, npy_header, part_dirname, tensor_file)
from actstore.formats.extract.read import (Extraction, Part, PartFile, PartsCheck, StoredTensor, load_npy,
                                           open_extraction, open_part, part_reads)
from actstore.formats.extract.write import PartWriter, synthetic_extraction, write_index, write_part

__all__ = ["COUNT_KEYS", "CUT_FIELD", "FORMAT_NAME", "FORMAT_VERSION", "INDEX", "NON_FINITE_KEY",
           "NON_FINITE_LOGITS_KEY", "OVERFLOW_KEY", "PART_META", "STORAGE_DESCR", "DatasetInfo", "Extraction",
           "ModelInfo", "Part", "PartFile", "PartInfo", "PartsCheck",
           "PartWriter", "StoredTensor", "detect", "inspect", "layer_tensor", "load_npy", "npy_header",
           "open_extraction", "open_part", "part_dirname", "part_reads", "read_vector", "synthetic_extraction",
           "tensor_file", "to_float32", "verify", "write_index", "write_part"]
