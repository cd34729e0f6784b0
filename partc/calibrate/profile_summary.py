"""``partc calibrate``'s table: what was measured, and the budget's numbers beside the
preset's. It reads the profile as written (a dict loaded from its JSON), so that it shows
any profile file as well as the one just measured.
"""

from __future__ import annotations

from partc.calibrate.collective_fits import COLLECTIVES
from partc.calibrate.fsdp_overheads import FSDP_FIGURES
from partc.calibrate.stopwatch import format_flops, format_rate
from partc.device.budget import PRESETS
from partc.units import format_seconds


def summary(profile: dict) -> str:
    """A short table: what was measured, and the budget's numbers beside the preset's."""
    device, measured = profile["device"], profile["measurements"]
    lines = [f"partc calibrate: {device['name']} ({device['kind']}, {device['processes']} "
             f"processes x {device['threads_per_process']} thread(s)), torch "
             f"{profile['software']['torch']}, {profile['mode']} run", "",
             f"{'measured':<30}{'figure'}"]
    for key, matmul in measured["matmul"].items():
        best = max(matmul["samples"], key=lambda s: s["flops_per_s"])
        lines.append(f"{'matmul ' + key:<30}{format_flops(best['flops_per_s']):<16}"
                     f"best of {len(matmul['samples'])} sizes: {best['m']}x{best['k']}x{best['n']}")
    attention = measured["attention"]
    shape = "x".join(str(v) for v in attention["shape"].values())
    for name, entry in attention.items():
        if isinstance(entry, dict) and "flops_per_s" in entry:
            lines.append(f"{'attention ' + name:<30}{format_flops(entry['flops_per_s']):<16}"
                         f"b x h x s x d = {shape}, fwd")
    memory = measured["memory"]
    lines.append(f"{'memory copy / add':<30}{format_rate(memory['copy']['bytes_per_s'])} / "
                 f"{format_rate(memory['add']['bytes_per_s'])}")
    for key, what in (("elementwise", "element-wise ops fwd+bwd"),
                      ("optimizer", "AdamW step")):
        if key in measured:
            lines.append(f"{what:<30}{format_rate(measured[key]['bytes_per_s'])} in the cost "
                         f"model's bytes")
    if "host_adam" in measured:
        adam = measured["host_adam"]
        lines.append(f"{'host AdamW step':<30}{adam['updates_per_s']:.3g} parameters/s, "
                     f"{adam['kernel']}, {adam['threads']} threads")
    collectives = measured.get("collectives", {})
    fits = {kind: collectives[kind]["fit"] for kind in COLLECTIVES if kind in collectives}
    if collectives:
        fits["joint_fit"] = collectives["joint_fit"]
    if between := collectives.get("between_compute"):   # timed as a step meets them
        fits |= {f"{kind}, in a step": between[kind]["fit"] for kind in COLLECTIVES}
        fits["joint_fit, in a step"] = between["joint_fit"]
    for kind, fit in fits.items():
        if fit is None:
            lines.append(f"{kind:<30}no fit: times do not grow with message size")
        else:
            lines.append(f"{kind:<30}{format_seconds(fit['latency_s']) + '/step':<16}"
                         f"{format_rate(fit['bandwidth'])} per link, fit error median "
                         f"{fit['median_rel_error']:.0%} max {fit['max_rel_error']:.0%}")
    notes = [f"note: {note}" for note in profile["notes"]]
    return "\n".join(lines + [""] + _budget_rows(profile) + ([""] + notes if notes else []))


def _budget_rows(profile: dict) -> list[str]:
    budget, preset_name = profile["budget"], profile["device"]["preset"]
    preset = PRESETS.get(preset_name) if preset_name else None
    rows = [("peak_flops " + key, format_flops(value),
             format_flops(preset.peak_flops[key]) if preset and key in preset.peak_flops else "-")
            for key, value in budget["peak_flops"].items()]
    formats = {"flops_efficiency": "{:.2f}".format, "memory": lambda b: f"{b / 2**30:.1f} GiB",
               "hbm_bandwidth": format_rate, "devices_per_node": str,
               "intra_node_bandwidth": format_rate, "intra_node_latency_s": format_seconds,
               "link_latency_s": format_seconds, "inter_node_bandwidth": format_rate,
               "op_overhead_s": format_seconds, "op_overhead_backward_s": format_seconds,
               "matmul_overhead_s": format_seconds, "kernel_overhead_s": format_seconds,
               "comm_overlap": "{:.2f}".format,
               "split_backward_factor": "{:.2f}".format, "elementwise_bandwidth": format_rate,
               "optimizer_bandwidth": format_rate,
               "host_to_device_bandwidth": format_rate,
               "device_to_host_bandwidth": format_rate,
               "host_adam_rate": lambda rate: f"{rate:.3g}/s"} | {
                   name: format_rate if name.endswith("bandwidth") else format_seconds
                   for name in FSDP_FIGURES}
    for key, show in formats.items():
        mine = "(preset)" if budget.get(key) is None else show(budget[key])
        theirs = getattr(preset, key) if preset else None
        rows.append((key, mine, "-" if theirs is None else show(theirs)))
    head = ("budget number", "profile", f"preset {preset_name}" if preset else "no preset")
    return [f"{a:<30}{b:<16}{c}" for a, b, c in (head, *rows)]
