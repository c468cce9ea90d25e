"""Where the first training step of the compiled recurrence goes, on a warm compile cache: the `state-tracking`
preset's model (seed 0), its token steps compiled 8 positions per call as `fullband train` runs them
(``FullBandLM.compile_recurrence(8)``), one training step (``sequential_loss``, backward, AdamW) on one batch of 32
windows of 32 byte tokens, in a fresh process per measurement, one thread. Variants:

- ``compiled``: the product's path. ``torch.compile`` once, then the first step. Since 2026-12-08 (fullband's
  ``CompiledSteps``) the chunk's trace an earlier run kept (here the untimed process) is loaded with its compiled
  forward and backward; before, dynamo traced the 8-position chunk in every process and inductor's caches gave back
  the compiled graphs. Either way inductor probes the CPU's vector ISAs (a test library per ISA, built once and
  cached, loaded in a child process each) before it loads the kernels;
- ``ISA probes``: that probe alone (``torch._inductor.cpu_vec_isa``), after its import;
- ``precompiled``: the same chunk through torch's experimental ``aot_compile`` (``torch.compile(...).aot_compile``,
  ``torch.compiler.load_compiled_function``): compiled and saved once, untimed; each timed process loads the saved
  function instead of tracing (with inductor's default options, the Python wrapper). fullband does not use this API
  (a saved graph is only right for the model code, shapes and CPU it was built for, which its file would have to be
  keyed by, where the kept trace is checked against them by torch).

Each variant's first step is timed from before the chunk function is built or loaded (``compile_recurrence``, or the
load) to the end of the step; ``later step`` is the median of the next 5. The variants alternate, in an order
rotated every round, after one untimed process of each (the compile cache and the saved function warm). Both
compiled variants must give the same first-step loss (the same graph).

Usage:
    python benchmarks/first_step.py                 # 3 rounds
    python benchmarks/first_step.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("compiled", "ISA probes", "precompiled")


def child(variant: str, saved: Path) -> dict:
    """One measurement, in this (fresh) process."""
    started = time.perf_counter()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from state_tracking_models import build

    from fullband.model import windowed_token_steps
    from fullband.train.objective import sequential_loss

    torch.set_num_threads(1)
    imported = time.perf_counter()
    if variant == "ISA probes":
        from torch._inductor import cpu_vec_isa

        start = time.perf_counter()
        usable = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list() if isa]
        return {"import_s": imported - started, "first_s": time.perf_counter() - start, "isas": usable}
    model, optimizer, config = build({}, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, config.model.vocab_size, (32, 33), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        out = sequential_loss(model, ids[:, :-1], ids[:, 1:])
        out.loss.backward()
        optimizer.step()
        return out.loss.item()

    start = time.perf_counter()
    if variant == "precompiled":
        model.compiled_steps, model.compiled_chunk = PrecompiledSteps(saved, windowed_token_steps), 8
    else:
        model.compile_recurrence(8)
    loss = step()
    first = time.perf_counter() - start
    later = []
    for _ in range(5):
        tick = time.perf_counter()
        step()
        later.append(time.perf_counter() - tick)
    return {"import_s": imported - started, "first_s": first, "later_step_s": statistics.median(later), "loss": loss}


class PrecompiledSteps:
    """The chunk function through torch's experimental ahead-of-time compile: loaded from ``path`` when it is there,
    else compiled for the first call's arguments and saved there."""

    def __init__(self, path: Path, steps):
        self.path, self.steps, self.fn = path, steps, None

    def __call__(self, *args):
        import torch

        if self.fn is None:
            if self.path.exists():
                with open(self.path, "rb") as f:
                    self.fn = torch.compiler.load_compiled_function(f)
            else:
                compiled = torch.compile(self.steps, backend="inductor", dynamic=False, fullgraph=True)
                self.fn = compiled.aot_compile((args, {}))
                self.fn.save_compiled_function(str(self.path))
        return self.fn(*args)


def measure(variant: str, saved: Path) -> dict:
    """``child`` in a fresh process (its wall time beside what it reports)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tick = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", variant, "--saved", str(saved)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - tick}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="timed processes of each variant, alternating (default 3)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/first_step.json"))
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--saved", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.saved)))
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine_info, write_record

    machine = machine_info(1, "cpu")
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# the compiled recurrence's first training step\n\ncommand: `{command}`\n\nmachine: "
          f"{machine['cpu_model']}, {machine['cpu_count']} cores visible, torch {machine['torch']}, 1 thread\n")
    runs = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "steps.bin"
        for variant in VARIANTS:  # untimed: warms the compile cache, compiles and saves the precompiled function
            measure(variant, saved)
        for round_ in range(args.rounds):
            for variant in VARIANTS[round_ % 3:] + VARIANTS[: round_ % 3]:
                runs[variant].append(measure(variant, saved))
                print(f"round {round_}: {variant}: {runs[variant][-1]['first_s']:.2f} s", flush=True)
    if len({r["loss"] for v in ("compiled", "precompiled") for r in runs[v]}) != 1:
        raise SystemExit("the compiled and precompiled first steps differ in loss: not the same graph")

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    summary = {v: {k: [r[k] for r in rs] for k in ("import_s", "first_s", "later_step_s", "process_s") if k in rs[0]}
               for v, rs in runs.items()}
    print("\n| variant | first step (or probe) s | later step ms | imports s | process s |\n|---|---|---|---|---|")
    for v, s in summary.items():
        later = cell([1000 * x for x in s["later_step_s"]]) if "later_step_s" in s else "–"
        print(f"| {v} | {cell(s['first_s'])} | {later} | {cell(s['import_s'])} | {cell(s['process_s'])} |")
    print(f"\nthe ISAs inductor found usable: {', '.join(runs['ISA probes'][0]['isas'])}")
    return write_record(args.out, {"benchmark": "first_step", "command": command, "machine": machine,
                                   "rounds": args.rounds, "summary": summary,
                                   "isas": runs["ISA probes"][0]["isas"]})


if __name__ == "__main__":
    main()
