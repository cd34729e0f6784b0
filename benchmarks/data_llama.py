"""A Hugging Face Llama trained from a token file with ``partc train --data``: one
process against two (dp=2, each rank reading its replica's rows; pp=2, two stages), the
same losses step by step, and the loss falling.

The token file is ``samples/declaration.txt`` as byte ids (uint16, nanoGPT's format,
written with ``partc.corpus.write_token_file``); the model ``samples/llama_text.py``'s
tiny ``LlamaForCausalLM`` (2 layers, 128 wide, vocabulary 256, sequences of 64, a global
batch of 16), AdamW at 3e-3 with a cosine to 0. Three ``torchrun`` launches (gloo on
CPU); each writes its telemetry to ``<out>/<run>/rank0.jsonl``, whose losses are printed
side by side with the largest relative difference from one process over the first
``--parity-steps`` steps and over all.

    python benchmarks/data_llama.py [--steps 30] [--parity-steps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partc.corpus import ByteTokenizer, write_token_file  # noqa: E402

RUNS = {"1 process": (1, []), "dp=2": (2, ["--dp", "2"]), "pp=2": (2, ["--pp", "2"])}


def launch(processes: int, pins: list[str], tokens: Path, steps: int, log_dir: Path) -> float:
    """One ``partc train --data`` launch; returns its wall time in seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", "-m", "partc", "train",
               str(ROOT / "samples" / "llama_text.py") + ":factory", "--data", str(tokens),
               "--steps", str(steps), "--lr", "3e-3", "--log-dir", str(log_dir), "-q",
               *pins]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "300",
           "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"torchrun exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - started


def losses(log_dir: Path) -> list[float]:
    lines = (log_dir / "rank0.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["event"] == "step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="partc-data-llama-"))
    out.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "samples" / "declaration.txt").read_text()
    tokens = write_token_file(ByteTokenizer().encode(text), out / "declaration.bin")
    print(f"token file {tokens}: {tokens.stat().st_size // 2} uint16 ids")
    seen, walls = {}, {}
    for name, (processes, pins) in RUNS.items():
        log_dir = out / name.replace(" ", "-").replace("=", "")
        walls[name] = launch(processes, pins, tokens, args.steps, log_dir)
        seen[name] = losses(log_dir)
    names = list(RUNS)
    print("step  " + "  ".join(f"{name:>10}" for name in names))
    for step in range(args.steps):
        print(f"{step + 1:>4}  " + "  ".join(f"{seen[n][step]:>10.6f}" for n in names))
    reference = seen[names[0]]
    for name in names[1:]:
        def worst(count: int) -> float:
            return max(abs(a - b) / abs(b) for a, b in zip(seen[name][:count], reference))
        print(f"{name}: worst relative difference from one process {worst(args.parity_steps):.2e} "
              f"over the first {args.parity_steps} steps, {worst(args.steps):.2e} over "
              f"{args.steps}; loss {seen[name][0]:.3f} -> {seen[name][-1]:.3f}; "
              f"{walls[name]:.0f} s wall")
    print(f"1 process: loss {reference[0]:.3f} -> {reference[-1]:.3f}; "
          f"{walls[names[0]]:.0f} s wall")


if __name__ == "__main__":
    main()
