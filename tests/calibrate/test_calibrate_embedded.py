"""The shipped SmolLM2 calibration config on the embedded model, with two short traces."""

from __future__ import annotations

import pytest

from rolecall.calibrate import cli
from rolecall.core.manifest import RoleManifest


@pytest.mark.slow
def test_embedded_model_calibrates_with_its_shipped_config(tmp_path, cache_dir):
    from rolecall.core.models import load_model

    out = tmp_path / "smollm2.delta.safetensors"
    argv = ["--prompts", "arithmetic:2", "--max-new-tokens", "48", "--min-context", "64", "--num-pages", "2",
            "--recent-pages", "1", "--device", "cpu", "--output", str(out), "--quiet", "--no-plots"]
    assert cli.main(argv) == 0
    m = RoleManifest.load(out)
    m.validate_for(load_model("smollm2-135m"))
    assert m.model.num_layers == 30 and m.layer_role[:2].tolist() == [0, 0] and m.delta_layers[0] == 2
    assert len(m.delta_layers) == 3 and m.config["stride"] == 8  # from configs/calibrate/smollm2-135m.yaml
    # a trained model's attention is far from uniform and changes between layers
    assert m.layer_sparsity.mean().item() > 0.2 and m.layer_shift[1:].max().item() > 0.05
    assert 0.3 < m.metrics["recall_mean"] < 1.0
