"""Trace each distinct repeated block once, and expand the analysis to every block.

An 80-block model is 80 copies of one block: tracing and measuring all of them costs 80
times what one does (about 10 s of ``torch.export`` for a 70B Llama) for numbers that
are copies. This module finds the repeated blocks before tracing, lets ``analyze`` trace
a model that holds only a few *representatives* of each container, and expands what it
measured back to the whole model: layers, cuts, shared parameters and tensor-parallel
options come out equal to those of a full trace.

Steps (``partc.passes.pipeline.analyze`` runs them):

1. :func:`find_repeats`: every outermost ``nn.ModuleList`` / ``nn.Sequential`` (children
   named ``0 .. n-1``, the containers ``layers`` makes one layer per child of) whose
   children fall into structural *kinds*: class, module tree, each module's plain
   attributes and training flag, parameter and buffer names, shapes, dtypes and devices,
   hooks. An int attribute equal to the block's position plus a constant (``layer_idx``)
   is a label and ignored. Blocks that share a tensor or a module with anything else are
   never dropped. Given the example inputs, the forward is recorded on fakes
   (:mod:`partc.passes.helpers.segments`) and blocks whose *segment* (the block's calls and the
   model's code after it, up to the next block) runs other code are of other kinds.
2. Representatives: when the kinds repeat with a period ``p`` (uniform stacks: 1;
   alternating attention: 2), the first period and the blocks from the last whole
   period's start (a period and what is left over), so every kept block stays in the
   phase it had; a block between stands with the block of its phase in the first
   period, or for the first phase (block 0 reads the stack's input) with the tail's
   first block (uniform stacks keep blocks 0 and 1 and the last). Otherwise the first
   two blocks of each kind and the last block are kept, and every other block stands
   with the second kept block of its kind. The last block is always kept as itself, so
   the last representative is the last block.
3. :func:`shrunk` swaps each container's children for the representatives (renumbered
   ``0 .. k-1``, as a shorter list would be) and always puts them back. :func:`prove`
   records the shrunk model's forward and raises :class:`Mismatch` unless it runs, around
   each kept block, what the whole model runs around every block that block stands for,
   and the same code before the blocks: ops, arguments, shapes, dtypes and wiring (a
   value read from the previous block, from before the stack, or from a parameter of the
   block itself). The model's own loop can treat a block by its index (``if i == 4``),
   or hand it a value by its index (``masks[config.layer_types[i]]``); a shorter model
   then runs something else, and the copies would be guesses.
4. :func:`plan_expansion` checks the traced model against what the copies assume, and
   raises :class:`Mismatch` (``analyze`` then traces the whole model) unless: each kept
   block is one layer, in order, consecutive; a block uses only its own parameters,
   which no other layer uses; kept blocks of one kind measure alike (the last block: the
   nodes it runs itself); a value a block makes is used only by the next layer (the last
   block's by anything after it); a value made before a container that a block standing
   for others reads reaches every later block of its kind (the first block may read its
   input besides, the last the model's code after the stack); and the parameter count
   comes out as the model's.
5. :func:`expand_analysis` and :func:`expand_option` copy each representative's layer to
   the blocks it stands for (renamed ``container.<block>``, FQNs renamed too) and rebuild
   the cuts from the traced graph's crossings mapped to the whole model's layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import re
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn

from partc import meta
from partc.passes.context_parallel import shape_masks
from partc.passes.helpers import segments
from partc.passes.helpers.graph import carries_grad, nested_graph, op_name, param_usage
from partc.passes.layers import crossing_users, cut_counts, cut_sums, is_repeated
from partc.problem import LayerCost, ModelAnalysis, TPOption

log = logging.getLogger("partc")


class Mismatch(Exception):
    """The traced representatives do not stand for the whole model; trace all of it."""


@dataclass(frozen=True)
class Repeat:
    """One container and the blocks traced for it."""

    container: str               # FQN of the ModuleList / Sequential ("" at the root)
    size: int                    # blocks in the whole container
    kept: tuple[int, ...]        # the representatives' block indices, in order
    stands_for: tuple[int, ...]  # per block: the position in ``kept`` of its representative
    kinds: tuple[int, ...]       # per kept position: its kind (equal numbers, equal blocks)
    recording: segments.Recording | None = dataclasses.field(
        default=None, compare=False, repr=False)  # the whole model's forward, for prove

    def prefix(self, index: int) -> str:
        """FQN of block (or traced position) ``index``."""
        return f"{self.container}.{index}" if self.container else str(index)


# ------------------------------------------------------------------------ finding blocks

def find_repeats(model: nn.Module, example: tuple[tuple, dict] | None = None,
                 on_block: Callable[[str, int, int, int], None] | None = None
                 ) -> tuple[Repeat, ...]:
    """The containers worth shrinking, with their representatives (none: trace it all).

    ``example``: the forward's ``(args, kwargs)``. With it the forward is recorded
    (:mod:`partc.passes.helpers.segments`; ``on_block`` is told of each block entered)
    and blocks that run different code, or sit in different code, are of different
    kinds; :func:`prove` then needs the recording, kept on each repeat. Without it,
    kinds are structural only and nothing can be proven. A block that runs more than
    :data:`LONG_BLOCK_CALLS` torch calls is named in the log as soon as it has run
    (:class:`_LongBlocks`): planning takes long."""
    modules = list(model.named_modules(remove_duplicate=False))
    containers = {name for name, module in modules if is_repeated(module)}
    owners: Counter = Counter(id(module) for _, module in modules)
    tensors: Counter = Counter(id(t) for t in _all_tensors(model))
    candidates = []
    for name, module in modules:
        if name not in containers or _inside(name, containers):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue  # a custom container may read its children other than by iterating
        blocks = list(module.children())
        if len(blocks) >= 4 and all(_private(b, owners, tensors) for b in blocks):
            candidates.append((name, blocks))
    if not candidates:
        return ()
    recording = None
    if example is not None:
        long_blocks = _LongBlocks(on_block)
        recording = segments.record(model, tuple(name for name, _ in candidates), *example,
                                    on_block=long_blocks)
        long_blocks.done(recording)
        ran = {container for container, _ in recording.entered}
        if len(ran) < len(candidates):
            # A stack the forward never enters (a vision tower under text-only batches)
            # costs the trace nothing and is left whole; the others are recorded again
            # without it, so that each recorded container runs.
            candidates = [c for number, c in enumerate(candidates) if number in ran]
            if not candidates:
                return ()
            recording = segments.record(model, tuple(name for name, _ in candidates),
                                        *example)
    repeats = []
    for number, (name, blocks) in enumerate(candidates):
        kinds = _kinds(blocks)
        if recording is not None:
            kinds = _refined(kinds, [recording.describe((number, b), _absolute)
                                     for b in range(len(blocks))])
        kept, stands_for = _representatives(kinds)
        if len(kept) < len(blocks):
            repeats.append(Repeat(container=name, size=len(blocks), kept=tuple(kept),
                                  stands_for=tuple(stands_for),
                                  kinds=tuple(kinds[b] for b in kept), recording=recording))
    return tuple(repeats)


# Torch calls in one block's forward above which the log says planning takes long: a
# transformer block makes 70-150; Qwen 3.5's gated delta rule, a loop over 64-token
# chunks, about 1,250 at 4,096 tokens (its default plan on 8 H100s: 3 to 5 minutes);
# Jamba's reference Mamba scan, a loop over every token, about ten per token.
LONG_BLOCK_CALLS = 1_000


class _LongBlocks:
    """An ``on_block`` for :func:`segments.record` that logs, once and as soon as it is
    seen, a block whose forward ran more than :data:`LONG_BLOCK_CALLS` torch calls
    (those between its entry and the next block's: recording a model of such blocks
    takes minutes already), then tells ``then``. :meth:`done` looks at the last block,
    after the recording."""

    def __init__(self, then: Callable[[str, int, int, int], None] | None) -> None:
        self.then = then
        self.last: tuple[str, int] | None = None   # the block entered last, calls then
        self.warned = False

    def __call__(self, container: str, position: int, size: int, calls: int) -> None:
        self._check(calls)
        self.last = (f"{container}.{position}", calls)
        if self.then is not None:
            self.then(container, position, size, calls)

    def done(self, recording: segments.Recording) -> None:
        self._check(recording.recorded)

    def _check(self, calls: int) -> None:
        if self.warned or self.last is None or calls - self.last[1] <= LONG_BLOCK_CALLS:
            return
        self.warned = True
        log.warning(
            "%s runs %s torch calls in one forward: a loop in Python, such as a recurrent "
            "layer's reference scan over the sequence where its fused kernel is not "
            "installed. Tracing, measuring and sharding a layer take time in its calls, "
            "so planning this model takes long; a shorter example sequence (partc plan "
            "--seq-len) plans faster, every cost measured at that length.",
            self.last[0], f"{calls - self.last[1]:,}")


def _absolute(container: int, position: int) -> int:
    return position


def _refined(kinds: list[int], code: list[tuple]) -> list[int]:
    """Kinds split by the code each block's segment runs. The first and the last block
    stand only for themselves (their segments read the stack's input, or hold the code
    after it): each takes the kind of a block between of its structure, the one that
    lets the stack repeat with the shortest period (:func:`_period`). Exaone 4's stack
    of three sliding-window layers to one global: a sliding layer after the global one
    reads its output from another call than one after a sliding layer, so the first
    block is like the fifth, not the second."""
    numbers: dict[tuple, int] = {}
    refined = list(kinds)
    for block in range(1, len(kinds) - 1):
        refined[block] = numbers.setdefault((kinds[block], code[block]), len(numbers))
    ends = (0, len(kinds) - 1)
    choices = []
    for block in ends:
        like = list(dict.fromkeys(refined[b] for b in range(1, len(kinds) - 1)
                                  if kinds[b] == kinds[block]))
        choices.append(like or [numbers.setdefault((kinds[block], block), len(numbers))])
    best = None
    for first, last in itertools.product(*choices):
        refined[0], refined[-1] = first, last
        period = _period(refined) or len(kinds)
        if best is None or period < best[0]:
            best = (period, first, last)
    refined[0], refined[-1] = best[1], best[2]
    return refined


def _period(kinds: list[int]) -> int | None:
    """The shortest period of ``kinds`` that repeats at least three times, if any."""
    n = len(kinds)
    return next((period for period in range(1, n // 3 + 1)
                 if all(kinds[i] == kinds[i + period] for i in range(n - period))), None)


def prove(model: nn.Module, repeats: tuple[Repeat, ...], example: tuple[tuple, dict]) -> None:
    """Raise :class:`Mismatch` unless the shrunk model runs what the whole model runs
    around every block it keeps, and the whole model runs around every other block what
    it runs around the block standing for it: code before, between and after the blocks,
    wiring included (:mod:`partc.passes.helpers.segments`)."""
    full = repeats[0].recording if repeats else None
    if full is None:
        raise Mismatch("the forward was not recorded: nothing proves the blocks equal")
    try:
        with shrunk(model, repeats):
            short = segments.record(model, full.containers, *example)
    except Exception as error:  # the model's own code refuses fewer blocks
        raise Mismatch(f"the forward fails with fewer blocks ({type(error).__name__}: "
                       f"{error})") from error
    by_name = {repeat.container: repeat for repeat in repeats}
    stands = [by_name[name].stands_for if name in by_name else None
              for name in full.containers]

    def rep(container: int, position: int) -> int:
        return stands[container][position] if stands[container] else position

    sizes = [len(model.get_submodule(name)._modules) for name in full.containers]
    kept = [len(by_name[name].kept) if name in by_name else size
            for name, size in zip(full.containers, sizes)]
    if not _in_order(full.entered, sizes) or not _in_order(short.entered, kept):
        raise Mismatch("the blocks do not run once each, in order")
    if full.describe(segments.PREFIX, rep) != short.describe(segments.PREFIX, _absolute):
        raise Mismatch("the code before the blocks runs differently with fewer blocks")
    for container, position in full.entered:
        mine = full.describe((container, position), rep)
        if mine != short.describe((container, rep(container, position)), _absolute):
            name = full.containers[container]
            raise Mismatch(f"block {name + '.' if name else ''}{position} and the code "
                           "around it run differently from the block standing for it")


def _in_order(entered: list[tuple[int, int]], sizes: list[int]) -> bool:
    """Each container's blocks entered once each, in order, one container after another."""
    runs: list[tuple[int, list[int]]] = []
    for container, position in entered:
        if not runs or runs[-1][0] != container:
            runs.append((container, []))
        runs[-1][1].append(position)
    seen = [container for container, _ in runs]
    return len(seen) == len(set(seen)) == len(sizes) and all(
        positions == list(range(sizes[container])) for container, positions in runs)


def _inside(name: str, containers: set[str]) -> bool:
    parts = name.split(".") if name else []
    return any(".".join(parts[:i]) in containers for i in range(len(parts)))


def _all_tensors(module: nn.Module) -> list[torch.Tensor]:
    return ([t for _, t in module.named_parameters(remove_duplicate=False)]
            + [t for _, t in module.named_buffers(remove_duplicate=False)])


def _private(block: nn.Module, owners: Counter, tensors: Counter) -> bool:
    """Whether the block's modules and tensors appear nowhere else in the model."""
    inner_modules = Counter(id(m) for _, m in block.named_modules(remove_duplicate=False))
    inner_tensors = Counter(id(t) for t in _all_tensors(block))
    return (all(owners[key] == count for key, count in inner_modules.items())
            and all(tensors[key] == count for key, count in inner_tensors.items()))


def _kinds(blocks: list[nn.Module]) -> list[int]:
    """A number per block; blocks with equal numbers have equal structure."""
    attributes = [_attributes(block) for block in blocks]
    labels = _labels(attributes)
    numbers: dict[tuple, int] = {}
    kinds = []
    for block, found in zip(blocks, attributes):
        plain = tuple(sorted((key, value) for key, value in found.items() if key not in labels))
        key = (_tree(block), plain)
        kinds.append(numbers.setdefault(key, len(numbers)))
    return kinds


def _tree(block: nn.Module) -> tuple:
    modules = tuple((name, type(m).__module__, type(m).__qualname__, m.training)
                    for name, m in block.named_modules(remove_duplicate=False))
    params = tuple((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                   for name, t in block.named_parameters(remove_duplicate=False))
    buffers = tuple((name, tuple(t.shape), t.dtype, t.device.type)
                    for name, t in block.named_buffers(remove_duplicate=False))
    return modules, params, buffers


_STRUCTURAL = {"_parameters", "_buffers", "_modules", "training"}


def _attributes(block: nn.Module) -> dict[tuple[str, str], Any]:
    """Every module's own attributes, described so that equal means interchangeable."""
    paths = {id(module): path for path, module in block.named_modules(remove_duplicate=False)}
    found = {}
    for path, module in block.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if name not in _STRUCTURAL:
                found[(path, name)] = _describe(value, paths, hooks=name.endswith("hooks"))
    return found


def _describe(value: Any, paths: dict[int, str], hooks: bool = False) -> Any:
    """Plain values by value; callables built per block (``functools.partial``, a method
    of the block's own module) by what they call; any other object by identity."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes,
                                           torch.dtype, torch.device, enum.Enum)):
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v, paths) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in value)))
    if isinstance(value, dict):
        # Hook dicts are keyed by handle numbers, unique per registration: keep the hooks.
        items = value.values() if hooks else value.items()
        return ("dict", tuple(_describe(v, paths) for v in items))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, functools.partial):
        return ("partial", _describe(value.func, paths), _describe(value.args, paths),
                _describe(value.keywords, paths))
    if isinstance(value, types.MethodType) and id(value.__self__) in paths:
        return ("method", id(value.__func__), paths[id(value.__self__)])
    return ("object", id(value))  # configs, functions, shared modules: the same object


def _labels(attributes: list[dict]) -> set:
    """Int attributes equal to the block's position plus a constant (``layer_idx``),
    in every block that has them, two at least: a hybrid stack's linear-attention mixers
    (Qwen 3.5's) carry their own ``layer_idx``, in only the blocks that hold one. (Equal
    structure is only a candidate: :func:`prove` checks what the blocks run.)"""
    labels = set()
    for key in dict.fromkeys(key for found in attributes for key in found):
        values = [(position, found[key]) for position, found in enumerate(attributes)
                  if key in found]
        if len(values) >= 2 and all(v[0] == "int" for _, v in values):
            offsets = {int(v[1]) - position for position, v in values}
            if len(offsets) == 1:
                labels.add(key)
    return labels


def _representatives(kinds: list[int]) -> tuple[list[int], list[int]]:
    """Blocks to trace, and per block the position of the one it copies."""
    n = len(kinds)
    period = _period(kinds)
    if period is not None:
        # The tail starts at a whole period, as it does in the shorter model, so that a
        # block read by its index (Gemma 3's layer_types[i], five sliding-window layers to
        # one global, in a stack of 62) keeps its phase; it is traced as itself, as its
        # blocks may hand values on to fewer blocks (Llama 4's rotary table, read two
        # layers on, by none after the last rotary layer). A block between stands with
        # the block of its phase in the first period, but block 0, which reads the
        # stack's input: with block 1 in a uniform stack, else with the tail's first.
        tail = (n - period) // period * period
        head = 2 if period == 1 else period
        kept = list(range(head)) + list(range(tail, n))
        stands = [b if b < head else head + b - tail if b >= tail else
                  b % period or (1 if period == 1 else head) for b in range(n)]
        return kept, stands
    seen: dict[int, list[int]] = {}
    for block, kind in enumerate(kinds):
        seen.setdefault(kind, []).append(block)
    kept = sorted({b for blocks in seen.values() for b in blocks[:2]} | {n - 1})
    position = {block: i for i, block in enumerate(kept)}
    # A block that was not kept is a third or later of its kind: the second stands for it.
    stands = [position[b] if b in position else position[seen[kinds[b]][1]]
              for b in range(n)]
    return kept, stands


@contextlib.contextmanager
def shrunk(model: nn.Module, repeats: tuple[Repeat, ...]) -> Iterator[None]:
    """The model with only the representatives in each container, restored on exit."""
    saved = []
    try:
        for repeat in repeats:
            container = model.get_submodule(repeat.container)
            blocks = list(container._modules.values())
            saved.append((container, container._modules))
            container._modules = {str(i): blocks[b] for i, b in enumerate(repeat.kept)}
        yield
    finally:
        for container, modules in reversed(saved):
            container._modules = modules


# ----------------------------------------------------------------------- the expansion

@dataclass(frozen=True)
class _Block:
    repeat: Repeat
    position: int  # in the traced container


@dataclass(frozen=True)
class Expansion:
    """How the traced layers map to the whole model's layers."""

    repeats: tuple[Repeat, ...]
    names: tuple[str, ...]                  # the whole model's layer names, in order
    source: tuple[int, ...]                 # per layer: the traced layer it copies
    renames: tuple[tuple[str, str] | None, ...]  # per layer: (traced, own) block prefix
    targets: tuple[tuple[int, ...], ...]    # per traced layer: the layers it stands for
    blocks: dict[int, _Block]               # traced layer index → its block
    node_names: tuple[dict[str, str], ...]  # per layer: traced node name → own name
    retrace: Callable[[], Any] | None = None  # the whole model's (gm, ctx), if needed

    def fqn(self, name: str, layer: int) -> str:
        rename = self.renames[layer]
        if rename and name.startswith(rename[0] + "."):
            return rename[1] + name[len(rename[0]):]
        return name


def plan_expansion(gm: fx.GraphModule, ctx: Any, repeats: tuple[Repeat, ...]) -> Expansion:
    """Check the traced model (see the module docstring, step 4) and map its layers."""
    infos = meta.layers(gm)
    blocks = _block_layers(infos, repeats)
    names, source, renames, targets = _layout(infos, blocks)
    _check_params(gm, blocks)
    expansion = Expansion(repeats=repeats, names=tuple(names), source=tuple(source),
                          renames=tuple(renames), targets=tuple(targets), blocks=blocks,
                          node_names=_node_names(gm, source))
    _check_kinds(gm, blocks)
    _spans(gm, expansion)  # raises unless every crossing maps onto the whole model
    return expansion


def _block_layers(infos: tuple[meta.LayerInfo, ...], repeats: tuple[Repeat, ...]
                  ) -> dict[int, _Block]:
    keys = {repeat.prefix(i): _Block(repeat, i) for repeat in repeats
            for i in range(len(repeat.kept))}
    blocks: dict[int, _Block] = {}
    for info in infos:
        if info.key in keys:
            if info.name != info.key:
                raise Mismatch(f"block {info.key} makes more than one layer")
            blocks[info.index] = keys[info.key]
    for repeat in repeats:
        found = [index for index, b in blocks.items() if b.repeat is repeat]
        positions = [blocks[index].position for index in sorted(found)]
        if positions != list(range(len(repeat.kept))) or \
                sorted(found) != list(range(min(found), min(found) + len(found))):
            raise Mismatch(f"the blocks of {repeat.container or 'the model'} do not run "
                           "once each, in order, one after another")
    return blocks


def _layout(infos: tuple[meta.LayerInfo, ...], blocks: dict[int, _Block]) -> tuple:
    names, source, renames = [], [], []
    targets: list[list[int]] = [[] for _ in infos]
    for info in infos:
        block = blocks.get(info.index)
        if block is None:
            targets[info.index].append(len(names))
            names.append(info.name)
            source.append(info.index)
            renames.append(None)
            continue
        if block.position:
            continue  # all of the container's layers come with its first block
        repeat = block.repeat
        for index, position in enumerate(repeat.stands_for):
            traced = info.index + position
            targets[traced].append(len(names))
            names.append(repeat.prefix(index))
            source.append(traced)
            renames.append((repeat.prefix(position), repeat.prefix(index)))
    return names, source, renames, [tuple(t) for t in targets]


def _check_params(gm: fx.GraphModule, blocks: dict[int, _Block]) -> None:
    """A block's layer uses its own parameters only, and no other layer uses them."""
    prefixes = {index: b.repeat.prefix(b.position) + "." for index, b in blocks.items()}
    for node in gm.graph.nodes:
        if node.op not in ("get_attr", "call_module") or nested_graph(gm, node):
            continue
        users = node.users if node.op == "get_attr" else [node]
        for fqn in meta.params(node):
            owner = next((i for i, p in prefixes.items() if fqn.startswith(p)), None)
            for user in users:
                index = meta.layer(user).index
                if (index in blocks or owner is not None) and owner != index:
                    raise Mismatch(f"{fqn} is used outside its block (layer "
                                   f"{meta.layer(user).name})")


def _check_kinds(gm: fx.GraphModule, blocks: dict[int, _Block]) -> None:
    """Kept blocks of one kind must measure alike, or the copies would be guesses.

    The first block of a kind that stands only for itself (:func:`_representatives`:
    block 0, or the first of a kind in a stack without a period) is not compared: under
    mixed precision it may read its input in another dtype than the rest (an embedding's
    compute-dtype output where the graph pins the residual stream to fp32). The first
    block of a kind that stands for others is the one the rest are compared with. The
    last block stands only for itself too, and only the nodes each runs itself are
    compared with that one's: it may be followed by code of the model's own that joins
    its layer (a residual around the whole stack). The blocks between are compared
    whole; of those that stand only for themselves, the figures alone: their signatures
    may say that no later block reads a value (Llama 4's rotary table, which each rotary
    layer's ``.to`` hands on to the next one as the same tensor, is read by none after
    the stack's last rotary layer)."""
    costs, infos = meta.layer_costs(gm), meta.layers(gm)
    seen: set[tuple] = set()
    reference: dict[tuple, list] = {}
    between: dict[tuple, Any] = {}
    for index, block in sorted(blocks.items()):
        repeat = block.repeat
        own = _own_node_costs(gm, infos[index], repeat.prefix(block.position))
        key = (repeat.container, repeat.kinds[block.position])
        alone = repeat.stands_for.count(block.position) == 1
        if key not in seen and alone:
            seen.add(key)
            continue
        seen.add(key)
        if key not in reference:
            reference[key] = own
            if block.position != len(repeat.kept) - 1:
                between[key] = costs[index].unnamed()
            continue
        if block.position == len(repeat.kept) - 1:
            alike = reference[key] == own
        else:
            cost = costs[index].unnamed()
            known = between.setdefault(key, cost)
            if alone:
                known = dataclasses.replace(known, signature=cost.signature)
            alike = known == cost and reference[key] == own
        if not alike:
            raise Mismatch(f"blocks of one structure measure differently "
                           f"({costs[index].name})")


def _own_node_costs(gm: fx.GraphModule, info: meta.LayerInfo, prefix: str) -> list:
    nodes = {node.name: node for node in gm.graph.nodes}
    own = [nodes[name] for name in info.nodes if nodes[name].op != "get_attr"]
    return [(op_name(node), meta.cost(node)) for node in own
            if meta.module_path(node) == prefix or meta.module_path(node).startswith(prefix + ".")]


def check_param_count(analysis: ModelAnalysis, gm: fx.GraphModule, ctx: Any,
                      expansion: Expansion) -> None:
    """The expanded layers own every parameter the whole model uses, once: those the
    traced graph uses, and each untraced block's as its representative's are used."""
    used = param_usage(gm, ctx)["tensors"]
    expected = sum(p.numel() for p in used.values())
    for repeat in expansion.repeats:
        blocks = list(ctx.model.get_submodule(repeat.container).children())
        for index, position in enumerate(repeat.stands_for):
            if index not in repeat.kept:
                stand_in = dict(blocks[repeat.kept[position]].named_parameters())
                expected += sum(p.numel() for name, p in blocks[index].named_parameters()
                                if id(stand_in[name]) in used)
    got = sum(layer.param_count for layer in analysis.layers) + \
        sum(group.param_count for group in analysis.shared)
    if got != expected:
        raise Mismatch(f"the expanded layers hold {got} parameters, the model uses {expected}")


def _node_names(gm: fx.GraphModule, source: list[int]) -> tuple[dict[str, str], ...]:
    """Per layer of the whole model, the name each traced node would have had there.

    fx names a node ``base``, ``base_1``, ``base_2`` … in the order it creates them, so
    a node's number is how many nodes of its base come before it. Names that this does
    not reproduce in the traced graph are left out (never guessed)."""
    infos = meta.layers(gm)
    start: Counter = Counter(_base(n.name)[0] for n in gm.graph.nodes if n.op == "placeholder")
    per_layer = [Counter(_base(name)[0] for name in info.nodes) for info in infos]
    traced_before, running = [], Counter(start)
    for counts in per_layer:
        traced_before.append(Counter(running))
        running.update(counts)
    result, running = [], Counter(start)
    for layer in source:
        names, seen = {}, Counter()
        for name in infos[layer].nodes:
            base, number = _base(name)
            if number == traced_before[layer][base] + seen[base]:
                own = running[base] + seen[base]
                names[name] = f"{base}_{own}" if own else base
            seen[base] += 1
        result.append(names)
        running.update(per_layer[layer])
    return tuple(result)


def _base(name: str) -> tuple[str, int]:
    match = re.fullmatch(r"(.*)_(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


# ----------------------------------------------------------------------------- crossings

def _spans(gm: fx.GraphModule, expansion: Expansion) -> list[tuple[fx.Node, int, int]]:
    """Each crossing of the whole model: (traced node, layer made, last layer using)."""
    result = []
    blocks, targets = expansion.blocks, expansion.targets
    stacks: dict[int, set[int]] = {}   # per repeat: the whole model's layers of its blocks
    for index, b in blocks.items():
        stacks.setdefault(id(b.repeat), set()).update(targets[index])
    for node, made, users in crossing_users(gm):
        block = blocks.get(made) if node.op != "placeholder" else None
        later = {u for u in users if u != made}
        if block is None:
            for repeat in expansion.repeats:
                _check_fan_out(node, users, blocks, repeat)
            result.append((node, targets[made][0] if node.op != "placeholder" else 0,
                           max(t for u in users for t in targets[u])))
            continue
        last = block.position == len(block.repeat.kept) - 1
        # A value read by the next block is read by the next one after each block it
        # stands for. One the block's own code makes may be read by one block further
        # on in its stack (Llama 4's rotary table skips each layer without rotary
        # embeddings): ``prove`` saw the blocks read each other's values at the same
        # distances in the whole model. Values the recording does not see made by the
        # block (export's lifted constants, which the trace puts before the first
        # block), or that more blocks read, send the whole model to be traced.
        prefix = block.repeat.prefix(block.position)
        further = len(later) == 1 and all(
            u > made and u in blocks and blocks[u].repeat is block.repeat for u in later) \
            and (meta.module_path(node) + ".").startswith(prefix + ".")
        if not last and later != {made + 1} and not further:
            raise Mismatch(f"{node.name}, made in block {prefix}, is used beyond the next "
                           "layer")
        stack = stacks[id(block.repeat)]
        for own in targets[made]:
            used = own + max(later) - made if not last else \
                max(t for u in later for t in targets[u])
            if not last and used not in stack:
                raise Mismatch(f"{node.name}, made in block {prefix}, is read past its stack")
            result.append((node, own, used))
    return result


def _check_fan_out(node: fx.Node, users: set[int], blocks: dict[int, _Block],
                   repeat: Repeat) -> None:
    """A value from before a container that a block in its middle reads (one standing
    for others) must reach every later block of that kind. The first block may read
    more (its input) and the last too (the model's code after the stack joins it)."""
    reached = {blocks[u].position for u in users if u in blocks and blocks[u].repeat is repeat}
    last = len(repeat.kept) - 1
    for kind in set(repeat.kinds):
        later = {p for p, k in enumerate(repeat.kinds) if k == kind and p != 0}
        if reached & (later - {last}) and not later <= reached:
            raise Mismatch(f"{node.name} reaches some blocks of "
                           f"{repeat.container or 'the model'} of one structure and not others")


def expanded_cuts(gm: fx.GraphModule, expansion: Expansion, per_sample: float
                  ) -> tuple[tuple[float, ...], tuple[tuple[int, int, int], ...]]:
    """The whole model's ``cut_bytes`` (per sample) and ``cut_tensors`` from ``gm``: a
    value's bytes in the dtype the runtime makes it in (:func:`partc.meta.run_bytes`), as
    the whole model's trace counts them (under mixed precision the traced dtype is
    float32: a 70B model's first cuts counted its bf16 hidden states twice over)."""
    spans = _spans(gm, expansion)
    num_layers = len(expansion.names)
    grads = carries_grad(gm)
    cut_bytes = cut_sums([(meta.run_bytes(n), made, used) for n, made, used in spans],
                         num_layers)
    masks = shape_masks(gm)
    cut_tensors = cut_counts([(n in grads, n in masks, made, used) for n, made, used in spans
                              if isinstance(n.meta.get("val"), torch.Tensor)], num_layers)
    return tuple(c * per_sample for c in cut_bytes), cut_tensors


# ------------------------------------------------------------------------------ results

def expand_analysis(analysis: ModelAnalysis, gm: fx.GraphModule, expansion: Expansion,
                    per_sample: float) -> ModelAnalysis:
    """The whole model's analysis from the traced one (``gm``: its graph)."""
    layers = tuple(_renamed_layer(analysis.layers[s], name)
                   for s, name in zip(expansion.source, expansion.names))
    cut_bytes, cut_tensors = expanded_cuts(gm, expansion, per_sample)
    shared = tuple(dataclasses.replace(
        group, layers=tuple(sorted({t for layer in group.layers
                                    for t in expansion.targets[layer]})))
        for group in analysis.shared)
    return dataclasses.replace(analysis, layers=layers, cut_bytes=cut_bytes,
                               cut_tensors=cut_tensors, shared=shared)


def _renamed_layer(layer: LayerCost, name: str) -> LayerCost:
    """``layer`` (a traced block) standing for the block ``name``: its linears' weight
    FQNs under that block's prefix."""
    if name == layer.name:
        return layer
    source = layer.name + "."

    def moved(fqn: str) -> str:
        return name + "." + fqn[len(source):] if fqn.startswith(source) else fqn

    ops = tuple(dataclasses.replace(op, linear_names=tuple(moved(n) for n in op.linear_names))
                if op.linear_names else op for op in layer.heavy_ops)
    return dataclasses.replace(layer, name=name, heavy_ops=ops)


def expand_option(option: TPOption, local: fx.GraphModule, expansion: Expansion,
                  per_sample: float) -> TPOption:
    """A tensor-parallel option of the whole model from the traced one's (``local``: the
    rank's sharded graph it was measured on)."""
    model = expand_analysis(option.model, local, expansion, per_sample)
    choices = dict(option.choices)
    notes = dict(option.notes)
    traced_names = [info.name for info in meta.layers(local)]
    full_notes = []
    for layer, (s, name) in enumerate(zip(expansion.source, expansion.names)):
        note = notes.get(traced_names[s])
        if note:
            full_notes.append((name, _rename_note(note, expansion.node_names[layer])))
    return dataclasses.replace(
        option, model=model,
        choices=tuple((name, choices[traced_names[s]])
                      for s, name in zip(expansion.source, expansion.names)),
        placements=tuple(sorted(_renamed(dict(option.placements), expansion).items())),
        partial_grad_params=tuple(sorted(_renamed(
            {fqn: None for fqn in option.partial_grad_params}, expansion))),
        notes=tuple(full_notes))


def _renamed(by_fqn: dict[str, Any], expansion: Expansion) -> dict[str, Any]:
    """FQN-keyed values of the traced model, for every block they stand for."""
    result = {}
    for fqn, value in by_fqn.items():
        owners = [layer for layer, rename in enumerate(expansion.renames)
                  if rename and fqn.startswith(rename[0] + ".")]
        for layer in owners or [None]:
            result[expansion.fqn(fqn, layer) if layer is not None else fqn] = value
    return result


def _rename_note(note: str, names: dict[str, str]) -> str:
    """Notes open with the node they are about (``linear_3 (linear, ...``)."""
    node, sep, rest = note.partition(" (")
    if sep and node in names:
        return names[node] + sep + rest
    if sep and re.fullmatch(r"[A-Za-z_]\w*", node):
        raise Mismatch(f"cannot name node {node} in the whole model")
    return note
