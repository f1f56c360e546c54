"""TopK sparse autoencoders for the LUT stage: the sae stage trains one on a captured hook tensor
(Gao et al. 2024's recipe) or imports a SAELens/saev checkpoint, and writes sae.safetensors (the LUT
spec's key names) and report.json (held-out FVU on whole samples, loss curve).

Rooms: model (TopKSAE, init, AuxK loss), data (held-out split, memmap batch streaming, Prefetcher),
train (training loop, evaluation, hook choice), checkpoint (import, save/load), stage (build_sae).
"""
from actstore.sae.checkpoint import REPORT_FILE, SAE_FILE, import_sae, load_sae
from actstore.sae.data import Prefetcher, data_mean, iter_rows, split_tokens, stream_batches, tensors
from actstore.sae.model import TopKSAE, auxk_loss, init_sae
from actstore.sae.stage import build_sae
from actstore.sae.train import evaluate, train_steps

__all__ = ["REPORT_FILE", "SAE_FILE", "Prefetcher", "TopKSAE", "auxk_loss", "build_sae", "data_mean", "evaluate",
           "import_sae", "init_sae", "iter_rows", "load_sae", "split_tokens", "stream_batches",
           "tensors", "train_steps"]
