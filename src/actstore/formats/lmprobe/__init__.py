"""lmprobe 2.0 datasets (../shared/specs/lmprobe-format-2.0.md): a parquet index + per-layer safetensors shards.

Layout of a dataset root (`{stage dir}/dataset/` of the lmprobe stage):
  index/train-00000-of-00001.parquet   one row per prompt, whatever the split (the spec's and lmprobe's only
                                       index path); all metadata in schema metadata `lmprobe:*`
  tensors/hidden_layer{L:03d}_shard{S:03d}.safetensors   key `hidden.layer_{L}`, (rows, dim)
  tensors/logits_topk_{S:03d}.safetensors               `topk_values` f32 / `topk_indices` i64, (rows, k)
  README.md        dataset card            SHA256SUMS   `sha256sum -c` list of every other file
actstore's choices (docs/formats/lmprobe.md): shards 0..last_token_shards-1 hold the last-token vector of
every prompt; a sequence shard holds *all* tokens of each of its prompts contiguously (the last token is
duplicated there, so one slice returns a whole prompt); a prompt never spans two shards.
Extensions (optional keys): info `prompt_ordering_seed`, `dataset`, `files` {path: {bytes, sha256}};
columns `sample_idx`, `label_id`, `token_logprob`.

Rooms: layout (names, dtypes, the safetensors header codec, the dataset card), write (write_dataset; or scattered:
write_job per job, then finish_dataset),
read (LmprobeDataset, the torch ProbeDataset), check (detect/inspect/verify/read_vector, check_options).
"""
from actstore.formats.lmprobe.check import check_options, detect, inspect, read_vector, verify
from actstore.formats.lmprobe.layout import DATASET_DIR
from actstore.formats.lmprobe.read import LmprobeDataset, find_index, open_dataset, read_info
from actstore.formats.lmprobe.write import check_dataset_labels, finish_dataset, write_dataset, write_job

__all__ = ["DATASET_DIR", "LmprobeDataset", "check_dataset_labels", "check_options", "detect", "find_index",
           "finish_dataset", "inspect", "open_dataset", "read_info", "read_vector", "verify", "write_dataset",
           "write_job"]
