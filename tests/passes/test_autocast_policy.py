"""CUDA's autocast policy on CPU tensors: its op lists, the dtypes it gives, and the
activations a GPU's mixed-precision training saves, measured on a CPU."""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from partc import meta
from partc.passes import analyze
from partc.autocast_policy import cuda_autocast, cuda_policy, policy_ops
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



def test_blocks_open_at_once_share_the_rules_until_the_last_ends():
    """The runtime keeps the policy open across steps while an estimate or a check opens
    it again (torch before 2.12 refuses a second Python kernel for the same op): both
    blocks see CUDA's rules, in whichever order they end, and CPU autocast's are back
    once both have."""
    def softmax_dtype() -> torch.dtype:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.softmax(torch.randn(2, 4, dtype=torch.bfloat16), -1).dtype

    first, second = cuda_policy(torch.bfloat16), cuda_policy(torch.bfloat16)
    first.__enter__()
    second.__enter__()
    assert softmax_dtype() == torch.float32
    first.__exit__(None, None, None)          # the outer block ends first
    assert softmax_dtype() == torch.float32
    second.__exit__(None, None, None)
    assert softmax_dtype() == torch.bfloat16
    with cuda_policy(torch.bfloat16):         # and installs again afterwards
        assert softmax_dtype() == torch.float32

def _measure(build, loss, device: str) -> tuple[torch.fx.GraphModule, dict]:
    ids = torch.zeros(B, T, dtype=torch.long)
    gm, analysis = analyze(build(), (ids,), loss_fn=loss, example_target=ids,
                           autocast=torch.bfloat16, autocast_device=device)
    return gm, {layer.name: layer.saved_bytes["none"] for layer in analysis.layers}


def test_gpt_computes_attention_probabilities_in_fp32_and_keeps_them_in_bf16():
    """A GPT block (64 wide, 4 heads, 16 positions), per sample, as the runtime runs it
    in bf16 (bf16 parameters under CUDA's policy, which its CPU ranks apply too, so a
    CPU budget measures the same): each LayerNorm its bf16 input (2048) and fp32 mean
    and rstd (128), and returns bf16 (partc.runtime.norm: autocast's fp32 LayerNorm
    would keep an fp32 copy of its input, 4096, and fp32 copies of its bf16 weight and
    bias, 512 per microbatch: 256); each linear its bf16 input (ln_1's, ln_2's, y: 2048
    each); the scores' matmul q and k, views of the bf16 qkv (6144); masked_fill its
    mask (256 per batch: 128); the attention's softmax, computed in fp32, a bf16 copy of
    its output (4 x 16 x 16 x 2 = 2048: partc.runtime.softmax, not autograd's fp32
    4096), which it hands the next matmul as its input (the one copy both keep; a
    separate bf16 cast of the fp32 output for the matmul would keep 2048 more); GELU its bf16
    input (8192) and c_proj GELU's bf16 output (8192). The loss runs outside autocast
    on the logits cast to fp32 (partc.runtime.rank_build.PlannedLoss): log_softmax keeps
    its fp32 output (4 bytes a logit), nll_loss the int64 target and its fp32 total weight
    (4 bytes per batch)."""
    _, cuda = _measure(gpt_tiny, loss_fn, "cuda")
    _, cpu = _measure(gpt_tiny, loss_fn, "cpu")
    layer_norms = 2 * (2048 + 128)
    linears = 3 * 2048 + 6144 + 8192 + 8192
    assert cuda["blocks.0"] == layer_norms + linears + 128 + 2048
    assert cuda["loss"] == T * 128 * 4 + T * 8 + 4 / B
    assert cpu == cuda   # no dropout: the devices' kernels keep the same


def test_llama_asks_for_its_fp32_softmax_and_norms_itself():
    """Hugging Face's Llama computes softmax (dtype=float32) and RMSNorm in fp32 as
    written (its exported graph calls aten's softmax with the dtype); of the fp32
    probabilities the attention's softmax keeps a bf16 copy (the whole traced batch:
    2 x 4 heads x 16 x 16 x 2 bytes). Either device measures the same."""
    def build():
        return models.llama(n_layer=2)

    gm, cuda = _measure(build, models.causal_lm_loss, "cuda")
    _, cpu = _measure(build, models.causal_lm_loss, "cpu")
    assert cpu == cuda
    softmax = [n for n in gm.graph.nodes if n.target is attention_softmax]
    assert [n.args[2] for n in softmax] == [torch.float32] * 2
    assert [meta.cost(n).saved_bytes for n in softmax] == [B * 4 * T * T * 2] * 2
