"""CUDA's autocast policy on CPU tensors: its op lists, the dtypes it gives, and the
activations a GPU's mixed-precision training saves, measured on a CPU."""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from partc import meta
from partc.passes import analyze
from partc.passes.autocast_policy import cuda_autocast, policy_ops
from partc.runtime.softmax import softmax as attention_softmax
from samples.gpt import gpt_tiny, loss_fn
from tests import models

B, T = 2, 16


def test_the_op_lists_are_the_ones_cuda_autocast_registers():
    """This torch build registers CUDA's autocast kernels even without CUDA: the lists
    must name exactly the aten ops they act on (a custom op's own rules, such as the
    sample MoE's grouped matmul once imported, are its own)."""
    assert policy_ops() == {
        name for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
        if name.startswith("aten::")}


def test_ops_take_cudas_dtypes_and_cpu_autocast_is_back_afterwards():
    with FakeTensorMode():
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        w = torch.randn(8, 8)
        with cuda_autocast(torch.bfloat16):
            assert torch.mm(w, w).dtype == torch.bfloat16
            assert F.softmax(x, -1).dtype == torch.float32            # fp32 output
            assert torch.ops.aten.softmax.int(x, -1).dtype == torch.float32   # as exported
            assert F.softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16
            assert F.layer_norm(x, (8,)).dtype == torch.float32       # fp32
            assert (x ** 2).dtype == torch.float32 and x.sum().dtype == torch.float32
            assert torch.ops.aten.norm.Scalar(x).dtype == torch.float32
            assert torch.addcmul(x, x, w[:4]).dtype == torch.float32   # widest input
            assert F.gelu(x).dtype == torch.bfloat16                    # not listed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F.softmax(x, -1).dtype == torch.bfloat16
            assert torch.mm(w, w).dtype == torch.bfloat16


def _measure(build, loss, device: str) -> tuple[torch.fx.GraphModule, dict]:
    ids = torch.zeros(B, T, dtype=torch.long)
    gm, analysis = analyze(build(), (ids,), loss_fn=loss, example_target=ids,
                           autocast=torch.bfloat16, autocast_device=device)
    return gm, {layer.name: layer.saved_bytes["none"] for layer in analysis.layers}


def test_gpt_on_gpus_computes_attention_probabilities_in_fp32_and_keeps_them_in_bf16():
    """A GPT block (64 wide, 4 heads, 16 positions), per sample under CUDA's policy:
    each LayerNorm its fp32 input (4096) and fp32 mean and rstd (128); each linear its
    input's bf16 cast (ln_1's, ln_2's, y: 2048 each); the scores' matmul q and k, views
    of the bf16 qkv (6144); masked_fill its mask (256 per batch: 128); the attention's
    softmax, computed in fp32, a bf16 copy of its output (4 x 16 x 16 x 2 = 2048:
    partc.runtime.softmax, not autograd's fp32 4096), and the next matmul a bf16 cast of
    that fp32 output (2048);
    GELU its bf16 input (8192) and c_proj GELU's bf16 output (8192). CPU autocast keeps
    softmax in bf16: one 2048-byte output, kept and read as it is. The loss: CUDA's
    cross_entropy runs log_softmax in the logits' bf16 (saved, 2 bytes a logit) and
    nll_loss in fp32 (its fp32 cast, 4 bytes), CPU's all of it in fp32 (4 bytes)."""
    _, cuda = _measure(gpt_tiny, loss_fn, "cuda")
    _, cpu = _measure(gpt_tiny, loss_fn, "cpu")
    layer_norms = 2 * (4096 + 128)
    linears = 3 * 2048 + 6144 + 8192 + 8192
    assert cuda["blocks.0"] == layer_norms + linears + 128 + 2048 + 2048
    assert cpu["blocks.0"] == layer_norms + linears + 128 + 2048
    assert cuda["loss"] - cpu["loss"] == T * 128 * 2
    assert {name: cuda[name] for name in cuda if name not in ("blocks.0", "blocks.1", "loss")} \
        == {name: cpu[name] for name in cpu if name not in ("blocks.0", "blocks.1", "loss")}


def test_llama_asks_for_its_fp32_softmax_and_norms_itself():
    """Hugging Face's Llama computes softmax (dtype=float32) and RMSNorm in fp32 as
    written (its exported graph calls aten's softmax with the dtype), so its blocks save
    the same under either policy; of the fp32 probabilities the attention's softmax
    keeps a bf16 copy (the whole traced batch: 2 x 4 heads x 16 x 16 x 2 bytes). Only
    the loss differs, as for GPT."""
    def build():
        return models.llama(n_layer=2)

    gm, cuda = _measure(build, models.causal_lm_loss, "cuda")
    _, cpu = _measure(build, models.causal_lm_loss, "cpu")
    assert cuda["loss"] - cpu["loss"] == T * 128 * 2
    assert {n: b for n, b in cuda.items() if n != "loss"} == \
        {n: b for n, b in cpu.items() if n != "loss"}
    softmax = [n for n in gm.graph.nodes if n.target is attention_softmax]
    assert [n.args[2] for n in softmax] == [torch.float32] * 2
    assert [meta.cost(n).saved_bytes for n in softmax] == [B * 4 * T * T * 2] * 2
