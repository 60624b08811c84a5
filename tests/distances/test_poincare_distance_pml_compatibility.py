"""The docs' table of PML losses and miners that take PoincareDistance / PoincareSimilarity is what they do today."""
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench")


@pytest.mark.filterwarnings("ignore")
def test_readme_compatibility_table_is_regenerated_from_the_losses():
    from bench import pml_compatibility
    table = pml_compatibility.table()
    with open(os.path.join(BENCH, os.pardir, "docs", "plug-into-pml.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert table in readme, "docs/plug-into-pml.md's compatibility table is stale: paste `python -m bench pml_compatibility`"
    # the losses the README's examples use must work, with the distance and with the similarity
    for name in ("TripletMarginLoss", "SupConLoss", "MultiSimilarityLoss", "ContrastiveLoss"):
        assert f"| loss | `{name}` | works | works |" in table
    assert "| miner | `MultiSimilarityMiner` | works | works |" in table
