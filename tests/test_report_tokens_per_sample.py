"""Review 62 of the report's plots: what they read at 10^8 samples."""
import numpy as np

from actstore import report
from actstore.formats.extract import open_extraction, synthetic_extraction


def test_tokens_per_sample_counts_every_sample_from_the_offsets_without_parsing_its_rows(tmp_path, monkeypatch):
    """The histogram is of each sample's token count as the parts' offsets give it, all samples of all
    parts; samples.jsonl is not parsed (its text at 23 MB/s: minutes past validate_plots' 30 at scale)."""
    root = synthetic_extraction(tmp_path / "x", 300_000, 3, 8, [1], tokens=(4, 300))
    extraction = open_extraction(root)
    counts = np.concatenate([np.diff(np.load(part / "offsets.npy")) for part in sorted(root.glob("part-*"))])
    for rows in root.glob("part-*/samples.jsonl"):
        rows.write_text("not JSON\n")  # what the plot must not read
    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.update(
        bins=[patch.get_data() for patch in fig.axes[0].patches], title=fig.axes[0].get_title()))
    report.tokens_per_sample(extraction, tmp_path / "tokens.png")
    assert drawn["title"] == f"Tokens per sample (n={len(counts)})" and len(counts) > 3
    (samples, edges, _), = drawn["bins"]
    assert np.array_equal(edges, np.histogram_bin_edges(counts, bins=40))
    assert np.array_equal(samples, np.histogram(counts, bins=edges)[0]) and samples.sum() == len(counts)
