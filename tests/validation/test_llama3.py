"""The joint search on Llama 3 405B's published mesh (``tests/validation/llama3.py``):
partc's own plan for 8,192 H100 is never predicted slower than its plan of the
published tp 8, pp 16, dp 64, and that plan never slower than Llama 3's split of it
under plain 1F1B or any interleaving Megatron-Core could run that fits. Slow: the model
traces 126 layers on the meta device and the search plans 8,192 devices twice."""

from __future__ import annotations

import pytest

from tests.validation import llama3


def test_the_split_is_llama_3s():
    names = ("model.embed_tokens", "model.rotary_emb",
             *(f"model.layers.{i}" for i in range(126)), "model.norm", "lm_head", "loss")
    plain = llama3.llama_runs(names, 16)
    assert [sum(names[l].startswith("model.layers.") for l in run) for run in plain] \
        == [7] + [8] * 14 + [7]
    assert plain[0][:2] == [0, 1] and plain[-1][-3:] == [128, 129, 130]
    finest = llama3.llama_runs(names, 128)
    assert finest[0] == [0, 1] and finest[-1] == [128, 129, 130]
    assert all(len(run) == 1 for run in finest[1:-1])
    with pytest.raises(ValueError, match="do not fill"):
        llama3.llama_runs(names[:-4] + names[-3:], 16)


@pytest.mark.slow
def test_the_joint_search_is_at_least_as_fast_as_llama_3s_mesh_and_its_interleavings():
    own = llama3.planned(False).predicted.step_time_s
    mesh = llama3.planned(True)
    assert own <= mesh.predicted.step_time_s * (1 + 1e-9)
    limit = llama3.problem(True).devices.memory_bytes[0]
    layouts = [layout for layout in llama3.megatron_layouts()
               if layout.peak_bytes <= limit]
    assert layouts, "none of Megatron's layouts fits"
    for layout in layouts:
        assert mesh.predicted.step_time_s <= layout.step_s * (1 + 1e-9), layout.chunks
