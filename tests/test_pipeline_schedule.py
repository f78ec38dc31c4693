"""The megatron engine's CPU pipeline schedule (``rlspmd.engines.pipeline``: GPipe over Gloo) on a toy model: 3
stages, micro-batches of different lengths; each stage's gradients equal the whole model's on one rank, and the
last stage's losses equal the whole model's. Needs no megatron-core."""

import pytest
import torch

from conftest import dist_script, torchrun


@pytest.mark.dist
def test_gpipe_gradients_equal_the_whole_model(tmp_path):
    torchrun([dist_script("pipeline_check.py"), str(tmp_path)], 3, timeout=300)
    ranks = [torch.load(tmp_path / f"pipeline_rank{r}.pt") for r in range(3)]
    assert ranks[0]["losses"] == ranks[1]["losses"] == []  # the loss runs on the last stage only
    torch.testing.assert_close(torch.stack(ranks[2]["losses"]), torch.stack(ranks[2]["ref_losses"]), rtol=0, atol=1e-6)
    seen = set()
    for r, res in enumerate(ranks):
        assert sorted(res["grads"]) == sorted(k for k in res["ref_grads"] if int(k.split(".")[0]) in (2 * r, 2 * r + 1))
        for name, grad in res["grads"].items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(grad, res["ref_grads"][name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert len(seen) == 12  # 6 layers x (weight, bias), each on one stage
