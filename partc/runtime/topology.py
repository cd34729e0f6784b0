"""Where this process sits: the process group, the device, and the (pp, dp, cp, tp) mesh.

Ranks are laid out with pp outermost, dp inside it, then cp, and tp innermost, so that a
tensor-parallel group stays inside a node (:mod:`partc.rank_grid`):
rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index. The cp ranks of a
replica hold one sequence between them and reduce gradients with the dp replicas (the
``dp_cp`` group); with cp = 1 the mesh is (pp, dp, tp) as it always was.
Everything here that can fail without talking to other ranks does so before the first
collective, so a wrong launch is an error on every rank, never a hang.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partc.errors import PlanMismatchError
from partc.plan import Plan
from partc.rank_grid import RankCoords, coordinates, rank_groups
from partc.rank_grid import rank_of as grid_rank_of

T = TypeVar("T")

# The single-tensor collectives: torch 2.13 names them ``*_single`` and deprecates the
# older names, which earlier releases (2.11 on the GPU machines) have alone.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    mesh: DeviceMesh
    tp: int = 1
    tp_rank: int = 0
    # Expert parallelism (Megatron's folding): a stage's dp x tp ranks in rank order
    # form groups of ``ep`` consecutive ranks that split the experts; the ranks at the
    # same position of each group (the expert-data-parallel group) hold the same ones.
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    expert_dp_group: dist.ProcessGroup | None = None
    # Context parallelism: this rank's index among the ``cp`` ranks sharing a sequence,
    # their group, and the dp x cp ranks that reduce gradients together (None: cp = 1,
    # the dp group does).
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def grad_replicas(self) -> int:
        """The ranks that hold the same parameters and reduce their gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def grad_rank(self) -> int:
        """This rank's index among them (rank order)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def grad_group(self) -> dist.ProcessGroup:
        """Their process group: the dp group, or with cp > 1 the dp x cp group."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group

    @property
    def grad_mesh(self) -> DeviceMesh:
        """Their mesh (FSDP shards over it)."""
        if self.cp == 1:
            return self.mesh["dp"]
        return DeviceMesh.from_group(self.grad_group, self.device.type,
                                     mesh_dim_names=("dp_cp",))

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """Ranks are ordered (pp, dp, cp, tp), tp innermost: a tp group sits inside a node."""
        return grid_rank_of(RankCoords(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank),
                            pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp)


class SharedGroups:
    """Meshes and process groups made once per world and reused by every later build in
    the process. A second plan built beside the first (plans compared in one process, a
    new plan after a resume) would otherwise add communicators that stay alive, each with
    its own threads (gloo: idle, they still wake and take CPU from the compute) or buffers
    (NCCL). ``new_group`` must be called by every rank in one order; every rank builds the
    same plans in the same order, so every rank finds or makes the same entries. A world
    destroyed and started again starts afresh."""

    def __init__(self) -> None:
        self._world: object = None
        self._made: dict[tuple, object] = {}

    def get(self, key: tuple, make: Callable[[], T]) -> T:
        """``make()``'s result, made once per world under ``key``."""
        world = dist.group.WORLD
        if self._world is not world:
            self._made = {}
            self._world = world
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def forget(self) -> None:
        """Drop every entry (the world is being left): the groups go with their last
        other reference."""
        self._made = {}
        self._world = None


GROUPS = SharedGroups()   # the process's one registry


def group_of(ranks: Iterable[int]) -> dist.ProcessGroup:
    """The process group of ``ranks``, made once per world (``SharedGroups``)."""
    ranks = tuple(ranks)
    return GROUPS.get(("group", ranks), lambda: dist.new_group(list(ranks)))


def leave() -> None:
    """Leave the process group at the end of a run: ``destroy_process_group()``, then drop
    the groups made of it (``GROUPS``) and collect, so that each gloo group is freed here,
    its destructor joining its worker threads while the interpreter is whole. Call it
    once every rank is past its last collective (after a barrier), with the modules built
    on the groups released.

    ``destroy_process_group`` alone leaves a gloo group's two worker threads running for
    as long as anything refers to the group (``GROUPS``, a module's topology), that is
    into interpreter shutdown. A worker drops the collective it ran, the final barrier
    included, a moment after the caller has returned from it; the barrier's tensor has a
    Python object, whose release takes the GIL. On a loaded machine that moment can fall
    in shutdown, when CPython ends a thread that asks for the GIL (``pthread_exit``): the
    exit unwinds through a C++ destructor and aborts the process ("terminate called
    without an active exception", SIGABRT), failing a run that had finished. A group's
    destructor lets go of the GIL while it joins, so the workers' releases finish first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    GROUPS.forget()
    gc.collect()


def world_size_from_env() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_size(plan: Plan) -> None:
    expected = plan.mesh.size
    actual = world_size_from_env()
    if actual != expected:
        raise PlanMismatchError(
            f"the plan needs {expected} processes (pp={plan.pp} × dp={plan.dp} × "
            f"{f'cp={plan.cp} × ' if plan.cp > 1 else ''}tp={plan.tp}) but {actual} were started: launch with "
            f"`torchrun --nproc-per-node={expected} ...`, or compile for {actual} devices")


def init(plan: Plan, device: torch.device | str | None = None) -> Topology:
    """Join (or start) the process group and build the (pp, dp, tp) mesh for ``plan``."""
    check_world_size(plan)
    device = torch.device(device) if device is not None else _default_device()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # PARTC_TIMEOUT_S (docs/guide.md): how long a collective waits before failing. A hung
        # peer is reported long before by the watchdog (PARTC_WATCHDOG_S, watchdog.py).
        timeout = datetime.timedelta(seconds=float(os.environ.get("PARTC_TIMEOUT_S", "600")))
        if "MASTER_ADDR" not in os.environ and world_size_from_env() == 1:
            # One process and no launcher: a private store, no network.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_attempt_store(timeout),
                                    rank=int(os.environ["RANK"]),
                                    world_size=world_size_from_env(), timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank = dist.get_rank()
    tp, cp = plan.tp, plan.cp
    shape, names = (plan.pp, plan.dp, tp), ("pp", "dp", "tp")
    if cp > 1:
        shape, names = (plan.pp, plan.dp, cp, tp), ("pp", "dp", "cp", "tp")
    mesh = GROUPS.get(("mesh", device.type, shape), lambda: init_device_mesh(
        device.type, shape, mesh_dim_names=names))
    ep = plan.mesh.ep
    ep_group, expert_dp_group = _expert_groups(plan.pp, plan.dp * tp, ep, rank)
    where = coordinates(rank, pp=plan.pp, dp=plan.dp, cp=cp, tp=tp)
    cp_group = mesh.get_group("cp") if cp > 1 else None
    dp_cp_group = _gradient_group(plan, rank)
    return Topology(rank=rank, world_size=dist.get_world_size(), pp=plan.pp, dp=plan.dp,
                    pp_rank=where.pp, dp_rank=where.dp,
                    device=device, mesh=mesh, tp=tp, tp_rank=where.tp,
                    ep=ep, ep_rank=rank % (plan.dp * tp) % ep, ep_group=ep_group,
                    expert_dp_group=expert_dp_group, cp=cp, cp_rank=where.cp,
                    cp_group=cp_group, dp_cp_group=dp_cp_group)


def _gradient_group(plan: Plan, rank: int) -> dist.ProcessGroup | None:
    """This rank's dp x cp group (every rank makes every group, in one order, as
    ``new_group`` requires); None with cp = 1 (the dp group is it)."""
    if plan.cp == 1:
        return None
    mine = None
    for ranks in rank_groups(pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp).dp_cp:
        group = group_of(ranks)
        if rank in ranks:
            mine = group
    return mine


def _expert_groups(pp: int, width: int, ep: int, rank: int
                   ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's expert-parallel and expert-data-parallel groups (every rank makes
    every group, in one order, as ``new_group`` requires); None without ep."""
    if ep == 1:
        return None, None
    if width % ep:
        raise PlanMismatchError(f"ep={ep} does not divide a stage's dp x tp = {width} ranks")
    mine: list[dist.ProcessGroup | None] = [None, None]
    for stage in range(pp):
        first = stage * width
        for start in range(first, first + width, ep):
            group = group_of(range(start, start + ep))
            if start <= rank < start + ep:
                mine[0] = group
        for position in range(ep):
            ranks = list(range(first + position, first + width, ep))
            group = group_of(ranks)
            if rank in ranks:
                mine[1] = group
    return mine[0], mine[1]


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """The store of torchrun's agent under a prefix for this attempt. The agent keeps one
    store across ``--max-restarts`` restarts, and a process group made on it directly
    finds the previous attempt's gloo addresses there: a rank that joins before its
    peers connects to a dead address and fails. Keys of attempt k live under
    ``partc/attempt-<k>/`` (TORCHELASTIC_RESTART_COUNT)."""
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size_from_env(), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"partc/attempt-{attempt}", agent)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
