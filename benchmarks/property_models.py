"""The long profile of the property-based tests: many random models (depth, widths,
skips over 1-3 blocks, in-place ops, activations, tied weights, buffers, BatchNorm
where dp=1; ``tests/random_models.py``) compiled for 2 processes under pp=2, tp=2 and
dp=2 and trained against one process (losses, every parameter and buffer, rtol 1e-5).

    python benchmarks/property_models.py [--models 60] [--seed 0] [--out DIR]
        [--meshes pp2,tp2] [--schedules zbv-zero-bubble,dualpipev]

Under pp=2 each model draws one of every schedule torch runs (``--schedules`` narrows
them: the zero-bubble ones split backward in two); under tp=2, sequence parallelism on
(its linears run as rings) or the planner's choice. Prints, besides, how many pp=2
models ran a zero-bubble schedule and how many tp=2 models ran rings.

Models are drawn by hypothesis from ``--seed`` (the same list for the same arguments)
and trained in one torchrun launch (``tests/runtime/random_worker.py``; launched again
after a model that ends the job). Prints the models tried and passed, per mesh, and
the failures by class (an error's first line), each with the spec of its first model
to replay it (``Case.from_json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.random_models import MESHES, SCHEDULES, ZERO_BUBBLE, draw_cases  # noqa: E402
from tests.runtime.random_worker import failure, failure_class, launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="where the workers write (default: a temporary folder)")
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="partc-property-"))
    meshes, schedules = tuple(args.meshes.split(",")), tuple(args.schedules.split(","))
    cases = draw_cases(args.models, seed=args.seed, meshes=meshes, schedules=schedules)
    start = time.perf_counter()
    results = launch(cases, out)
    seconds = time.perf_counter() - start
    tried, passed = Counter(), Counter()
    classes: dict[str, list[int]] = defaultdict(list)
    for index, (case, ranks) in enumerate(zip(cases, results)):
        tried[case.mesh] += 1
        message = failure(ranks)
        if message is None:
            passed[case.mesh] += 1
        else:
            classes[failure_class(message)].append(index)
    print(f"{len(cases)} models tried, {sum(passed.values())} passed, "
          f"in {seconds:.0f} s (seed {args.seed}; results under {out})")
    for mesh in meshes:
        print(f"  {mesh}: {passed[mesh]}/{tried[mesh]} passed")
    split = [i for i, c in enumerate(cases) if c.mesh == "pp2" and c.schedule in ZERO_BUBBLE]
    rings = [i for i, c in enumerate(cases) if c.mesh == "tp2" and c.sequence_parallel]
    ringed = [i for i in rings if all(r.get("ring_steps", 0) for r in results[i])]
    print(f"  zero-bubble (pp2): {sum(failure(results[i]) is None for i in split)}/"
          f"{len(split)} passed")
    print(f"  sequence-parallel (tp2): {sum(failure(results[i]) is None for i in rings)}/"
          f"{len(rings)} passed, {len(ringed)} of them ran rings")
    print(f"failure classes: {len(classes)}")
    for message, indices in sorted(classes.items(), key=lambda item: -len(item[1])):
        meshes = Counter(cases[i].mesh for i in indices)
        print(f"- {len(indices)} x {message} ({', '.join(f'{m}: {n}' for m, n in meshes.items())})")
        print(f"    replay: {json.dumps(cases[indices[0]].to_json(), separators=(',', ':'))}")


if __name__ == "__main__":
    main()
