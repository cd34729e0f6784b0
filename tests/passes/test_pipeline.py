"""analyze() on real models: layer names, signatures, parameter counts and FLOPs; and the
pass runner on a tiny hand-built graph: timed, named in errors, verified."""

import logging
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from partc import meta
from partc.passes import analyze
from partc.passes.pipeline import FAKE_TENSOR_LOGGER, Pass, named, run_pass
from partc.identity import model_hash
from samples.gpt import gpt_small, gpt_tiny, loss_fn
from tests import models
from tests.passes.tiny_graphs import context, tiny_graph, tokens, with_loss

B, T = 2, 16


def ids(batch=B, seq=T, device="cpu"):
    return torch.zeros(batch, seq, dtype=torch.long, device=device)


def unique_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_verify_is_on_in_tests():
    assert os.environ["PARTC_VERIFY"] == "1"


def test_gpt_tiny_flops_match_the_formula():
    model = gpt_tiny()
    gm, analysis = analyze(model, (ids(),), loss_fn=loss_fn)
    names = [l.name for l in analysis.layers]
    assert names == ["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1", "ln_f",
                     "lm_head", "loss"]
    d, L, V = 64, 2, 128
    # Matmuls: 12 d² weights per block and the d × V head, 2 FLOPs per weight per token;
    # attention: q·k and p·v, 2 · T² · d each per block.
    expected = 2 * T * (L * 12 * d * d + d * V) + L * 4 * T * T * d
    assert sum(l.fwd_flops for l in analysis.layers) == expected
    s = analysis.summary
    assert (s.tracer, s.traced_batch_size, s.tokens_per_sample, s.traced_dtype_bytes) == (
        "symbolic_trace", B, T, 4)
    assert s.num_params == unique_params(model)
    assert [p for p, _ in meta.pass_times(gm)] == ["trace", "drop_assertions", "propagate",
                                                  "attention_softmax", "layers", "estimate"]


def test_gpt_small_on_meta():
    with torch.device("meta"):
        model = gpt_small()
    _, analysis = analyze(model, (ids(1, 1024, "meta"),), loss_fn=loss_fn)
    assert analysis.summary.num_params == unique_params(model)  # ~124M, tied head
    blocks = [l for l in analysis.layers if l.name.startswith("blocks.")]
    assert len(blocks) == 12 and len({l.signature for l in blocks}) == 1
    d, T1, V = 768, 1024, 50304
    expected = 2 * T1 * (12 * 12 * d * d + d * V) + 12 * 4 * T1 * T1 * d
    assert sum(l.fwd_flops for l in analysis.layers) == pytest.approx(expected, rel=1e-9)


def test_model_hash_ignores_values_and_follows_shapes():
    a, b = gpt_tiny(), gpt_tiny()
    with torch.device("meta"):
        c = gpt_tiny()
    assert model_hash(a) == model_hash(b) == model_hash(c)
    assert model_hash(gpt_tiny(n_embd=32)) != model_hash(a)


def test_hugging_face_gpt2():
    model = models.gpt2()
    _, analysis = analyze(model, (ids(),))
    assert [l.name for l in analysis.layers] == [
        "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
        "transformer.h.1", "transformer.ln_f", "lm_head"]
    assert analysis.layers[3].signature == analysis.layers[4].signature
    assert analysis.summary.num_params == unique_params(model)
    assert analysis.summary.tracer == "export"
    (tied,) = analysis.shared
    assert set(tied.fqns) == {"transformer.wte.weight", "lm_head.weight"}


def test_hugging_face_llama_with_grouped_query_attention():
    model = models.llama()
    _, analysis = analyze(model, (ids(),))
    assert [l.name for l in analysis.layers] == [
        "model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
        "model.norm", "lm_head"]
    assert analysis.layers[2].signature == analysis.layers[3].signature
    assert analysis.summary.num_params == unique_params(model)
    d, kv, ff, V, L = 64, 32, 128, 128, 2  # kv: 2 KV heads of 16
    expected = 2 * T * (L * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * V) + L * 4 * T * T * d
    assert sum(l.fwd_flops for l in analysis.layers) == expected
    block = analysis.layers[2]
    assert "selective" in block.saved_bytes
    assert block.saved_bytes["full"] < block.saved_bytes["selective"] < block.saved_bytes["none"]


def test_hugging_face_bert():
    model = models.bert()
    _, analysis = analyze(model, (ids(),))
    assert [l.name for l in analysis.layers] == [
        "embeddings", "encoder.layer.0", "encoder.layer.1", "pooler"]
    assert analysis.layers[1].signature == analysis.layers[2].signature
    assert analysis.summary.num_params == unique_params(model)


def test_keyword_inputs_go_through_export():
    model = models.llama()
    _, analysis = analyze(model, (), kwargs={"input_ids": ids()})
    assert analysis.summary.tracer == "export"
    assert analysis.summary.traced_batch_size == B


def test_errors_name_the_pass():
    def bad_loss(output, target):
        raise ValueError("boom")

    with pytest.raises(ValueError) as info:
        analyze(models.MLP(), (torch.randn(B, 8),), loss_fn=bad_loss,
                example_target=torch.randn(B, 4))
    assert any("propagate" in note for note in info.value.__notes__)


# ------------------------------------------------------------------------ the runner

def test_the_runner_times_each_pass():
    model, gm = tiny_graph()
    seen = []

    def look(graph, ctx):
        seen.append(graph)
        return graph

    ctx = context(model, (tokens(),))
    assert run_pass(Pass("look", look), gm, ctx) is gm
    assert run_pass(Pass("look_again", look), gm, ctx) is gm
    assert seen == [gm, gm]
    assert [name for name, _ in meta.pass_times(gm)] == ["look", "look_again"]
    assert all(seconds >= 0 for _, seconds in meta.pass_times(gm))


def test_an_error_inside_a_pass_names_the_pass_and_the_node():
    model, gm = tiny_graph()

    def lower_relu(graph, ctx):
        for node in graph.graph.nodes:
            if node.name == "relu":
                raise NotImplementedError("no lowering for relu")
        return graph

    with pytest.raises(NotImplementedError, match="no lowering for relu") as info:
        run_pass(Pass("lower_relu", lower_relu), gm, context(model, (tokens(),)))
    (note,) = info.value.__notes__
    assert note.startswith("partc: raised in pass 'lower_relu' at node 'relu' (%relu ")


def _target_after_the_embedding(graph, ctx):
    """Breaks "placeholders first": the target moves after a call node (which does not
    read it, so the graph still lints)."""
    nodes = {node.name: node for node in graph.graph.nodes}
    nodes["embedding"].append(nodes["target"])
    graph.recompile()
    return graph


def test_verify_catches_a_pass_that_breaks_an_invariant(monkeypatch):
    model, gm = tiny_graph()
    target = torch.randint(0, 16, (6,))
    gm = with_loss(model, gm, (tokens(),), target)
    broken = Pass("recompute", _target_after_the_embedding)
    with pytest.raises(AssertionError, match=r"after pass 'recompute', node 'target' "
                                             r"\(.*\): placeholders must come first"):
        run_pass(broken, gm, context(model, (tokens(),), target=target))
    # Without PARTC_VERIFY the runner does not look.
    monkeypatch.setenv("PARTC_VERIFY", "0")
    model, gm = tiny_graph()
    gm = with_loss(model, gm, (tokens(),), target)
    assert run_pass(broken, gm, context(model, (tokens(),), target=target)) is gm
    assert [n.name for n in gm.graph.nodes][:4] == ["tokens", "embed_weight", "embedding",
                                                    "target"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _failing_meta_kernel() -> None:
    """An op whose meta kernel refuses float32 (torch logs that at error level)."""
    with FakeTensorMode():
        torch._grouped_mm(torch.randn(8, 16), torch.randn(2, 16, 4),
                          torch.tensor([4, 8], dtype=torch.int32))


def test_fake_tensor_error_logs_are_debug_inside_passes_only():
    fake_log, partc_log = logging.getLogger(FAKE_TENSOR_LOGGER), logging.getLogger("partc")
    seen, debug = _Records(), _Records()
    fake_log.addHandler(seen)
    partc_log.addHandler(debug)
    level = partc_log.level
    partc_log.setLevel(logging.DEBUG)
    filters = list(fake_log.filters)
    try:
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            _failing_meta_kernel()
        assert [r.levelno for r in seen.records] == [logging.ERROR]   # torch's own way
        seen.records.clear()
        with pytest.raises(RuntimeError, match="BF16") as raised:
            named("estimate", _failing_meta_kernel)
        assert seen.records == []          # no error-level line for the user to read
        assert "partc: raised in pass 'estimate'" in raised.value.__notes__[0]
        assert any("Expected inputs of BF16 type" in r.getMessage()
                   and r.levelno == logging.DEBUG for r in debug.records)
        assert fake_log.filters == filters   # restored on the way out
        with pytest.raises(RuntimeError):
            _failing_meta_kernel()
        assert [r.levelno for r in seen.records] == [logging.ERROR]
    finally:
        fake_log.removeHandler(seen)
        partc_log.removeHandler(debug)
        partc_log.setLevel(level)
