"""Exceptions a user can act on: each message says what failed, where, and what to do."""

from __future__ import annotations


class PartcError(Exception):
    """Base class of every error partc raises on purpose."""


class TraceError(PartcError):
    """Neither torch.fx.symbolic_trace nor torch.export could capture the model, or what
    they captured has a shape that depends on tensor values (partc plans from static
    shapes)."""


class PlanInfeasibleError(PartcError):
    """No plan fits the budget; the message names stage, resource, need, limit and a fix.

    With ``resource="pin"`` a pinned decision cannot hold; ``pin`` names it."""

    def __init__(self, message: str, *, stage: int | None = None, resource: str = "memory",
                 need_bytes: int | None = None, limit_bytes: int | None = None,
                 suggestion: str = "", pin: str | None = None) -> None:
        super().__init__(message)
        self.pin = pin   # the pin that cannot hold (resource "pin"), e.g. "pp"
        self.stage = stage
        self.resource = resource
        self.need_bytes = need_bytes
        self.limit_bytes = limit_bytes
        self.suggestion = suggestion


class PlanMismatchError(PartcError):
    """The running job does not match the plan (world size, plan hash, model hash, shapes,
    or under ZeRO-1 an optimizer other than ``module.optimizer(...)``'s stepping the
    rank's parameters)."""


class ContextParallelError(PartcError):
    """A model that cannot run with its sequence split over context-parallel ranks: an
    op outside attention that reads the whole sequence (a cumulative sum, a sort, a
    mean over it), an attention whose mask depends on the batch, or one with dropout;
    the message names the op and its module."""


class PlanValidationError(PartcError):
    """A plan broke one of the invariants that validate_plan checks."""


class PlanSchemaError(PartcError, ValueError):
    """A plan file this partc cannot read: another schema version, or a damaged section."""


class PlanFileError(PlanSchemaError):
    """A plan file that is not a plan this partc reads: not JSON, a key missing or unknown,
    a value of the wrong type. ``path``: the file; ``field``: where in it, when known
    (``stages[0].memory_bytes.peak``)."""

    def __init__(self, message: str, *, path: str, field: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.field = field


class CheckpointError(PartcError):
    """A checkpoint that cannot be saved or loaded: a failed write (disk full, permission),
    a partial checkpoint, or one of another model or of other shapes. Raised on every rank
    alike, before any rank changes a parameter. ``path``: the file or directory at fault;
    ``tensor``: the tensor, when one is."""

    def __init__(self, message: str, *, path: str | None = None,
                 tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class BatchMismatchError(PartcError):
    """Ranks that must train on the same batch were given different ones (the ranks of
    one data-parallel replica, or ranks given the global batch), found by the batch
    digest before the optimizer stepped (``TrainSpec.batch_check_every``): no parameter
    changed. Raised on every rank alike. ``step``: the step (``module.step``, counting
    from 1); ``ranks``: two ranks that disagree."""

    def __init__(self, message: str, *, step: int, ranks: tuple[int, int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks


class NonFiniteError(PartcError):
    """A training step whose loss or gradient norm is inf or NaN, found before the
    optimizer stepped (``TrainSpec.on_nonfinite="raise"``, the default): no parameter
    changed. Raised on every rank alike. ``step``: the step (``module.step``, counting
    from 1); ``what``: ``"loss"`` and/or ``"gradient norm"``; ``loss``, ``grad_norm``:
    the values every rank saw; ``stages``: the pipeline stages where a rank's part was
    non-finite; ``ranks``: those ranks where known; ``parameters``: this rank's
    parameters whose gradient is non-finite (FQNs)."""

    def __init__(self, message: str, *, step: int, what: tuple[str, ...], loss: float,
                 grad_norm: float | None, stages: tuple[int, ...] = (),
                 ranks: tuple[int, ...] = (), parameters: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.what = what
        self.loss = loss
        self.grad_norm = grad_norm
        self.stages = stages
        self.ranks = ranks
        self.parameters = parameters


class DataError(PartcError, ValueError):
    """Training data that cannot be read as asked (``partc train --data``): a missing or
    damaged token file, a text with fewer tokens than one sequence, a token id the model's
    vocabulary does not hold, a tokenizer or data set library that is not installed.
    ``path``: the file or directory at fault; ``step``: the step whose batch it was, when
    one was being read."""

    def __init__(self, message: str, *, path: str | None = None,
                 step: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.step = step


class ArgumentTypeError(PartcError, TypeError):
    """A public function (``partc.compile``, ``partc.load``, ``Program.build``) was given
    an argument of the wrong type. ``argument``: its name; ``expected``: what it takes;
    ``got``: the type given."""

    def __init__(self, message: str, *, argument: str, expected: str, got: str) -> None:
        super().__init__(message)
        self.argument = argument
        self.expected = expected
        self.got = got


def check_argument(function: str, argument: str, value: object, types: tuple[type, ...],
                   expected: str, hint: str = "") -> None:
    """Raise :class:`ArgumentTypeError` unless ``value`` is one of ``types`` (``None``
    among them: ``type(None)``), naming ``function``'s ``argument``, the type given and
    ``expected``, in words the user reads (``"partc.Constraints or None"``)."""
    if isinstance(value, types):
        return
    got = "None" if value is None else type(value).__name__
    shown = "" if value is None else f" {value!r:.60}"
    raise ArgumentTypeError(f"{function}({argument}=...): expected {expected}, got "
                            f"{got}{shown}" + (f"; {hint}" if hint else ""),
                            argument=argument, expected=expected, got=got)


class FactoryError(PartcError):
    """The user's factory, or a function it returned (``data(step)``, ``eval_data``),
    raised or returned what partc cannot use. The message names the function, the step
    and the exception with the file and line it came from; ``__cause__`` is the
    exception."""
