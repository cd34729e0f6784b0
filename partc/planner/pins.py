"""Pins that cannot hold, refused before any search: a PlanInfeasibleError naming the pin.

The search (:func:`~.search.candidate_configs`) would find no configuration for most of
these, and say so only in general terms; a pipeline degree above the layer count would
reach CP-SAT as an invalid model. Each check here names the pin, its value and the
number it contradicts. Checks on the devices and the batch need no model, so
``partc.compile`` runs them before tracing (``layer_names=None``); the checks on layer
names run once the model's layers are known.

Pins that contradict each other whatever the model (``pp`` and the number of pinned
``stages``; ZeRO with ``dp=1``) are refused earlier still, by ``Constraints`` itself.
"""

from __future__ import annotations

from partc.cost.host_offload import host_ready
from partc.errors import PlanInfeasibleError
from partc.names import Offload
from partc.problem import DeviceNumbers, Pins


def _refuse(pin: str, message: str) -> PlanInfeasibleError:
    return PlanInfeasibleError(f"cannot hold the pin {pin}: {message}", resource="pin",
                               pin=pin, suggestion=f"change or drop the {pin} pin")


def check_pins(pins: Pins, devices: DeviceNumbers, global_batch_size: int,
               layer_names: tuple[str, ...] | None = None) -> None:
    """Raise PlanInfeasibleError for the first pin that no plan can satisfy."""
    _check_mesh(pins, devices)
    _check_offload(pins, devices)
    _check_batch(pins, global_batch_size)
    _check_host(pins, devices)
    if layer_names is not None:
        _check_layers(pins, layer_names)


def _check_mesh(pins: Pins, devices: DeviceNumbers) -> None:
    n, node = devices.num_devices, devices.devices_per_node
    if pins.tp is not None and pins.tp > 1 and (node % pins.tp or n % pins.tp):
        raise _refuse("tp", f"tp={pins.tp} must divide the {node} devices of a node and "
                            f"the {n} devices (a tensor-parallel group stays inside a node)")
    tp, cp = pins.tp or 1, pins.cp or 1
    if pins.cp is not None and (n // tp) % cp:
        within = f"the {n} devices" + (f" / tp={tp}" if tp > 1 else "")
        raise _refuse("cp", f"cp={cp} does not divide {within}")
    for name in ("pp", "dp"):
        value = getattr(pins, name)
        if value is not None and (n // (tp * cp)) % value:
            within = f"the {n} devices" + (f" / tp={tp}" if tp > 1 else "") + (
                f" / cp={cp}" if cp > 1 else "")
            raise _refuse(name, f"{name}={value} does not divide {within}")
    if pins.pp is not None and pins.dp is not None and pins.tp is not None \
            and pins.cp is not None and pins.pp * pins.dp * pins.cp * pins.tp != n:
        raise _refuse("pp x dp x cp x tp",
                      f"pp={pins.pp} x dp={pins.dp} x cp={pins.cp} x tp={pins.tp} = "
                      f"{pins.pp * pins.dp * pins.cp * pins.tp}, not the {n} devices")
    if pins.pp is not None and pins.dp is not None and pins.tp is not None \
            and pins.cp is None and pins.pp * pins.dp * pins.tp != n:
        raise _refuse("pp x dp x tp", f"pp={pins.pp} x dp={pins.dp} x tp={pins.tp} = "
                                      f"{pins.pp * pins.dp * pins.tp}, not the {n} devices")
    if pins.pp is not None and pins.dp is not None and n % (pins.pp * pins.dp * cp):
        raise _refuse("pp x dp", f"pp={pins.pp} x dp={pins.dp}" + (
            f" x cp={cp}" if cp > 1 else "") + f" does not divide the {n} devices")


def _check_offload(pins: Pins, devices: DeviceNumbers) -> None:
    """Layers pinned to offload their activations need the host link's bandwidth (to
    price the copies), the host's memory (to hold them) and an offload pin that does
    not leave activations out."""
    offloaded = sorted(name for name, mode in pins.recompute.items() if mode == "offload")
    if not offloaded and (pins.offload is None or "activations" not in pins.offload):
        return
    what = f"recompute='offload' for {offloaded}" if offloaded else "offload=activations"
    if not (devices.host_to_device_bandwidth and devices.device_to_host_bandwidth):
        raise _refuse("recompute" if offloaded else "offload",
                      f"{what} needs the host link's bandwidth, which the budget does not "
                      f"know: give DeviceBudget(host_to_device_bandwidth=..., "
                      f"device_to_host_bandwidth=...)")
    if devices.host_memory is None:
        raise _refuse("recompute" if offloaded else "offload",
                      f"{what} needs the host's memory, which the budget does not know: "
                      f"give DeviceBudget(host_memory=...) (per node)")
    if offloaded and pins.offload is not None and "activations" not in pins.offload:
        raise _refuse("offload", f"offload={list(pins.offload)} leaves activations on the "
                                 f"device, but {what} was pinned: add 'activations'")


def _check_host(pins: Pins, devices: DeviceNumbers) -> None:
    lacking = host_ready(devices)
    kinds = set(pins.offload or ()) & {Offload.OPTIMIZER, Offload.PARAMS}
    if kinds and lacking is not None:
        raise _refuse("offload", f"offload={[str(k) for k in pins.offload]}: {lacking}")


def _check_batch(pins: Pins, batch: int) -> None:
    where = f"global batch {batch}"
    if pins.dp is not None:
        if batch % pins.dp:
            raise _refuse("dp", f"dp={pins.dp} does not divide the {where}")
        batch //= pins.dp
        where = f"{batch} samples per replica (global batch / dp={pins.dp})"
    for name in ("num_microbatches", "micro_batch_size"):
        value = getattr(pins, name)
        if value is not None and batch % value:
            raise _refuse(name, f"{name}={value} does not divide the {where}")
    if pins.num_microbatches is not None and pins.micro_batch_size is not None \
            and batch % (pins.num_microbatches * pins.micro_batch_size):
        raise _refuse("num_microbatches x micro_batch_size",
                      f"{pins.num_microbatches} microbatches x {pins.micro_batch_size} "
                      f"samples do not divide the {where}")


def _check_layers(pins: Pins, names: tuple[str, ...]) -> None:
    if pins.pp is not None and pins.pp > len(names):
        raise _refuse("pp", f"pp={pins.pp} stages need at least {pins.pp} layers; the model "
                            f"has {len(names)}: {list(names)}")
    unknown = sorted(set(pins.recompute) - set(names))
    if unknown:
        raise _refuse("recompute", f"recompute names unknown layers {unknown}; layers are "
                                   f"{list(names)}")
    if pins.stages is not None:
        flat = [name for stage in pins.stages for name in stage]
        if flat != list(names):
            unknown = sorted(set(flat) - set(names))
            missing = [name for name in names if name not in flat]
            detail = (f"unknown layers {unknown}; " if unknown else "") + \
                (f"missing {missing}; " if missing else "")
            raise _refuse("stages", f"Constraints.stages must list every layer once, in "
                                    f"order: {detail}layers are {list(names)}, pinned {flat}")
