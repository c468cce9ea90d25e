"""Time per optimizer step and peak memory of K-pass training (docs/method.md §4) against a plain transformer.

Variants, same model size, batch and sequence length, train mode, AdamW:

- ``plain``: ``model(ids)`` + cross-entropy, i.e. an ordinary transformer step (the fusion module exists
  but is never called, so it gets no gradient and AdamW skips it);
- ``K=1``: ``multipass_loss(model, ids, labels, passes=1, prefix_mixin=1.0)`` (``fullband.train.objective``, the
  trainer's loss): exactly the plain computation
  (with one pass there is no feedback, no jitter and no mixin; the fusion module is never touched);
- ``K=2``, ``K=3``: the multi-pass objective (jitter σ = config.feedback_jitter, prefix mixin 1.0),
  gradients flowing through every pass (the default);
- ``K=2 detach, per-pass backward``, ``K=3 detach, per-pass backward``: the same with ``detach=True``
  (the carried states are detached) and ``backward_scale=1.0``: ``multipass_loss`` backpropagates each pass's
  loss term right after that pass and frees its graph. This is what the trainer does with
  ``train.detach_passes=true`` in a single process (``backward_scale = 1 / grad_accum``, here 1);
- ``K=3 detach, one backward``: ``detach=True`` with one ``loss.backward()`` after all passes
  (``backward_scale=None``): what ``train.detach_passes=true`` does in distributed runs (DDP/FSDP
  synchronise once per backward), and what it did everywhere before ``backward_scale`` existed;
- ``K=1 AC``, ``K=3 AC`` (opt-in, ``--variants``): ``K=1`` and ``K=3`` with every block checkpointed
  (``train.activation_checkpointing: full``): each block keeps only its input and runs its forward again in
  the backward.

A step is ``zero_grad(set_to_none=True)``, forward and backward (one ``loss.backward()``, or the
per-pass backwards inside ``multipass_loss``), ``optimizer.step()``. The
variants are interleaved: each repetition runs one step of every variant, in an order rotated from
repetition to repetition; ratios are paired within a repetition and summarised by median (min–max).

Memory, three measures (see docs/benchmarks.md):

- ``saved MiB``: peak bytes of the activations autograd holds for the backward at any one time,
  counted with ``torch.autograd.graph.saved_tensors_hooks`` over one forward + backward (distinct
  storages, parameters excluded; a storage counts from its first save until the graph releases its
  last saved reference). With one backward this is everything the forward saved; with per-pass
  backward it is the largest single pass. Deterministic; this is the part of memory that K and
  ``detach`` change. Not reported for the AC variants: the checkpoint holds its blocks' inputs and
  recomputed activations outside autograd's saved tensors, so this count would miss them; their peak RSS Δ
  is the measure.
- ``peak RSS Δ MiB`` (CPU): each variant in a fresh subprocess; the optimizer state is created first
  (one AdamW step on zero gradients), then the high-water mark ``VmHWM`` is reset and read after two
  training steps (``ru_maxrss`` survives exec on Linux, so a child would report its parent's size).
  The difference is the step's peak above the steady state: gradients + activations + temporaries.
- ``cuda peak MiB`` (``--device cuda``): ``torch.cuda.max_memory_allocated`` during a step.

``--exact``: the exact schedule's two paths (``train.exact_mode``) instead, on the models of the
``state-tracking`` and ``cpu`` presets (their model sections, with feedback_jitter 0, which the sequential path
requires) at their batch sizes, random tokens, one document of T tokens per row (so the exact K is T):

- ``jacobi``: ``multipass_loss(..., passes=T, pass_loss="last")``: T passes over all T positions, gradients
  through every pass (``train.exact_mode: jacobi``);
- ``sequential``: ``sequential_loss``: T token steps with backpropagation through them
  (``train.exact_mode: sequential``); the same loss and gradients.

at T = 16, 32, 64, 128, interleaved per repetition (fewer repetitions at larger T), with the same memory
measures. ``--exact-max-jacobi-gib`` skips the Jacobi path at a length whose saved activations, extrapolated
from the previous length (they grow as T², K = T passes of T tokens), would exceed it.

Usage:
    python benchmarks/train_step.py              # full run
    python benchmarks/train_step.py --quick      # smoke run (< 30 s)
    python benchmarks/train_step.py --sizes d256-L6-s1024 --variants K=1 "K=1 AC" K=3 "K=3 AC" \
        --out benchmarks/results/train_step_ac.json   # activation checkpointing
    python benchmarks/train_step.py --exact      # jacobi vs sequential exact recurrence
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import add_common_arguments, machine_info, print_header, setup_device

from fullband.config import load_config
from fullband.loading import PRESET_DIR
from fullband.model import FullBandConfig, FullBandLM
from fullband.train.objective import multipass_loss, sequential_loss

SIZES = {
    "d256-L4": dict(model=dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, d_ff=768), batch=8, seq=256),
    # opt-in (--sizes d256-L4 d512-L6): several minutes per repetition on 2 CPU cores
    "d512-L6": dict(model=dict(vocab_size=8192, d_model=512, n_layers=6, n_heads=8, d_ff=1536), batch=8, seq=256),
    # opt-in: long sequences, where activations outgrow the weights (activation checkpointing)
    "d256-L6-s1024": dict(model=dict(vocab_size=8192, d_model=256, n_layers=6, n_heads=4, d_ff=768), batch=2,
                          seq=1024),
}
DEFAULT_SIZES = ["d256-L4"]
QUICK_SIZES = {
    "d64-L2": dict(model=dict(vocab_size=512, d_model=64, n_layers=2, n_heads=2, d_ff=192), batch=2, seq=64),
}
# label -> (passes, backward); passes 0 means the plain transformer step. backward:
#   "graph"     gradients through every pass, one loss.backward() (the default objective)
#   "per-pass"  detach=True, backward_scale=1.0: each pass backpropagated and freed right after it runs
#               (what train.detach_passes=true does in a single process)
#   "one"       detach=True, one loss.backward() after all passes (detach_passes in DDP/FSDP runs)
VARIANTS = {
    "plain": (0, "graph"),
    "K=1": (1, "graph"),
    "K=2": (2, "graph"),
    "K=3": (3, "graph"),
    "K=2 detach, per-pass backward": (2, "per-pass"),
    "K=3 detach, per-pass backward": (3, "per-pass"),
    "K=3 detach, one backward": (3, "one"),
}
# AC variant -> the variant it runs with every block checkpointed (train.activation_checkpointing: full)
AC_VARIANTS = {"K=1 AC": "K=1", "K=3 AC": "K=3"}
ALL_VARIANTS = [*VARIANTS, *AC_VARIANTS]


# --exact: the presets whose models are compared, and the sequence lengths with their repetitions (the Jacobi
# step grows as T², so fewer at large T).
EXACT_PRESETS = ("state-tracking", "cpu")
EXACT_LENGTHS = {16: 3, 32: 3, 64: 2, 128: 2}
QUICK_EXACT_LENGTHS = {8: 2, 16: 2}
EXACT_VARIANTS = ("jacobi", "sequential")


def exact_size(preset: str, seq: int) -> dict:
    """The preset's model (jitter 0: the sequential path refuses jitter) and batch at sequence length ``seq``."""
    config = load_config(PRESET_DIR / f"{preset}.yaml")
    model = {**config.model.to_dict(), "feedback_jitter": 0.0, "max_seq_len": max(seq, config.model.max_seq_len)}
    return dict(model=model, batch=config.train.batch_size, seq=seq, exact=True)


def build(size: dict, device, dtype, seed: int = 0):
    torch.manual_seed(seed)
    cfg = FullBandConfig(**{"max_seq_len": size["seq"], **size["model"]})
    model = FullBandLM(cfg).to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (size["batch"], size["seq"] + 1), generator=g).to(device)
    return model, opt, data[:, :-1], data[:, 1:]


def forward_backward(model, ids, targets, variant: str, generator) -> None:
    """One forward and backward of ``variant``; gradients accumulate into ``.grad``. Only the loss (and
    its graph) outlives the forward, as in the trainer's step (``multipass_loss`` keeps no pass's logits):
    no Python reference keeps the logits alive through the backward."""
    model.set_activation_checkpointing(1 if variant in AC_VARIANTS else 0)
    if variant in EXACT_VARIANTS:
        T = ids.shape[1]
        if variant == "jacobi":
            out = multipass_loss(model, ids, targets, T, pass_loss="last", prefix_mixin=0.0)
        else:
            out = sequential_loss(model, ids, targets)
        # As the trainer does: the reported per-pass losses (with the graphs of the passes that carry no loss)
        # live through the backward.
        loss, pass_losses = out.loss, out.pass_losses
        del out
        loss.backward()
        del pass_losses
        return
    passes, backward = VARIANTS[AC_VARIANTS.get(variant, variant)]
    if passes == 0:
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1).float(), targets.flatten())
    else:
        out = multipass_loss(
            model,
            ids,
            targets,
            passes,
            prefix_mixin=1.0,
            detach=backward != "graph",
            backward_scale=1.0 if backward == "per-pass" else None,
            generator=generator,
        )
        if backward == "per-pass":  # multipass_loss has backpropagated every term already (out.loss is detached)
            return
        loss = out.loss
        del out
    loss.backward()


def train_step(model, opt, ids, targets, variant: str, generator) -> None:
    opt.zero_grad(set_to_none=True)
    forward_backward(model, ids, targets, variant, generator)
    opt.step()


class SavedBytes:
    """saved_tensors_hooks that track the bytes autograd holds for the backward at any one time.

    pack wraps every saved tensor in a ``_Held`` handle; autograd drops the handle when it releases the
    saved variable (after the node has run in a backward without retain_graph, or when the graph is
    freed), and the handle's ``__del__`` gives its storage back. A storage is counted once while any
    handle to it is alive; parameters are excluded. Storages are told apart by their StorageImpl
    (``_cdata``), not their data pointer: FSDP2 frees a gathered weight by resizing its storage to 0
    bytes while autograd still holds it, and the allocator may then hand that address to another
    tensor, which a data-pointer key would wrongly count as the same storage. ``peak`` is the most held
    at once, so K graphs held together count K times, and K graphs backpropagated one after the other
    count once.
    """

    def __init__(self, model) -> None:
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # StorageImpl address -> [nbytes, handles alive]
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage._cdata
        if ptr in self.params:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Held) else x

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]


class _Held:
    __slots__ = ("t", "ptr", "owner")

    def __init__(self, t: torch.Tensor, ptr: int, owner: SavedBytes) -> None:
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def saved_activation_bytes(model, ids, targets, variant: str) -> int:
    """Peak bytes of non-parameter storages autograd holds for the backward during one forward + backward."""
    counter = SavedBytes(model)
    generator = torch.Generator(device=ids.device).manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        forward_backward(model, ids, targets, variant, generator)
    model.zero_grad(set_to_none=True)
    # The exception: the Jacobi path with pass_loss last does not backpropagate the loss of passes 1..K-1 (weight
    # 0). Their log-softmax nodes save their own output, and through the pack handle that output keeps its node
    # alive: a cycle only the backward breaks, so under these hooks they outlive the step (without the hooks
    # they are freed with the reported losses). They are counted in the peak while the step holds them.
    if counter.live and variant != "jacobi":
        raise RuntimeError(f"{variant}: {len(counter.live)} saved storages still held after the backward")
    return counter.peak


def rss_child(size_name: str, variant: str, quick: bool, threads: int) -> None:
    """Subprocess entry: peak RSS of two training steps above the steady state (model + AdamW state)."""
    torch.set_num_threads(threads)
    size = size_by_name(size_name, quick)
    model, opt, ids, targets = build(size, "cpu", torch.float32)
    for p in model.parameters():  # create the AdamW state (exp_avg, exp_avg_sq) with one zero-gradient step
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(0)
    # VmHWM, not ru_maxrss: on Linux ru_maxrss survives exec, so a child started from a large parent
    # reports the parent's size. Writing 5 to clear_refs resets VmHWM to the current RSS.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    before = proc_status_kib("VmHWM")
    for _ in range(2):
        train_step(model, opt, ids, targets, variant, generator)
    after = proc_status_kib("VmHWM")
    print(json.dumps({"hwm_before_kib": before, "hwm_after_kib": after, "rss_before_kib": proc_status_kib("VmRSS")}))


def size_by_name(name: str, quick: bool) -> dict:
    """A size of SIZES (QUICK_SIZES), or ``exact:<preset>:<T>`` for --exact."""
    if name.startswith("exact:"):
        _, preset, seq = name.split(":")
        return exact_size(preset, int(seq))
    return (QUICK_SIZES if quick else SIZES)[name]


def proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_rss_delta_mib(size_name: str, variant: str, quick: bool, threads: int) -> float | None:
    cmd = [sys.executable, __file__, "--_rss-child", size_name, variant, "--threads", str(threads)]
    if quick:
        cmd.append("--quick")
    # Fixed mmap threshold: tensors above 64 KiB get their own mapping, returned to the OS when freed,
    # so RSS follows live memory instead of glibc heap high-water marks.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"  rss child failed for {size_name} {variant}: {proc.stderr[-500:]}", file=sys.stderr)
        return None
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return (r["hwm_after_kib"] - r["hwm_before_kib"]) / 1024


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bench_size(name: str, size: dict, args, device, dtype, sync, labels: list[str] | None = None,
               repeats: int | None = None, ratio_bases: tuple[str, ...] = ("K=1", "plain")) -> dict:
    """Interleaved timing and memory of ``labels`` (default: every variant of VARIANTS) at one size; step-time
    ratios paired within a repetition against each of ``ratio_bases``."""
    model, opt, ids, targets = build(size, device, dtype)
    labels = args.variants if labels is None else labels
    repeats = args.repeats if repeats is None else repeats
    generator = torch.Generator(device=device).manual_seed(0)
    cuda = device.type == "cuda"
    for v in labels:  # warm-up (also creates the AdamW state)
        train_step(model, opt, ids, targets, v, generator)
    sync()
    times: dict[str, list[float]] = {v: [] for v in labels}
    cuda_peak: dict[str, int] = {}
    for rep in range(repeats):
        order = labels[rep % len(labels) :] + labels[: rep % len(labels)]
        for v in order:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            train_step(model, opt, ids, targets, v, generator)
            sync()
            times[v].append(time.perf_counter() - t0)
            if cuda:
                cuda_peak[v] = max(cuda_peak.get(v, 0), torch.cuda.max_memory_allocated())
        print(f"  {name}: repetition {rep + 1}/{repeats}", file=sys.stderr, flush=True)
    opt.zero_grad(set_to_none=True)
    saved = {v: None if v in AC_VARIANTS else saved_activation_bytes(model, ids, targets, v) for v in labels}
    rss = {}
    if args.rss and not cuda:
        rss = {v: peak_rss_delta_mib(name, v, args.quick, args.threads) for v in labels}
    variants = {}
    for v in labels:
        ratios = {f"ratio_vs_{b.replace('=', '')}": summary([x / y for x, y in zip(times[v], times[b], strict=True)])
                  for b in ratio_bases if b in times}
        variants[v] = {
            "step_s": summary(times[v]),
            **ratios,
            "saved_activation_bytes": saved[v],
            "peak_rss_delta_mib": rss.get(v),
            "cuda_max_allocated_bytes": cuda_peak.get(v),
        }
    params = model.num_parameters()
    return {
        "config": model.config.to_dict(),
        "batch": size["batch"],
        "seq": size["seq"],
        "params": params,
        "params_without_fusion": model.num_parameters(include_fusion=False),
        "variants": variants,
        "raw_step_s": times,
    }


def fmt_ratio(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def table(results: dict) -> str:
    lines = [
        "| size | variant | step s, median | step s, best | step / K=1, paired | best / best K=1 | saved MiB "
        "| saved / K=1 | peak RSS Δ MiB | cuda peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        base = res["variants"]["K=1"]
        for v, r in res["variants"].items():
            rss = r["peak_rss_delta_mib"]
            cuda = r["cuda_max_allocated_bytes"]
            saved, base_saved = r["saved_activation_bytes"], base["saved_activation_bytes"]
            lines.append(
                f"| {name} | {v} | {r['step_s']['median']:.3f} | {r['step_s']['min']:.3f} "
                f"| {fmt_ratio(r['ratio_vs_K1'])} | {r['step_s']['min'] / base['step_s']['min']:.2f} "
                f"| {'-' if saved is None else f'{saved / 2**20:.1f}'} "
                f"| {'-' if saved is None else f'{saved / base_saved:.2f}'} "
                f"| {'-' if rss is None else f'{rss:.0f}'} | {'-' if cuda is None else f'{cuda / 2**20:.0f}'} |"
            )
    return "\n".join(lines)


def bench_exact(args, device, dtype, sync) -> dict:
    """--exact: jacobi vs sequential per preset model and sequence length."""
    lengths = QUICK_EXACT_LENGTHS if args.quick else EXACT_LENGTHS
    results: dict[str, dict] = {}
    for preset in args.exact_presets:
        previous = None  # (T, Jacobi saved bytes) of the last length that ran it
        for seq, repeats in lengths.items():
            labels = list(EXACT_VARIANTS)
            skipped = None
            if previous is not None:
                expected = previous[1] * (seq / previous[0]) ** 2
                if expected > args.exact_max_jacobi_gib * 2**30:
                    labels, skipped = ["sequential"], f"~{expected / 2**30:.1f} GiB of saved activations expected"
            name = f"exact:{preset}:{seq}"
            res = bench_size(name, exact_size(preset, seq), args, device, dtype, sync, labels=labels,
                             repeats=args.repeats or repeats, ratio_bases=("jacobi",))
            res["preset"], res["jacobi_skipped"] = preset, skipped
            if skipped is None:
                previous = (seq, res["variants"]["jacobi"]["saved_activation_bytes"])
            results[name] = res
    return results


def exact_table(results: dict) -> str:
    lines = [
        "| preset model | batch | T | path | step s, median | step s, best | sequential / jacobi, paired "
        "| best / best | saved MiB | peak RSS Δ MiB | cuda peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results.values():
        jacobi = res["variants"].get("jacobi")
        for v, r in res["variants"].items():
            rss, cuda = r["peak_rss_delta_mib"], r["cuda_max_allocated_bytes"]
            paired = fmt_ratio(r["ratio_vs_jacobi"]) if v == "sequential" and jacobi else "-"
            best = f"{r['step_s']['min'] / jacobi['step_s']['min']:.2f}" if v == "sequential" and jacobi else "-"
            lines.append(
                f"| {res['preset']} | {res['batch']} | {res['seq']} | {v} | {r['step_s']['median']:.3f} "
                f"| {r['step_s']['min']:.3f} | {paired} | {best} | {r['saved_activation_bytes'] / 2**20:.1f} "
                f"| {'-' if rss is None else f'{rss:.0f}'} | {'-' if cuda is None else f'{cuda / 2**20:.0f}'} |"
            )
        if res["jacobi_skipped"]:
            lines.append(f"| {res['preset']} | {res['batch']} | {res['seq']} | jacobi | not run: "
                         f"{res['jacobi_skipped']} | | | | | | |")
    return "\n".join(lines)


def crossovers(results: dict) -> dict[str, str]:
    """Per preset model: the shortest T from which the sequential path is faster (paired median < 1), or why
    there is none."""
    found = {}
    for preset in sorted({r["preset"] for r in results.values()}):
        rows = [(r["seq"], r["variants"]["sequential"].get("ratio_vs_jacobi")) for r in results.values()
                if r["preset"] == preset]
        measured = [(seq, ratio["median"]) for seq, ratio in rows if ratio is not None]
        faster = [seq for seq, median in measured if median < 1]
        if not measured:
            found[preset] = "no length measured both paths"
        elif len(faster) == len(measured):
            found[preset] = f"sequential faster at every measured T ({measured[0][0]}..{measured[-1][0]})"
        elif not faster:
            found[preset] = f"jacobi faster at every measured T ({measured[0][0]}..{measured[-1][0]})"
        else:
            found[preset] = f"sequential faster from T = {min(faster)} (faster at {faster})"
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(
        p,
        "one tiny size, 2 repetitions: a smoke run (< 30 s)",
        "interleaved repetitions (default 5; quick 2)",
        ["float32", "bfloat16"],
    )
    p.add_argument("--sizes", nargs="+", default=None, help=f"subset of {list(SIZES)} (default: {DEFAULT_SIZES})")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help=f"variants to run, K=1 among them (default: all but the AC ones); choose from {ALL_VARIANTS}")
    p.add_argument("--no-rss", dest="rss", action="store_false", help="skip the per-variant RSS subprocesses")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/train_step[_exact][_quick].json)")
    p.add_argument("--exact", action="store_true",
                   help="compare the exact schedule's jacobi and sequential paths (train.exact_mode) instead")
    p.add_argument("--exact-presets", nargs="+", default=list(EXACT_PRESETS), choices=EXACT_PRESETS,
                   help="--exact: the presets whose models are compared (default: both)")
    p.add_argument("--exact-max-jacobi-gib", type=float, default=6.0,
                   help="--exact: skip the Jacobi path where its saved activations would exceed this (default 6)")
    p.add_argument("--_rss-child", nargs=2, metavar=("SIZE", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        suffix = ("_exact" if args.exact else "") + ("_quick" if args.quick else "")
        args.out = f"benchmarks/results/train_step{suffix}.json"
    if args._rss_child:
        rss_child(*args._rss_child, quick=args.quick, threads=args.threads)
        return
    if args.exact:
        run_exact(args, argv, p)
        return
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    unknown = [v for v in args.variants if v not in ALL_VARIANTS]
    if unknown or "K=1" not in args.variants:
        p.error(f"--variants must include K=1 (the ratios' base) and come from {ALL_VARIANTS}; got {args.variants}")
    sizes = QUICK_SIZES if args.quick else {k: SIZES[k] for k in DEFAULT_SIZES}
    if args.sizes:
        sizes = QUICK_SIZES if args.quick else SIZES
        unknown = set(args.sizes) - set(sizes)
        if unknown:
            p.error(f"unknown size(s) {sorted(unknown)}; choose from {list(sizes)}")
        sizes = {k: sizes[k] for k in args.sizes}

    device, dtype, sync = setup_device(args, p)

    started = time.time()
    results = {name: bench_size(name, size, args, device, dtype, sync) for name, size in sizes.items()}
    elapsed = time.time() - started

    machine = machine_info(args.threads, args.device)
    command = print_header("train-step benchmark", argv, machine, args)
    shapes = ", ".join(
        f"{n}: batch {r['batch']} × seq {r['seq']}, {r['params'] / 1e6:.2f} M params "
        f"({r['params_without_fusion'] / 1e6:.2f} M without the fusion)"
        for n, r in results.items()
    )
    print(
        f"{shapes}; AdamW; {args.repeats} interleaved repetitions. 'paired': ratio within a repetition, "
        "median (min–max) over repetitions; 'best': fastest repetition (other processes only ever add "
        "time). saved: activation bytes autograd keeps for the backward; peak RSS Δ: step peak above "
        "model + AdamW state, fresh process per variant.\n"
    )
    print(table(results))
    print(f"\nwall time {elapsed:.1f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "train_step",
        "command": command,
        "machine": machine,
        "settings": {"repeats": args.repeats, "dtype": args.dtype, "quick": args.quick, "rss": args.rss,
                     "variants": args.variants},
        "wall_s": elapsed,
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")


def run_exact(args, argv: list[str] | None, p: argparse.ArgumentParser) -> None:
    device, dtype, sync = setup_device(args, p)
    started = time.time()
    results = bench_exact(args, device, dtype, sync)
    elapsed = time.time() - started
    machine = machine_info(args.threads, args.device)
    command = print_header("train-step benchmark: the exact recurrence, jacobi vs sequential", argv, machine, args)
    print("Models of the state-tracking and cpu presets (feedback_jitter 0), their batch sizes, one document of T "
          "random tokens per row (exact K = T); AdamW. 'paired': sequential / jacobi step time within a repetition, "
          "median (min–max); 'best': fastest steps' ratio. saved: activation bytes autograd keeps for the backward; "
          "peak RSS Δ: step peak above model + AdamW state, fresh process per path.\n")
    print(exact_table(results))
    found = crossovers(results)
    for preset, text in found.items():
        print(f"\ncrossover, {preset}: {text}")
    print(f"\nwall time {elapsed:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "train_step_exact", "command": command, "machine": machine,
               "settings": {"repeats": args.repeats, "lengths": QUICK_EXACT_LENGTHS if args.quick else EXACT_LENGTHS,
                            "dtype": args.dtype, "quick": args.quick, "rss": args.rss,
                            "exact_max_jacobi_gib": args.exact_max_jacobi_gib},
               "wall_s": elapsed, "crossover": found, "results": results}
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
