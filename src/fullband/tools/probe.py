"""``fullband probe``: linear probes of a synthetic task's running state, per layer and decode mode
(docs/evaluation.md)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fullband.architectures import refuse_arch
from fullband.bench.cli import run_data_settings
from fullband.bench.plots import PLOT_EXTRA, pyplot, save_figure
from fullband.cli_options import add_device_options, model_dtype
from fullband.data.config import DataConfig
from fullband.data.sources import synthetic_val_set
from fullband.errors import ConfigError, FullbandError
from fullband.generation import left_pad
from fullband.loading import load_model
from fullband.storage import ModelDir


@dataclass
class ProbeData:
    features: dict[str, list[torch.Tensor]]  # mode -> per layer (N, D)
    labels: np.ndarray  # (N,) class indices
    groups: np.ndarray  # (N,) sequence index of each target
    classes: list[str]


def grouped_folds(groups: np.ndarray, folds: int, seed: int) -> list[np.ndarray]:
    """Boolean test masks of ``folds`` folds; every sequence (group) lies in exactly one fold."""
    unique = np.unique(groups)
    if len(unique) < folds:
        raise FullbandError(f"{folds}-fold cross-validation needs at least {folds} sequences, got {len(unique)}")
    order = np.random.default_rng(seed).permutation(unique)
    fold_of = {g: i % folds for i, g in enumerate(order)}
    assignment = np.array([fold_of[g] for g in groups])
    return [assignment == f for f in range(folds)]


def fit_logistic(x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float = 1e-3, steps: int = 100) -> Any:
    """Multinomial logistic regression on standardised features (L-BFGS, L2 penalty); returns a predictor."""
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    weight = torch.zeros(x.shape[1], n_classes, dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(n_classes, dtype=x.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weight + bias, y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    weight, bias = weight.detach(), bias.detach()
    return lambda x_new: (((x_new - mean) / std) @ weight + bias).argmax(-1)


def probe_accuracy(features: torch.Tensor, labels: np.ndarray, groups: np.ndarray, n_classes: int,
                   folds: int = 4, seed: int = 0) -> tuple[float, float]:
    """(probe accuracy, majority-class rate), both pooled over the held-out folds of grouped CV."""
    x = features.double()
    y = torch.as_tensor(labels, dtype=torch.long)
    correct = majority = 0
    for test in grouped_folds(groups, folds, seed):
        train = torch.as_tensor(~test)
        test_t = torch.as_tensor(test)
        predict = fit_logistic(x[train], y[train], n_classes)
        correct += int((predict(x[test_t]) == y[test_t]).sum())
        most = int(torch.bincount(y[train], minlength=n_classes).argmax())
        majority += int((y[test_t] == most).sum())
    return correct / len(labels), majority / len(labels)


def _token_of_char(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and, per character, the index of the last token holding it."""
    ids, spans = tokenizer.encode_with_offsets(text)
    owner = [0] * len(text)
    for i, (start, end) in enumerate(spans):
        for c in range(start, end):
            owner[c] = i
    return ids, owner


def parse_probe_modes(text: str) -> list[tuple[str, int]]:
    """``standard,fused:1,fused:2`` -> [("standard", 0), ("fused:1", 1), ("fused:2", 2)]."""
    modes = []
    for item in (m.strip() for m in text.split(",") if m.strip()):
        name, _, n = item.partition(":")
        if item == "standard":
            modes.append(("standard", 0))
        elif name == "fused" and (n == "" or (n.isdigit() and int(n) >= 1)):
            modes.append((f"fused:{n or 1}", int(n or 1)))
        else:
            raise ConfigError(f"unknown probe mode {item!r}; modes are standard and fused:N (N >= 1)")
    if not modes:
        raise ConfigError("--modes is empty; give e.g. standard,fused:1")
    return list(dict.fromkeys(modes))


@torch.no_grad()
def layer_states(model: Any, ids: torch.Tensor, mask: torch.Tensor, fused_passes: int) -> list[torch.Tensor]:
    """The L + 1 per-layer states (B, T, D) of the last prefill pass (``fused_passes`` fused passes after
    the plain one): the inputs of the blocks, then the last block's output. Read with forward hooks, so the
    model code is untouched; every pass overwrites the record, leaving the last pass's states."""
    record: dict[int, torch.Tensor] = {}
    n = len(model.layers)
    hooks = [layer.register_forward_pre_hook(lambda _m, args, i=i: record.__setitem__(i, args[0]))
             for i, layer in enumerate(model.layers)]
    hooks.append(model.layers[-1].register_forward_hook(lambda _m, _a, out: record.__setitem__(n, out)))
    try:
        model.prefill(ids, fused_passes, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    return [record[i] for i in range(n + 1)]


def collect(model: Any, tokenizer: Any, task: Any, examples: Sequence[Any], modes: Sequence[tuple[str, int]],
            batch_size: int = 32) -> ProbeData:
    """Features at every target position of every example, per mode and layer."""
    rows, positions, labels, groups = [], [], [], []
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    for g, example in enumerate(examples):
        ids, owner = _token_of_char(tokenizer, example.prompt)
        targets = task.targets(example)
        if not targets:
            raise FullbandError(f"synthetic task {task.name!r} has no per-position targets to probe")
        rows.append(bos + list(ids))
        positions.append([len(bos) + owner[offset] for offset, _ in targets])
        labels += [label for _, label in targets]
        groups += [g] * len(targets)
    context = model.config.max_seq_len
    if max(len(r) for r in rows) > context:
        raise FullbandError(f"a prompt of {max(len(r) for r in rows)} tokens exceeds the model's context of {context} "
                            "tokens; choose shorter task options (e.g. max_len=...)")
    classes = sorted(set(labels))
    features: dict[str, list[list[torch.Tensor]]] = {m: [] for m, _ in modes}
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        ids, mask = left_pad(batch, pad_id=0)
        ids, mask = ids.to(model.device), mask.to(model.device)
        width = ids.shape[1]
        # Row b of the left-padded batch holds its token j at column width - len(row) + j.
        columns = [[width - len(r) + p for p in pos] for r, pos in zip(batch, positions[start : start + batch_size])]
        for label, passes in modes:
            states = layer_states(model, ids, mask, passes)
            features[label].append([torch.cat([layer[b, cols] for b, cols in enumerate(columns)]) for layer in states])
    stacked = {m: [torch.cat([chunk[i] for chunk in chunks]).float().cpu() for i in range(len(chunks[0]))]
               for m, chunks in features.items()}
    index = {c: i for i, c in enumerate(classes)}
    return ProbeData(stacked, np.array([index[c] for c in labels]), np.array(groups), classes)


def run_probe(model: Any, tokenizer: Any, task: Any, examples: Sequence[Any], modes: Sequence[tuple[str, int]],
              out_dir: str | Path, folds: int = 4, seed: int = 0, plot: bool = True) -> dict:
    """Probe every layer in every mode; write probe.json, probe.md and probe.png to ``out_dir``."""
    data = collect(model, tokenizer, task, examples, modes)
    results: dict[str, Any] = {"task": task.name, "examples": len(examples), "targets": len(data.labels),
                               "classes": data.classes, "folds": folds, "modes": {}}
    for label, _ in modes:
        layers = []
        for x in data.features[label]:
            accuracy, majority = probe_accuracy(x, data.labels, data.groups, len(data.classes), folds, seed)
            layers.append({"accuracy": accuracy, "majority": majority})
        results["modes"][label] = layers
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "probe.md").write_text(format_table(results))
    if plot:
        plot_probe(results, out / "probe.png")
    return results


def format_table(results: dict) -> str:
    modes = list(results["modes"])
    majority = results["modes"][modes[0]][0]["majority"]
    lines = [f"# Linear probes: {results['task']}", "",
             f"{results['targets']} targets ({len(results['classes'])} classes) in {results['examples']} held-out "
             f"prompts; {results['folds']}-fold cross-validation grouped by prompt. Majority-class rate: "
             f"{majority:.3f}. Layer 0 is the input to the first block.", "",
             "| layer | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for layer in range(len(results["modes"][modes[0]])):
        lines.append(f"| {layer} | " + " | ".join(f"{results['modes'][m][layer]['accuracy']:.3f}" for m in modes)
                     + " |")
    return "\n".join(lines) + "\n"


def plot_probe(results: dict, path: Path) -> None:
    plt = pyplot(f"plots need matplotlib: {PLOT_EXTRA} (or pass --no-plot)")
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, layers in results["modes"].items():
        ax.plot(range(len(layers)), [x["accuracy"] for x in layers], marker="o", label=mode)
    majority = next(iter(results["modes"].values()))[0]["majority"]
    ax.axhline(majority, color="gray", linestyle="--", label="majority class")
    ax.set_xticks(range(len(next(iter(results["modes"].values())))))
    ax.set_xlabel("layer (0 = input to the first block)")
    ax.set_ylabel(f"probe accuracy (grouped {results['folds']}-fold CV)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Linear probes: {results['task']}")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path, 110)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("probe", help="linear probes of a synthetic task's state per layer and decode mode")
    p.add_argument("model", help="run directory, checkpoint or model directory")
    p.add_argument("--task", required=True, help="synthetic:<name>[:opts] with per-position targets, e.g. "
                   "synthetic:parity, synthetic:delayed, synthetic:completion, synthetic:registers")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--modes", default="standard,fused:1", help="standard and fused:N (default: standard,fused:1)")
    p.add_argument("--examples", type=int, default=200, help="held-out prompts to probe (default: 200)")
    p.add_argument("--folds", type=int, default=4, help="cross-validation folds (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="fold assignment seed (default: 0)")
    p.add_argument("--data-seed", type=int, help="data.seed of the held-out split (default: the run's, else 0)")
    add_device_options(p)
    p.add_argument("--no-plot", action="store_true", help="skip probe.png")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> None:
    if not args.task.startswith("synthetic:"):
        raise ConfigError(f"probe needs a synthetic task (synthetic:<name>[:opts]), got {args.task!r}")
    if args.examples < args.folds or args.folds < 2:
        raise ConfigError(f"need --folds >= 2 and --examples >= --folds, got {args.folds} and {args.examples}")
    modes = parse_probe_modes(args.modes)
    model_dir = ModelDir.open(args.model)
    model, tokenizer = load_model(model_dir, args.device, model_dtype(args))
    refuse_arch(model, "fullband probe")  # it reads the transformer's layers and fused passes
    recorded = run_data_settings(model_dir.run)
    seed = args.data_seed if args.data_seed is not None else recorded.get("seed", 0)
    n = max(args.examples, recorded.get("synthetic_val_examples", 0))
    task, examples = synthetic_val_set(DataConfig(source=args.task, seed=seed, synthetic_val_examples=n))
    results = run_probe(model, tokenizer, task, examples[: args.examples], modes, args.out, args.folds, args.seed,
                        plot=not args.no_plot)
    print(format_table(results))
