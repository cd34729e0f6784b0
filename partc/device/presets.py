"""The device presets: each device's figures (vendor figures, the usual node shape and
partc's measurements), by name.

A preset is a :class:`partc.device.figures.DeviceFigures`, which says what each figure is
and in what unit, under a name and the torch device type it runs as. Torch-free, so that
the command line can list and check device names before it imports torch;
:mod:`partc.device.budget` builds a DeviceBudget on them. ``flops_efficiency`` is
measured on an H100 for the Hopper presets (_HOPPER_MATMULS), a guess for the others.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from partc.device.figures import DeviceFigures, missing

TFLOPS = 1e12
GB = 1e9


# Eager dispatch per op on a GPU's host, forward and backward (see _GPU_HOST).
_GPU_DISPATCH_S = 8.5e-6
_GPU_DISPATCH_BACKWARD_S = 18e-6
# A GPU's own time per kernel beyond its bytes and FLOPs (launch, ramp-up, tail), which
# dispatching ahead does not hide: 3 us, from two `benchmarks/gpu_check.py` profiles of
# a 419M GPT on an H100 (torch 2.11). Measured kernel time = a x priced + t x kernels over
# the full-recompute step (2368 kernels) and the step of 8 microbatches (11220) gives t =
# 2.6 us; the 8-microbatch step measured 44 ms above the one-microbatch step where the
# cost model without it priced 14 ms: 3.8 us over the 7868 more kernels it counts.
# Not yet measured directly; `partc calibrate` on a GPU does, and its profile replaces it.
_GPU_KERNEL_S = 3e-6

# What every GPU preset's host and links do (DeviceFigures says what each figure is):
# - the op overheads: the host dispatches ahead of the kernels, so they are a floor under
#   a layer's time, not added to it: eager PyTorch's dispatch, about 8.5 us per op
#   forward and 18 us backward, as `partc calibrate` measured it on an H100's host
#   (torch 2.11). A 12-layer GPT split into microbatches of one sequence ran at that
#   pace there. The matmul overhead stays 0;
# - the kernel overhead, _GPU_KERNEL_S;
# - FSDP2's own work under ZeRO-2/3: 0, its hooks, bookkeeping and copy kernels' launches
#   run on the host ahead of the GPU's kernels (not measured on one);
# - comm_overlap 1: NCCL runs on its own SMs and copy engines;
# - split_backward_factor 1 (not measured: the second autograd walk hides behind queued
#   kernels).
# A profile measured on the machine replaces them all.
_GPU_HOST = dict(op_overhead_s=_GPU_DISPATCH_S, op_overhead_backward_s=_GPU_DISPATCH_BACKWARD_S,
                 matmul_overhead_s=0.0, kernel_overhead_s=_GPU_KERNEL_S,
                 fsdp_unit_overhead_s=0.0, fsdp_unit_overhead_backward_s=0.0,
                 fsdp_gather_overhead_s=0.0, fsdp_scatter_overhead_s=0.0,
                 fsdp_step_overhead_s=0.0, comm_overlap=1.0, split_backward_factor=1.0)


# What a GPU's memory holds beside the plan's tensors (partc.device.usable takes it from
# the total CUDA reports and plans against the rest):
# - context_memory, 512 MiB: the CUDA context is about 300 MB since CUDA 11.7 loads
#   kernels lazily (pytorch/pytorch#107667, a PyTorch maintainer; over 1 GB before), and
#   cuBLAS's and cuDNN's workspaces come on top;
# - communicator_memory, 688 MB per NCCL communicator a rank joins: on 4 A100s with NVLink,
#   each process group of more than 2 GPUs added 688 MB, of 2 GPUs 544 MB, through
#   PyTorch (NVIDIA/nccl#964); NCCL's maintainers (NVIDIA/nccl#986) say the memory grows
#   with the channels (more to reach H100's NVLink bandwidth) and the connections, and
#   stops growing beyond 2 nodes. Not measured on an H100;
# - memory_fragmentation, 0.05: PyTorch's caching allocator rounds blocks and keeps
#   segments that freed tensors leave in pieces; a share of a few percent of the memory
#   is reserved but not allocated at a training step's peak. A guess, not measured here.
# `benchmarks/gpu_check.py --part memory` on a GPU prints the total CUDA reports, the
# context's size and the allocator's reserved-over-allocated at the step's peak.
_GPU_MEMORY_RESERVE = dict(context_memory=512 * 2**20, communicator_memory=688 * 10**6,
                           memory_fragmentation=0.05)

# The memory each GPU reports to CUDA (torch.cuda.get_device_properties(i).total_memory),
# below the vendor's nominal figure (the driver keeps the rest), as printed by torch or
# deviceQuery on these GPUs in public logs:
# - H100 80GB HBM3 (SXM): 85,029,158,912 bytes (79.19 GiB; torch 2.7 prints 81089 MiB);
# - H200 (SXM, 141 GB): 143,156 MiB (139.8 GiB), torch's print on a Modal H200;
# - A100-SXM4-80GB: 81,221.8 MiB (79.32 GiB), cudaGetDeviceProperties;
# - A100-SXM4-40GB: 40,536 MiB (39.59 GiB), torch's (and Paddle's) print.
# The driver's share varies a little by driver version: a profile or --memory replaces it.
_REPORTED = {"H100-80GB": 85_029_158_912, "H200": 143_156 * 2**20,
             "A100-80GB": 85_167_243_264, "A100-40GB": 40_536 * 2**20}


@dataclass(frozen=True, kw_only=True)
class DevicePreset(DeviceFigures):
    """A device's figures under its name, and the torch device type it runs as (whose
    autocast policy is that device's). Every figure a device must have is given;
    ``None`` where a figure falls back (elementwise_bandwidth: HBM bandwidth, ...)."""

    name: str
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        super().__post_init__()
        if missing(self):
            raise ValueError(f"preset {self.name} lacks {', '.join(missing(self))}")


# Hopper's attention: Transformer Engine runs it on cuDNN's fused flash kernel there
# (preferred over FlashAttention-2 on Hopper since TE 1.x), and the FlashAttention-3
# paper (Shah et al. 2024, figs. 5-6: H100 80GB SXM5, bf16, head dim 128, 4k tokens)
# measured cuDNN at 518 TFLOP/s forward with a causal mask and 499 backward: 0.50-0.52
# of the 989.4 dense peak, where large bf16 matmuls reach about 0.7 (partc calibrate
# measured 0.70 on an H100). FlashAttention-2 measured 0.32-0.37 there.
_HOPPER_ATTENTION = 0.5

# Hopper's bf16 matmuls: `partc calibrate` on an H100 SXM (torch 2.11, cuBLAS) measured
# linear layers' shapes at 0.697 of the dense peak and square ones of 2048^3 and more at
# 0.71-0.72. The Hopper presets' flops_efficiency. (A training step runs somewhat below
# both rates: `benchmarks/gpu_check.py`'s full-recompute step spent 563 ms in its matmul
# and memory-bound kernels where they price 493; docs/calibrate.md.)
_HOPPER_MATMULS = 0.70

# torch's AdamW on a GPU (its default, the foreach form: several passes over the state)
# steps at this share of the GPU's memory bandwidth, in the bytes the cost model charges
# a step (Precision.step_bytes, 28 per fp32 parameter): `partc calibrate` on an H100
# (torch 2.11) measured 927 GB/s against 3036 GB/s for a plain copy. The GPU presets'
# optimizer_bandwidth.
_GPU_ADAMW_SHARE = 0.3

# A GPU's element-wise kernels (norms, activations, softmax, masks, casts, copies, forward
# and backward) move the bytes the estimate counts for them at this share of the GPU's
# nominal memory bandwidth: on an H100 (torch 2.11) `partc calibrate`'s mix of them ran
# at 2.50 TB/s (its forward and measured backward bytes over its time) of a nominal
# 3.35, a plain copy at 3.04. Below a copy: kernels that broadcast an input run
# unvectorized (masked_fill with a (seq, seq) mask, 1.4 TB/s), row reductions over a
# wide vocabulary (log_softmax, 1.5 TB/s). The Hopper presets' elementwise_bandwidth
# (the H200's kernels are Hopper's); the A100s', not measured, stay at HBM bandwidth.
_GPU_ELEMENTWISE_SHARE = 0.75

# The host of a GPU node, for offload (DeviceFigures.host_memory and the rest):
# - memory per node, as NVIDIA ships its 8-GPU systems: DGX H100 and DGX H200 2 TB,
#   DGX A100 640GB (the 80 GB cards) 2 TB, DGX A100 320GB (40 GB cards) 1 TB;
# - the host link per GPU and direction: a PCIe Gen5 x16 slot carries 64 GB/s raw, and
#   pinned copies measure about 50-55 GB/s on an H100 or H200 (CUDA's bandwidthTest),
#   Gen4 x16 about 25 GB/s on an A100; 50 and 25 here, one GPU copying alone (where two
#   GPUs share a switch's uplink, each gets less when both copy);
# - the host's Adam: a guess of the order the ZeRO-Offload paper (Ren et al., 2021)
#   reports for its vectorised CPU Adam on a two-socket Xeon host, a few billion
#   parameter updates per second per node; the newer hosts of Hopper nodes (two 56-core
#   Sapphire Rapids) are taken at 4e9, A100 nodes' (two 64-core EPYC Rome) at 3e9.
#   `partc calibrate` measures the machine's own (benchmarks/host_adam.py compares it
#   with torch's AdamW).
_HOPPER_HOST = dict(host_memory=2 * 10**12, host_to_device_bandwidth=50 * GB,
                    device_to_host_bandwidth=50 * GB, host_adam_rate=4e9)
_AMPERE_HOST = dict(host_to_device_bandwidth=25 * GB, device_to_host_bandwidth=25 * GB,
                    host_adam_rate=3e9)

# Hopper's dense FP8 tensor-core peak (NVIDIA's H100 SXM and H200 datasheets: 3,958
# TFLOP/s FP8 "with sparsity", half of it dense), twice the bf16 peak. The A100s have no
# FP8 matmuls; the CPU preset none either (torchao emulates FP8 there, at fp32's rate).
_HOPPER_FP8 = 1978.9 * TFLOPS

# Hopper's FP8 matmuls reach a smaller share of their peak than bf16's reach of theirs
# (_HOPPER_MATMULS, 0.7): 0.6, so that they run 1.7 times bf16's rate, not twice. Fitted
# to torchao's published H100 microbenchmark (its float8 README: a layer norm, a linear
# and a sigmoid, forward and backward, compiled, float8 tensorwise against bf16): 1.39
# times as fast at M, K, N = 4096, 8192, 16384, where the matmuls are nearly all of the
# time; the cost model gives 1.40 at 0.6 and 1.57 at 0.7. Measured with it, on one H200
# (benchmarks/gpu_check.py, the 12-layer GPT 1536 wide, 32 x 1024 tokens, compiled, 48
# linears FP8): 182.3 ms a step in bf16, 168.9 ms with FP8, 1.08 times, where the H200
# preset prices 1.22 (1.30 at 0.7). Linears 1536 wide gain less than the large shape's
# share says: FP8 matmuls fall further below their peak than bf16's as the shapes shrink,
# which one share per device does not model. The microbenchmark's small shape (1024,
# 2048, 1024: 0.80 published) is priced 0.70: either way FP8 does not pay there.
_HOPPER_FP8_MATMULS = 0.6

PRESETS: dict[str, DevicePreset] = {
    preset.name: preset
    for preset in (
        DevicePreset(
            name="A100-40GB", **_GPU_HOST, **_AMPERE_HOST, host_memory=10**12,
            peak_flops={"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                        "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
            memory=_REPORTED["A100-40GB"], nominal_memory=40 * 2**30,
            **_GPU_MEMORY_RESERVE, hbm_bandwidth=1555 * GB, devices_per_node=8,
            optimizer_bandwidth=_GPU_ADAMW_SHARE * 1555 * GB,
            intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
            link_latency_s=10e-6, intra_node_latency_s=2e-6, flops_efficiency=0.6),
        DevicePreset(
            name="A100-80GB", **_GPU_HOST, **_AMPERE_HOST, host_memory=2 * 10**12,
            peak_flops={"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                        "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
            memory=_REPORTED["A100-80GB"], nominal_memory=80 * 2**30,
            **_GPU_MEMORY_RESERVE, hbm_bandwidth=2039 * GB, devices_per_node=8,
            optimizer_bandwidth=_GPU_ADAMW_SHARE * 2039 * GB,
            intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
            link_latency_s=10e-6, intra_node_latency_s=2e-6, flops_efficiency=0.6),
        DevicePreset(
            name="H100-80GB", **_GPU_HOST, **_HOPPER_HOST,
            peak_flops={"float32": 67 * TFLOPS, "tf32": 494.7 * TFLOPS,
                        "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS},
            fp8_peak_flops=_HOPPER_FP8, fp8_efficiency=_HOPPER_FP8_MATMULS,
            memory=_REPORTED["H100-80GB"], nominal_memory=80 * 2**30,
            **_GPU_MEMORY_RESERVE, hbm_bandwidth=3350 * GB, devices_per_node=8,
            elementwise_bandwidth=_GPU_ELEMENTWISE_SHARE * 3350 * GB,
            optimizer_bandwidth=_GPU_ADAMW_SHARE * 3350 * GB,
            intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
            link_latency_s=8e-6, intra_node_latency_s=2e-6, flops_efficiency=_HOPPER_MATMULS,
            attention_efficiency=_HOPPER_ATTENTION),
        DevicePreset(
            name="H200", **_GPU_HOST, **_HOPPER_HOST,
            peak_flops={"float32": 67 * TFLOPS, "tf32": 494.7 * TFLOPS,
                        "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS},
            fp8_peak_flops=_HOPPER_FP8, fp8_efficiency=_HOPPER_FP8_MATMULS,
            memory=_REPORTED["H200"], nominal_memory=141 * 10**9,
            **_GPU_MEMORY_RESERVE, hbm_bandwidth=4800 * GB, devices_per_node=8,
            elementwise_bandwidth=_GPU_ELEMENTWISE_SHARE * 4800 * GB,
            optimizer_bandwidth=_GPU_ADAMW_SHARE * 4800 * GB,
            intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
            link_latency_s=8e-6, intra_node_latency_s=2e-6, flops_efficiency=_HOPPER_MATMULS,
            attention_efficiency=_HOPPER_ATTENTION),
        DevicePreset(
            name="CPU",
            peak_flops={"float32": 0.2 * TFLOPS, "bfloat16": 0.2 * TFLOPS,
                        "float16": 0.1 * TFLOPS},
            # Host memory: no context, gloo's buffers and malloc's slack are small.
            memory=16 * 2**30, hbm_bandwidth=20 * GB, devices_per_node=64,
            context_memory=0, communicator_memory=0, memory_fragmentation=0.0,
            intra_node_bandwidth=5 * GB, inter_node_bandwidth=1.25 * GB,
            link_latency_s=50e-6, intra_node_latency_s=50e-6,
            flops_efficiency=0.5, device_type="cpu",
            # Offload on a CPU moves state between tensors in the same memory: the link is
            # a copy's rate (hbm_bandwidth's); the host memory is left to the user (the
            # ranks' own memory is the same RAM). torch's fused AdamW stepped 1.7e8
            # parameters per second (4M of them, 2 threads) on the shared 2-core machine
            # lightly loaded, 1.1e7 under a load of 27 (benchmarks/host_adam.py).
            host_to_device_bandwidth=20 * GB, device_to_host_bandwidth=20 * GB,
            host_adam_rate=1.5e8,
            # Eager PyTorch's dispatch on one CPU thread: about 10 us per op forward and
            # twice that in backward (autograd's node plus the gradient kernels), which the
            # op's own work does not hide on a CPU; 2 us per matmul call beyond its FLOPs.
            # Round figures of what `partc calibrate` measured on a shared 2-core x86
            # machine (14 and 30 us per op, 0-3 us per matmul).
            op_overhead_s=10e-6, op_overhead_backward_s=20e-6, matmul_overhead_s=2e-6,
            kernel_overhead_s=0.0,
            # FSDP2 under ZeRO-2/3, per unit (a transformer block's 12 tensors) and
            # microbatch: its hooks, and its own work around each all-gather and
            # reduce-scatter, its copies apart, which run at 6 GB/s; AdamW's step over
            # DTensors, per tensor. Round figures of `partc calibrate --quick` on the same
            # machine (2 gloo ranks: 135-195 and 105-140 us of hooks forward and
            # backward, 550-640 us per all-gather, 430-490 us per reduce-scatter, copies
            # at 4.9-6.9 GB/s, 135-145 us per tensor's step).
            fsdp_unit_overhead_s=150e-6, fsdp_unit_overhead_backward_s=120e-6,
            fsdp_gather_overhead_s=600e-6, fsdp_scatter_overhead_s=450e-6,
            fsdp_step_overhead_s=140e-6, fsdp_copy_bandwidth=6 * GB,
            comm_overlap=0.0, split_backward_factor=1.25),
    )
}
# Other names of one preset. A family name that several presets share ("A100": the 40 GB
# and the 80 GB card) is no alias: preset() refuses it with the choices.
_ALIASES = {"H100": "H100-80GB", "H200-141GB": "H200"}


DEFAULT_DEVICE = "H100-80GB"


def preset(name: str) -> DevicePreset:
    """The preset called ``name`` (case-insensitive, or an alias such as "H100"); a
    ValueError naming the choices when several presets share the name ("A100": 40 or 80
    GB), or the closest names when none has it."""
    key = {alias.lower(): n for alias, n in _ALIASES.items()}.get(str(name).lower(), name)
    matches = [p for n, p in PRESETS.items() if n.lower() == str(key).lower()]
    if matches:
        return matches[0]
    family = [n for n in PRESETS if n.lower().split("-")[0] == str(name).lower()]
    if len(family) > 1:
        raise ValueError(f"{name} is ambiguous: {', '.join(family)}")
    raise ValueError(f"unknown device {name!r}{_did_you_mean(str(name))}; "
                     f"presets: {', '.join(PRESETS)}")


def _did_you_mean(name: str) -> str:
    names = {n.lower(): (n,) for n in (*PRESETS, *_ALIASES)}
    for n in PRESETS:   # a family name stands for each of its presets
        family = n.lower().split("-")[0]
        names[family] = names.get(family, ()) + (n,) if family != n.lower() else (n,)
    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.6)
    shown = dict.fromkeys(repr(n) for c in close for n in names[c])
    return f" (did you mean {' or '.join(shown)}?)" if shown else ""
