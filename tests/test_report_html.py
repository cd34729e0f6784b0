"""The HTML report: one self-contained page holding the text report's content and its
three pictures, rendered by a real browser (headless Chromium) into a non-blank page."""

from __future__ import annotations

import dataclasses
import html
import re
import shutil
import subprocess

import pytest

from partc.compiler import plan_problem
from partc.placement import Placement
from partc.plan import Plan, TensorParallelPlan, TPCollective
from partc.problem import Pins
from partc.report.text import render, sections

from .planner.instances import devices, layer, problem

PICTURES = ("Step timeline per pipeline stage", "Memory per rank of each stage",
            "Mesh factorisations")


@pytest.fixture(scope="module")
def plan() -> Plan:
    """Two stages that send activations, several microbatches, meshes to compare."""
    layers = [layer(f"l{i}", flops=(i + 1) * 1e9, params=1000) for i in range(4)]
    return plan_problem(problem(layers, [2e6] * 3, devices(4, 10**7), batch=8,
                                micro_batch_sizes=(1, 2), pins=Pins(pp=2)))


def test_html_is_self_contained_and_holds_the_report(plan):
    page = render(plan, "html")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert len(svgs) == 3
    for svg, title in zip(svgs, PICTURES):
        assert re.search(rf"<title>{re.escape(title)}", svg)
        assert f">{title}" in svg   # the picture's own heading, drawn as text
    # Nothing to fetch at view time: no scripts, no sources, links only inside the page;
    # the only URLs left are XML namespace names.
    assert "<script" not in page and "src=" not in page and "@import" not in page
    assert all(ref.startswith("#") for ref in re.findall(r'href="([^"]*)"', page))
    assert "http" not in re.sub(r'xmlns(:\w+)?="[^"]*"', "", page)
    # Everything the text report says is in the page.
    for section in sections(plan):
        for line in (*section.bullets, *section.notes, *section.after,
                     *(cell for row in section.rows for cell in row)):
            assert html.escape(line.removeprefix("- "), quote=True) in page, line
    assert html.escape(render(plan, "text"), quote=True) in page
    # A saved plan renders the same page (what `partc report plan.json` shows).
    assert render(Plan.from_json(plan.to_json()), "html") == page


def _chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


def test_html_renders_in_headless_chromium(plan, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser or google-chrome) on "
                    "PATH; `bash .ci/install test` installs Debian's chromium")
    from matplotlib.image import imread

    page, shot = tmp_path / "report.html", tmp_path / "report.png"
    page.write_text(render(plan, "html"))
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1400,3000", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (3000, 1400)
    inked = (pixels.min(axis=2) < 0.9).mean()
    assert inked > 0.02, f"the screenshot is nearly blank ({100 * inked:.2f}% inked)"

    def drawn(colour: str) -> int:
        rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(pixels - rgb).max(axis=2) < 0.02).sum())

    # The pictures are drawn, not just present: the forward blue of the timeline and of
    # the parameters bar, the backward orange, the limit's red.
    for colour in ("#4c78a8", "#f58518", "#d62728"):
        assert drawn(colour) > 200, colour


def test_tensor_parallel_layers_are_tabled(plan):
    section = TensorParallelPlan(
        degree=2, sequence_parallel=False, objective="time",
        params={"l1.weight": Placement.parse("Shard(0)")},
        collectives={"l1": (TPCollective(kind="all_reduce", phase="forward", nbytes=1024),
                            TPCollective(kind="all_reduce", phase="backward", nbytes=2048))},
        collective_seconds={"l1": 1e-4})
    tp_plan = dataclasses.replace(plan, tensor_parallel=section,
                                  mesh=dataclasses.replace(plan.mesh, dp=1, tp=2))
    page = render(tp_plan, "html")
    assert "<h2>Tensor parallelism</h2>" in page
    assert "sequence parallelism off: Megatron&#x27;s plain tensor parallelism" in page
    layers = page[page.index('<section id="layers">'):]
    row = re.search(r"<tr><td>l1</td>.*?</tr>", layers).group(0)
    assert "<td>weight Shard(0)</td>" in row
    assert "<td>1 all-reduce forward, 1 all-reduce backward (3.00 KiB)</td>" in row
    assert "tensor-parallel collectives" in page   # drawn in the timeline's legend
