import dataclasses

import torch
from torch import nn

from partc import meta
from partc.passes import analyze
from partc.problem import HeavyOp
from samples.gpt import gpt_tiny, loss_fn
from tests import models

B = 2


def test_mlp_costs_by_hand():
    """fc1: 8 → 16, relu, fc2: 16 → 4, batch 2; every number per sample, fp32."""
    gm, analysis = analyze(models.MLP(), (torch.randn(B, 8),))
    fc1, fc2 = analysis.layers
    assert fc1.fwd_flops == 2 * 8 * 16 and fc2.fwd_flops == 2 * 16 * 4
    # Saved for backward: fc1 keeps x (for the weight grad), relu keeps its output,
    # fc2 keeps its input; weights are parameters and never counted.
    # Selective would drop relu's output but must keep fc1's output to rerun relu: the
    # same bytes, so the layer offers no selective mode.
    assert fc1.saved_bytes == {"none": 8 * 4 + 16 * 4, "full": 8 * 4}
    assert fc2.saved_bytes == {"none": 16 * 4, "full": 16 * 4}
    assert fc1.recompute_mem_bytes == {"none": 0, "full": 2 * 16 * 4}
    assert fc1.recompute_flops == {"none": 0, "full": fc1.fwd_flops}
    assert fc1.fwd_mem_bytes == 2 * 16 * 4  # only relu is not compute-heavy
    assert fc1.workspace_bytes == 16 * 4
    assert (fc1.param_count, fc1.param_bytes) == (8 * 16 + 16, (8 * 16 + 16) * 4)
    assert fc1.num_nodes == 2 and fc2.num_nodes == 1
    costs = {n.name: meta.cost(n) for n in gm.graph.nodes if n.op.startswith("call_")}
    assert costs["linear"].compute_heavy and not costs["relu"].compute_heavy
    assert costs["linear"].flops == 2 * B * 8 * 16
    assert costs["relu"].saved_bytes == B * 16 * 4
    assert costs["relu"].bytes_moved == 2 * B * 16 * 4
    # For the roofline: fc1's matmul moves x and its output per sample and reads its
    # weight and bias once per microbatch.
    assert costs["linear"].weight_bytes == (8 * 16 + 16) * 4
    assert costs["linear"].bytes_moved == B * (8 + 16) * 4
    assert fc1.heavy_ops == (HeavyOp(flops=2 * 8 * 16, activation_bytes=(8 + 16) * 4,
                                     weight_bytes=(8 * 16 + 16) * 4, linear=(8, 16),
                                     linear_names=("fc1.weight",)),)
    # Backward as autograd runs it, matmuls apart: relu's gradient reads the incoming
    # gradient and relu's output and writes one (3 x 16 floats a sample); a bias's
    # gradient sums the batch's output gradients (B x out read, out written). The input
    # needs no gradient.
    assert fc1.bwd_mem_bytes == 3 * 16 * 4 + (B * 16 + 16) * 4 / B
    assert fc2.bwd_mem_bytes == (B * 4 + 4) * 4 / B
    # Kernels per microbatch: fc1 forward its addmm and relu; backward relu's gradient,
    # the weight's gradient (a matmul) and the bias's (a sum), none for the input; fc2
    # also the input's gradient. Full recompute launches the forward's again.
    assert fc1.kernels == {"forward": 2, "backward": 3, "recompute": {"none": 0, "full": 2}}
    assert fc2.kernels == {"forward": 1, "backward": 3, "recompute": {"none": 0, "full": 1}}


class _Accumulating(nn.Module):
    """A projection and a batched product accumulating into their outputs in place
    (``out.addmm_``, ``out.baddbmm_``), or the same out of place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.weight = nn.Parameter(torch.randn(16, 8))
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self.bias.expand(x.shape[0], 16).clone()
        h = start.addmm_(x, self.weight.t()) if self.in_place \
            else torch.addmm(start, x, self.weight.t())
        pairs = h.view(-1, 4, 4)
        start = pairs.clone()
        return (start.baddbmm_(pairs, pairs) if self.in_place
                else torch.baddbmm(start, pairs, pairs)).relu()


def test_products_accumulating_in_place_are_counted_as_out_of_place():
    """FlopCounterMode has no formula for ``addmm_``/``baddbmm_``: partc counts theirs
    as the out-of-place ops', prices them as matmuls (not views that move nothing),
    and their bytes read and write the accumulator."""
    out_of_place = analyze(_Accumulating(False), (torch.randn(B, 8),))[1].layers
    gm, analysis = analyze(_Accumulating(True), (torch.randn(B, 8),))
    for layers in (out_of_place, analysis.layers):
        assert sum(layer.fwd_flops for layer in layers) == 2 * 8 * 16 + 2 * 4 * 4 * 4
        assert sum(len(layer.heavy_ops) for layer in layers) == 2
    products = [meta.cost(n) for n in gm.graph.nodes if n.op.startswith("call_")
                and str(n.target).endswith(("addmm_", "baddbmm_"))]
    assert len(products) == 2
    assert all(c.compute_heavy and not c.is_view for c in products)
    # addmm_: x (8) and the accumulator (16) read, the accumulator written, per sample.
    assert products[0].bytes_moved == B * (8 + 16 + 16) * 4


class _VectorProducts(nn.Module):
    """The products FlopCounterMode has no formula for: matrix-vector (``mv``,
    ``addmv``), a batch summed into one matrix (``addbmm``) and a dot product."""

    def __init__(self) -> None:
        super().__init__()
        self.vector = nn.Parameter(torch.randn(8))
        self.start = nn.Parameter(torch.randn(8))
        self.corner = nn.Parameter(torch.randn(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.mv(x, self.vector)                     # (B,): 2 B 8
        pooled = torch.addmv(self.start, x.t(), scores)        # (8,): 2 8 B
        pairs = x.view(x.shape[0], 2, 4)
        summed = torch.addbmm(self.corner, pairs, pairs.transpose(1, 2))  # 2 B 2 4 2
        return summed.sum() + torch.dot(pooled, self.vector)   # 2 8


def test_vector_products_are_counted_as_matmuls():
    gm, analysis = analyze(_VectorProducts(), (torch.randn(B, 8),))
    flops = 2 * B * 8 + 2 * 8 * B + 2 * B * 2 * 4 * 2 + 2 * 8
    assert sum(layer.fwd_flops for layer in analysis.layers) * B == flops
    products = [meta.cost(n) for n in gm.graph.nodes if n.op == "call_function"
                and getattr(n.target, "__name__", "") in ("mv", "addmv", "addbmm", "dot")]
    assert len(products) == 4
    assert all(c.compute_heavy and c.flops > 0 for c in products)


class _ProjectedLoss(nn.Module):
    """A loss with parameters of its own: the loss layer is one ``call_module`` node."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.proj(output), target)


def test_a_modules_own_parameters_are_its_weight_bytes():
    gm, analysis = analyze(models.MLP(), (torch.randn(B, 8),), loss_fn=_ProjectedLoss(),
                           example_target=torch.zeros(B, dtype=torch.long))
    (loss,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert meta.cost(loss).weight_bytes == (4 * 3 + 3) * 4
    assert analysis.layers[-1].heavy_ops[0].weight_bytes == (4 * 3 + 3) * 4


def test_view_ops_move_no_bytes():
    gm, _ = analyze(models.gpt2(), (torch.zeros(B, 16, dtype=torch.long),))
    views = [n for n in gm.graph.nodes if n.op == "call_function" and "view" in n.name]
    assert views and all(meta.cost(n).is_view and meta.cost(n).bytes_moved == 0 for n in views)


def test_tied_parameter_counted_once_and_shared():
    model = gpt_tiny()
    _, analysis = analyze(model, (torch.zeros(B, 16, dtype=torch.long),), loss_fn=loss_fn)
    unique = {id(p): p for p in model.parameters()}.values()
    assert analysis.summary.num_params == sum(p.numel() for p in unique)
    (tied,) = analysis.shared
    assert set(tied.fqns) == {"tok_emb.weight", "lm_head.weight"}
    names = [layer.name for layer in analysis.layers]
    assert tied.layers == (names.index("tok_emb"), names.index("lm_head"))
    assert tied.param_count == 128 * 64
    owned = sum(layer.param_count for layer in analysis.layers)
    assert owned + tied.param_count == analysis.summary.num_params


def test_loss_layer_saves_the_log_softmax():
    _, analysis = analyze(gpt_tiny(), (torch.zeros(B, 16, dtype=torch.long),), loss_fn=loss_fn)
    loss = analysis.layers[-1]
    assert loss.name == "loss"
    log_softmax = 16 * 128 * 4  # per sample: (seq, vocab) fp32
    assert loss.saved_bytes["none"] >= log_softmax
    assert loss.saved_bytes["full"] == 16 * 128 * 4 + 16 * 8  # logits and int64 targets
    # Rerunning log-softmax needs the logits, so selective recompute saves nothing here.
    assert loss.saved_bytes.get("selective", loss.saved_bytes["none"]) >= log_softmax
    assert analysis.cut_bytes[-1] == 16 * 128 * 4  # the target does not cross


def test_identical_layers_are_measured_once_and_copied():
    gm, analysis = analyze(gpt_tiny(n_layer=3), (torch.zeros(B, 8, dtype=torch.long),))
    blocks = [l for l in analysis.layers if l.name.startswith("blocks.")]
    assert len({l.signature for l in blocks}) == 1
    assert len({(l.fwd_flops, tuple(l.saved_bytes.items())) for l in blocks}) == 1
    for node in gm.graph.nodes:
        if node.op.startswith("call_"):
            assert meta.cost(node) is not None


def test_value_read_by_every_block_is_held_once_by_its_maker():
    """``cos(x)`` depends on no parameter, so it carries no gradient: each block's product
    saves it (for the linear's gradient) but not the linear's output, as at run time.
    Every block reads it and the model holds it once: the stem, which makes it, is charged
    for it in every mode (x for its linear, cos(x) held), the blocks only for their own
    input (8 fp32 each, per sample)."""
    for full_trace in (True, False):
        _, analysis = analyze(models.SharedScale(), (torch.randn(B, 8),),
                              full_trace=full_trace)
        stem, *blocks, _ = analysis.layers
        assert stem.saved_bytes == {"none": 2 * 8 * 4, "full": 2 * 8 * 4}
        assert [block.saved_bytes for block in blocks] == [{"none": 8 * 4, "full": 8 * 4}] * 3


def test_mixed_precision_is_measured_as_autocast_runs_it():
    """Under bf16 autocast fc1 saves its input cast to bf16 (2 bytes each) and relu its
    bf16 output, which fc2 reads as made: 2 bytes each, also as fc2's input under full
    recompute. Autocast's bf16 copies of the weights are not activations; fc1's input
    is the model's, fp32."""
    _, analysis = analyze(models.MLP(), (torch.randn(B, 8),), autocast=torch.bfloat16)
    assert analysis.summary.autocast == "bfloat16"
    fc1, fc2 = analysis.layers
    assert fc1.saved_bytes == {"none": 8 * 2 + 16 * 2, "full": 8 * 4}
    assert fc2.saved_bytes == {"none": 16 * 2, "full": 16 * 2}
    assert fc1.workspace_bytes == 16 * 2
    # The matmul reads the bf16 copy of its weight and bias, the fp32 input, writes bf16.
    assert fc1.heavy_ops == (HeavyOp(flops=2 * 8 * 16, activation_bytes=8 * 4 + 16 * 2,
                                     weight_bytes=(8 * 16 + 16) * 2, linear=(8, 16),
                                     linear_names=("fc1.weight",)),)


def test_a_model_on_the_meta_device_is_measured_under_autocast_as_on_cpu():
    """Autocast does not act on meta tensors: a meta model's layers are run on fake CPU
    stand-ins (the exported graph's devices, its rotary subgraph's included, moved)."""
    def layers(device: str):
        with torch.device(device):
            model = models.llama(n_layer=2)
        ids = torch.zeros(B, 16, dtype=torch.long, device=device)
        _, analysis = analyze(model, (ids,), loss_fn=models.causal_lm_loss,
                              example_target=ids, autocast=torch.bfloat16)
        return [dataclasses.replace(layer, signature="") for layer in analysis.layers]

    assert layers("meta") == layers("cpu")   # signatures hash the device


class _WrittenAttention(nn.Module):
    """Attention written out, with a causal mask buffer and dropout on the probabilities."""

    def __init__(self, width: int = 8, seq: int = 6) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.full((seq, seq), -1e9).triu(1))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.width, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * self.width ** -0.5
        probs = self.drop((scores + self.mask).softmax(-1))
        return x + self.out(probs @ v)


def test_selective_recompute_drops_what_only_the_attention_core_keeps():
    """By hand, per sample, fp32 for a GPU (analyze's default device): the layer keeps x
    (the qkv projection's input), the qkv output (q and k for their product, v for the
    second), softmax's output, dropout's mask (CUDA's native_dropout: one byte), the
    probabilities after dropout and the out projection's input. Rerunning the core
    drops the three (seq x seq) ones; its inputs (views of the qkv output) are kept
    anyway. Its FLOPs are the two products'."""
    width, seq = 8, 6
    _, analysis = analyze(nn.Sequential(_WrittenAttention(width, seq)),
                          (torch.randn(B, seq, width),))
    [layer] = analysis.layers
    square = seq * seq
    kept = seq * width * 4 + seq * 3 * width * 4 + seq * width * 4
    assert layer.saved_bytes["none"] == kept + 4 * square + square + 4 * square
    assert layer.saved_bytes["selective"] == kept
    assert layer.recompute_flops["selective"] == 2 * (2 * seq * seq * width)
    # Rerun: the two products, the scale, the mask's add, softmax and dropout.
    assert layer.recompute_nodes["selective"] == 6


def test_a_layer_without_attention_has_no_selective_mode():
    _, analysis = analyze(models.MLP(), (torch.randn(B, 8),))
    assert all(layer.modes == ("none", "full") for layer in analysis.layers)


class _CausalAttention(nn.Module):
    """A projection, causal SDPA and dropout on its output: what the runtime's device
    changes in the estimate."""

    def __init__(self, dim: int = 16, dropout: float = 0.1, causal: bool = True) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(dropout)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.drop(y.squeeze(1))


def _attention_costs(device: str, **kwargs) -> tuple[float, float]:
    """(SDPA's FLOPs, dropout's saved bytes) measured for ``device``."""
    gm, _ = analyze(_CausalAttention(**kwargs), (torch.randn(B, 32, 16),),
                    autocast_device=device)
    nodes = {n.name: n for n in gm.graph.nodes}
    return (meta.cost(nodes["scaled_dot_product_attention"]).flops,
            meta.cost(nodes["dropout"]).saved_bytes)


def test_causal_attention_and_dropout_as_the_device_runs_them():
    """Causal SDPA counts half its (seq x seq) products where the kernel skips masked
    blocks: on a GPU always, on a CPU only without dropout (the flash kernel; with
    dropout SDPA takes the math path). Dropout on a GPU is CUDA's native_dropout, which
    saves a 1-byte mask; a CPU saves its fp32 noise."""
    full = 4 * B * 32 * 32 * 16      # q @ k^T and probs @ v, fp32 (B, 1, 32, 16)
    flops, saved = _attention_costs("cuda")
    assert flops == full // 2
    assert saved == B * 32 * 16 * 1  # bool mask
    flops, saved = _attention_costs("cpu")
    assert flops == full // 2        # the model's own SDPA call runs without dropout
    assert saved == B * 32 * 16 * 4  # fp32 noise
    assert _attention_costs("cuda", causal=False)[0] == full
    # No dropout: nothing saved for it on either device.
    assert _attention_costs("cuda", dropout=0.0)[1] == 0


class _MaskedSoftmax(nn.Module):
    """A projection's scores, masked out of place, then softmax (fp32 under autocast)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("keep", torch.ones(width, width, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).masked_fill(~self.keep, float("-inf")).softmax(-1)


def _masked_softmax_costs(autocast: torch.dtype) -> tuple[meta.NodeCost, meta.NodeCost]:
    gm, _ = analyze(_MaskedSoftmax(), (torch.randn(B, 8, 8),), autocast=autocast,
                    autocast_device="cuda")
    nodes = {n.name: n for n in gm.graph.nodes}
    return meta.cost(nodes["masked_fill"]), meta.cost(nodes["softmax"])


def test_casts_and_copies_as_cuda_runs_them():
    """On a GPU, softmax under autocast widens a bf16 input by a cast of its own (ATen
    fuses the widening into the kernel for fp16 only), and an out-of-place masked_fill
    is a clone then masked_fill_: both kernels' bytes are counted."""
    n = B * 8 * 8                      # the scores' elements per traced batch
    for dtype, size, widening in ((torch.bfloat16, 2, (2 + 4) * n), (torch.float16, 2, 0)):
        masked_fill, softmax = _masked_softmax_costs(dtype)
        # Reads the 16-bit scores and writes them (the mask, a buffer, is its weight),
        # and copies them once (read and written) before filling in place.
        assert masked_fill.bytes_moved == size * n + size * n + 2 * size * n
        assert softmax.cast_bytes == widening, dtype
        assert softmax.casts == (1 if widening else 0)


def test_backward_bytes_as_the_device_runs_them():
    """A layer's backward is measured, not taken as twice its forward: masked_fill's
    gradient is again a copy then a fill (4 passes), softmax's reads its output and the
    gradient and writes one (3), and on a GPU CUDA's kernel first multiplies the two as a
    kernel of its own (3 more). A layer whose backward the stand-ins cannot run is
    charged twice its forward."""
    n = B * 8 * 8
    for device, softmax in (("cpu", 3), ("cuda", 6)):
        _, analysis = analyze(_MaskedSoftmax(), (torch.randn(B, 8, 8),),
                              autocast_device=device)
        proj, scores = analysis.layers
        assert proj.bwd_mem_bytes == (n + 8) * 4 / B   # the bias's gradient
        assert scores.bwd_mem_bytes == (4 + softmax) * n * 4 / B, device
        assert scores.bwd_mem_bytes != 2 * scores.fwd_mem_bytes
    unmeasured = dataclasses.replace(scores, backward_mem_bytes=None)
    assert unmeasured.bwd_mem_bytes == 2 * scores.fwd_mem_bytes


def test_every_layer_of_a_transformer_has_its_backward_measured():
    """The sample GPT in bf16 as a GPU runs it: every layer's backward runs on the fake
    stand-ins (autocast's casts back, the loss's gradient over the vocabulary)."""
    model = gpt_tiny()
    ids = torch.randint(0, model.config.vocab_size, (B, 16))
    _, analysis = analyze(model, (ids,), loss_fn=loss_fn, example_target=ids,
                          autocast=torch.bfloat16, autocast_device="cuda")
    assert all(layer.backward_mem_bytes is not None for layer in analysis.layers)
    blocks = [layer for layer in analysis.layers if layer.name.startswith("blocks.")]
    assert blocks and all(0 < b.bwd_mem_bytes for b in blocks)
    assert len({b.bwd_mem_bytes for b in blocks}) == 1
    # Their kernels are counted too (the dropout of probability 0 launches none: ATen
    # returns its input), alike for alike blocks: a block's backward launches more than
    # its forward (two matmuls per forward one, the norms' and biases' sums), and
    # selective recompute reruns a part of the forward's.
    assert all(layer.forward_kernels is not None and layer.backward_kernels is not None
               for layer in analysis.layers)
    assert {layer.name for layer in analysis.layers if not layer.forward_kernels} == {"drop"}
    assert len({(b.forward_kernels, b.backward_kernels) for b in blocks}) == 1
    block = blocks[0].kernels
    assert block["backward"] > block["forward"] > block["recompute"]["selective"] > 0
    assert block["recompute"]["full"] == block["forward"]


def test_sequence_parallel_linears_measure_the_rings_local_work():
    """Under sequence parallelism each block's column- and row-parallel linears run as
    rings on ranks (a matmul and a copy or an add per chunk): the estimate measures what
    that adds to the blocking stand-in (``LayerCost.ring_kernels``,
    ``ring_bwd_mem_bytes``), which ``as_rings`` adds in; without sequence parallelism
    there are no rings."""
    import partc
    from partc.compiler import build_problem

    ids = torch.randint(0, 128, (B, 32))
    graph, analysis = analyze(gpt_tiny(), (ids,), loss_fn=loss_fn, example_target=ids)
    problem = build_problem(analysis, partc.DeviceBudget(num_devices=2, device="H100-80GB"),
                            partc.TrainSpec(global_batch_size=B),
                            partc.Constraints(tp=2), graph)
    # The memory-first layout keeps the blocks' boundaries sharded and gathers just
    # before the linears (the fastest one gathers this small model's blocks earlier).
    blocks = [layer for layer in problem.variant(2, True, "memory").layers
              if layer.name.startswith("blocks.")]
    assert blocks and all(layer.ring_kernels["forward"] > 0 < layer.ring_kernels["backward"]
                          for layer in blocks)
    block = blocks[0]
    ringed = block.as_rings(B)
    assert ringed.forward_kernels == block.forward_kernels + block.ring_kernels["forward"]
    assert ringed.backward_kernels == block.backward_kernels + block.ring_kernels["backward"]
    assert ringed.bwd_mem_bytes == block.bwd_mem_bytes + block.ring_bwd_mem_bytes
    assert ringed.as_rings(B) == ringed
    # One sample's chunks are received and written in place: fewer kernels and bytes.
    single = block.as_rings(1)
    assert single.forward_kernels < ringed.forward_kernels
    assert single.backward_kernels < ringed.backward_kernels
    assert single.bwd_mem_bytes < ringed.bwd_mem_bytes
    assert not any(layer.ring_kernels or layer.ring_bwd_mem_bytes
                   for layer in problem.variant(2, False, "time").layers)


def test_experts_grouped_matmuls_are_counted_where_the_router_is_not_recognised():
    """Seen before: PhiMoE, whose router picks its experts by ``max`` (no ``topk``, so
    no mixture-of-experts layer is recognised), was measured without its experts'
    FLOPs: Hugging Face runs them on its custom op ``transformers::grouped_mm_fallback``,
    which FlopCounterMode does not know. Per sample of 16 tokens, each layer: q and o
    (64 x 64) and k and v (64 x 32), 24,576 FLOPs a token; the router (64 x 4), 512;
    two experts of a gate-and-up (64 x 64) and a down (32 x 64) projection, 24,576;
    and attention's two products, 2 x 2 x 16 x 16 x 16 x 4 = 65,536."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                          num_experts_per_tok=2, vocab_size=128, use_cache=False)
    ids = torch.randint(1, 128, (2, 16))
    _, analysis = analyze(PhimoeForCausalLM(config), (ids,), loss_fn=models.causal_lm_loss,
                          example_target=ids)
    (layer,) = [layer for layer in analysis.layers if layer.name == "model.layers.0"]
    assert layer.moe is None
    assert layer.fwd_flops == 16 * (24576 + 512 + 24576) + 65536
