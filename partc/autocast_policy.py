"""CUDA's autocast policy, applied to CPU tensors: mixed precision measured as a GPU runs it.

Under ``torch.autocast`` each aten op computes in the low-precision dtype, in fp32, or in
the widest of its inputs' dtypes, as the device's policy says; autocast casts the op's
floating inputs before autograd records the op, so what the op saves for backward has
those dtypes. CUDA's policy is not CPU's: CUDA runs softmax, log_softmax, the norms,
exp/log/pow/rsqrt, sums, products and the losses in fp32, where CPU autocast leaves most
of them in their input's dtype (unfused attention on a GPU saves fp32 probabilities, on a
CPU bf16 ones). Planning for GPUs on a CPU therefore measures under CUDA's policy.

:func:`cuda_autocast` runs a block under ``torch.autocast("cpu")`` with CUDA's rules in
place of CPU autocast's at the ``AutocastCPU`` dispatch key. Acting at autocast's own
key, above autograd, the rules reach every aten op as CUDA's do: whether an fx graph
names a torch function, an ``F.*`` function or a module (``symbolic_trace``) or an aten
overload (``torch.export``), and the ops inside composite ones (``cross_entropy`` is
``log_softmax`` then ``nll_loss``, both fp32). Every floating tensor but a double counts
as one CUDA's autocast would cast (the CPU tensors stand for CUDA ones).

Source: PyTorch's ``aten/src/ATen/autocast_mode.cpp`` (the kernels registered for the
``Autocast`` key, which is CUDA's) and the op lists it expands from
``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``), torch 2.13. ``tests/passes/test_autocast_policy.py`` checks the
lists against the ``AutocastCUDA`` kernels of the torch build in use.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Ops are named as aten registers them: "name" for the default overload, "name.overload".

# Computed in the low-precision dtype: every floating input cast to it.
LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)

# Computed in fp32: every floating input cast to it.
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
    "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)

# Output dtype fp32 unless the call names one (their ``dtype`` argument), when the first
# input is floating: the op reads its input as it is and computes and returns fp32.
FP32_OUTPUT = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
    "sum", "sum.dim_IntList",
)

# Overloads without a dtype argument, run as the overload with one, fp32 when the first
# input is floating (norm does not promote its input implicitly).
FP32_APPENDED = {"norm.Scalar": "norm.ScalarOpt_dtype",
                 "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

# Computed in the widest floating dtype among the inputs (fp32 if any is fp32).
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)

# Refused under CUDA autocast (unsafe in low precision; BCE with logits is the safe one).
BANNED = ("binary_cross_entropy",)


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Autocast to ``dtype`` on CPU tensors with CUDA's policy, inside the block only:
    CUDA's rules replace CPU autocast's kernels, and CPU autocast's other kernels (ops
    CUDA's autocast leaves alone) pass the call on unchanged."""
    with cuda_policy(dtype), torch.autocast("cpu", dtype=dtype):
        yield


@contextlib.contextmanager
def cuda_policy(dtype: torch.dtype) -> Iterator[None]:
    """CUDA's autocast rules in place of CPU autocast's, inside the block, for every CPU
    autocast region entered there (the runtime enters it once per step on CPU ranks,
    where its stage's forward runs under ``torch.autocast("cpu")``; installing the
    rules costs milliseconds). Blocks open at once for the same dtype share one
    installation, which goes when the last of them ends, in whatever order they end:
    torch before 2.12 refuses a second Python kernel for an op and key, and later ones
    would let one block's end remove the rules of another still open."""
    shared = _SHARED.get(dtype)
    if shared is None:
        library = torch.library.Library("aten", "IMPL")
        shared = _SHARED[dtype] = [library, 0]
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore",
                                        "(?s).*Overriding a previously registered kernel")
                for name, kernel in _kernels(dtype).items():
                    library.impl(name, kernel, "AutocastCPU")
        except BaseException:
            del _SHARED[dtype]
            library._destroy()
            raise
    shared[1] += 1
    try:
        yield
    finally:
        shared[1] -= 1
        if shared[1] == 0:
            del _SHARED[dtype]
            shared[0]._destroy()   # CPU autocast's own kernels are in force again


# The rules installed now, per dtype: the library holding them and the blocks open.
_SHARED: dict[torch.dtype, list] = {}


def policy_ops() -> set[str]:
    """Every op CUDA's autocast acts on, as the dispatcher names them ("aten::mm")."""
    names = (*LOWER_PRECISION, *FP32, *FP32_OUTPUT, *FP32_APPENDED, *PROMOTE, *BANNED)
    return {f"aten::{name}" for name in names}


def _kernels(low: torch.dtype) -> dict[str, Callable]:
    # CPU autocast's own aten kernels pass through; other namespaces' (a custom op's
    # torch.library.register_autocast) are the op's own rules and stay.
    kernels: dict[str, Callable] = {
        name.removeprefix("aten::"): torch.library.fallthrough_kernel
        for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
        if name.startswith("aten::")}
    rules = ([(name, _cast_to(low)) for name in LOWER_PRECISION]
             + [(name, _cast_to(torch.float32)) for name in FP32]
             + [(name, _fp32_output) for name in FP32_OUTPUT]
             + [(name, _fp32_appended(_op(target))) for name, target in FP32_APPENDED.items()]
             + [(name, _promote(low)) for name in PROMOTE]
             + [(name, _banned) for name in BANNED])
    for name, rule in rules:
        kernels[name] = _below_autocast(_op(name), rule)
    return kernels


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _below_autocast(op: torch._ops.OpOverload, rule: Callable) -> Callable:
    """The kernel: ``rule`` casts and calls ``op`` with autocast off, as CUDA's kernels do
    (the ops an autocast op runs inside are not autocast again)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return rule(op, args, kwargs)
    return kernel


def _eligible(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() \
        and value.dtype != torch.float64


def _cast(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Walked by hand rather than with pytree: an op's arguments are tensors, scalars and
    # lists of tensors, and these kernels run for every matmul and norm of a step, where
    # pytree's generality cost ~100 us a call (more than a small matmul).
    return (tuple(_cast_value(dtype, a) for a in args),
            {name: _cast_value(dtype, a) for name, a in kwargs.items()} if kwargs else kwargs)


def _cast_value(dtype: torch.dtype, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if _eligible(value) and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_value(dtype, v) for v in value)
    return value


def _cast_to(dtype: torch.dtype) -> Callable:
    def rule(op, args, kwargs):
        args, kwargs = _cast(dtype, args, kwargs)
        return op(*args, **kwargs)
    return rule


def _promote(low: torch.dtype) -> Callable:
    def rule(op, args, kwargs):
        widest = torch.float32 if any(_has_fp32(a) for a in (*args, *kwargs.values())) \
            else low
        args, kwargs = _cast(widest, args, kwargs)
        return op(*args, **kwargs)
    return rule


def _has_fp32(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32
    return isinstance(value, (list, tuple)) and any(_has_fp32(v) for v in value)


def _fp32_output(op, args, kwargs):
    if not _eligible(args[0]):
        return op(*args, **kwargs)
    position = [argument.name for argument in op._schema.arguments].index("dtype")
    if len(args) > position:
        if args[position] is None:
            args = (*args[:position], torch.float32, *args[position + 1:])
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return op(*args, **kwargs)


def _fp32_appended(target: torch._ops.OpOverload) -> Callable:
    def rule(op, args, kwargs):
        dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        return target(*_positional(op, args, kwargs), dtype=dtype)
    return rule


def _positional(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """A call's positional arguments in full, defaults filled from the op's schema."""
    schema = [a for a in op._schema.arguments if not a.kwarg_only]
    return [args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema)]


def _banned(op, args, kwargs):
    raise RuntimeError(f"CUDA autocast refuses {op}: binary cross-entropy is unsafe in low "
                       "precision; use binary_cross_entropy_with_logits (BCEWithLogitsLoss)")
