"""Collective times fitted to the ring form the cost model prices them by.

All-reduce, all-gather, reduce-scatter and a send/recv ping-pong are timed over message
sizes m (bytes of the whole tensor; send/recv: of the message) and fitted, by least
squares on relative error, to the ring form of ``partc.cost.collectives.ring_seconds``::

    t(m) = steps · latency + (steps / n) · m / bandwidth

with steps = 2(n-1) for all-reduce, n-1 for all-gather and reduce-scatter (1 and a factor
of 1 for send/recv). So ``bandwidth`` is what one link carries, comparable with a
preset's ``intra_node_bandwidth``, and ``latency`` is one ring step's, the preset's
``intra_node_latency_s``. One joint fit over the four collectives gives the budget's
numbers; each collective's own fit (alpha = steps · latency) is kept beside it.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from partc.calibrate.calibration_options import CalibrationError
from partc.calibrate.stopwatch import format_rate
from partc.units import format_seconds

log = logging.getLogger(__name__)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def ring_steps(kind: str, ranks: int) -> int:
    """Latency terms of one collective in a ring of ``ranks``."""
    if kind == "send_recv":
        return 1
    return 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1


def ring_factor(kind: str, ranks: int) -> float:
    """Bytes each rank sends, per byte of the whole tensor (send/recv: of the message)."""
    return 1.0 if kind == "send_recv" else ring_steps(kind, ranks) / ranks


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """``t = steps · latency_s + factor · bytes / bandwidth`` (ring_steps, ring_factor)."""

    latency_s: float               # seconds per ring step
    bandwidth: float               # bytes per second one link carries

    def predict(self, kind: str, nbytes: float, ranks: int) -> float:
        return (ring_steps(kind, ranks) * self.latency_s
                + ring_factor(kind, ranks) * nbytes / self.bandwidth)


@dataclass(frozen=True, kw_only=True)
class CollectiveSample:
    """One collective on one message size, timed."""

    nbytes: int                    # of the whole tensor (send/recv: of the message)
    seconds: float                 # per call (send/recv: per message, half a round trip)

    def to_dict(self) -> dict:
        return {"bytes": self.nbytes, "seconds": self.seconds}


@dataclass(frozen=True, kw_only=True)
class FittedLink:
    """A fit and how well it predicts the samples it was fitted to."""

    latency_s: float               # seconds per ring step
    bandwidth: float               # bytes per second one link carries
    median_rel_error: float        # |predicted - timed| / timed over the samples
    max_rel_error: float
    alpha_s: float | None = None   # steps · latency_s: a collective's own fit only

    @property
    def link(self) -> LinkFit:
        return LinkFit(latency_s=self.latency_s, bandwidth=self.bandwidth)

    def to_dict(self) -> dict:
        record = {"latency_s": self.latency_s, "bandwidth": self.bandwidth,
                  "median_rel_error": self.median_rel_error,
                  "max_rel_error": self.max_rel_error}
        return record if self.alpha_s is None else record | {"alpha_s": self.alpha_s}


@dataclass(frozen=True, kw_only=True)
class CollectiveSeries:
    """One collective's samples over the message sizes, and its own fit."""

    samples: tuple[CollectiveSample, ...]
    fit: FittedLink | None         # None where noise hid its growth with size

    def to_dict(self) -> dict:
        return {"samples": [s.to_dict() for s in self.samples],
                "fit": None if self.fit is None else self.fit.to_dict()}


@dataclass(frozen=True, kw_only=True)
class LinkFits:
    """Each collective with its own fit, and the joint fit over all four."""

    series: Mapping[str, CollectiveSeries]   # by kind, in COLLECTIVES' order
    joint_fit: FittedLink

    def to_dict(self) -> dict:
        return {**{kind: self.series[kind].to_dict() for kind in COLLECTIVES},
                "joint_fit": self.joint_fit.to_dict()}


def fit_link(samples: list[tuple[str, float, float]], ranks: int) -> LinkFit:
    """Least squares of relative error over (kind, bytes, seconds) samples, both
    coefficients kept non-negative. Relative, so small messages (which fix the latency)
    count as much as large ones (which fix the bandwidth)."""
    rows = [(ring_steps(kind, ranks) / t, ring_factor(kind, ranks) * nbytes / t)
            for kind, nbytes, t in samples]
    latency, seconds_per_byte = _nonnegative_least_squares(rows)
    if seconds_per_byte <= 0:
        raise CalibrationError("collective times do not grow with message size; measure "
                               "larger messages (drop --quick)")
    return LinkFit(latency_s=latency, bandwidth=1 / seconds_per_byte)


def _nonnegative_least_squares(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """argmin over x, y >= 0 of sum (a·x + b·y - 1)^2 for rows (a, b)."""
    aa = sum(a * a for a, _ in rows)
    bb = sum(b * b for _, b in rows)
    ab = sum(a * b for a, b in rows)
    a1 = sum(a for a, _ in rows)
    b1 = sum(b for _, b in rows)
    candidates = [(a1 / aa, 0.0), (0.0, b1 / bb)]
    det = aa * bb - ab * ab
    if det > 0:
        x, y = (a1 * bb - b1 * ab) / det, (b1 * aa - a1 * ab) / det
        if x >= 0 and y >= 0:
            candidates.append((x, y))
    return min(candidates, key=lambda xy: sum((a * xy[0] + b * xy[1] - 1) ** 2 for a, b in rows))


def _fitted(fit: LinkFit, samples: list[tuple[str, float, float]], ranks: int,
            alpha_s: float | None = None) -> FittedLink:
    errors = [abs(fit.predict(kind, nbytes, ranks) - t) / t for kind, nbytes, t in samples]
    return FittedLink(latency_s=fit.latency_s, bandwidth=fit.bandwidth,
                      median_rel_error=statistics.median(errors), max_rel_error=max(errors),
                      alpha_s=alpha_s)


def fit_collectives(timed: Mapping[str, Sequence[CollectiveSample]], ranks: int) -> LinkFits:
    """Each collective's samples in ``timed`` with its own fit, and the joint fit over
    all of them (which raises a CalibrationError where noise hides every growth)."""
    series, everything = {}, []
    for kind in COLLECTIVES:
        samples = [(kind, s.nbytes, s.seconds) for s in timed[kind]]
        everything += samples
        series[kind] = CollectiveSeries(samples=tuple(timed[kind]),
                                        fit=_own_fit(kind, samples, ranks))
    return LinkFits(series=series,
                    joint_fit=_fitted(fit_link(everything, ranks), everything, ranks))


def _own_fit(kind: str, samples: list[tuple[str, float, float]],
             ranks: int) -> FittedLink | None:
    """One collective's fit, or None when noise hides its growth with size (the joint
    fit, over all four, decides the budget's numbers)."""
    try:
        fit = fit_link(samples, ranks)
    except CalibrationError as error:
        log.warning("%s: no fit: %s", kind, error)
        return None
    log.info("%s: latency %s per step, %s per link", kind, format_seconds(fit.latency_s),
             format_rate(fit.bandwidth))
    return _fitted(fit, samples, ranks, alpha_s=ring_steps(kind, ranks) * fit.latency_s)
