"""accuracy.png and lengths.png: per task, accuracy and median generated length against temperature,
one line per decode mode, 95% bootstrap intervals as error bars, the best temperature of each mode
circled. Also the matplotlib loading and figure saving that every fullband plot shares."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from fullband.errors import FullbandError

PLOT_EXTRA = "pip install 'fullband[plot]'"


def pyplot(missing: str, required: bool = True) -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend. matplotlib is an optional extra: where it is not
    installed, ``missing`` is the error raised or, if not ``required``, printed before None is returned."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if required:
            raise FullbandError(missing) from None
        print(missing, file=sys.stderr)
        return None
    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """Lay out, write and close ``fig`` (made with ``pyplot()``); returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _figure(results: dict, out: Path, value: str, ci: str, ylabel: str, title: str) -> None:
    plt = pyplot(f"plots need matplotlib: {PLOT_EXTRA} (or pass --no-plots)")
    tasks = list(results)
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(7, 5 * len(tasks)), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        modes = results[task]
        for i, (mode, temps) in enumerate(modes.items()):
            ts = sorted(temps, key=float)
            # Modes often tie (e.g. all at 0); a small sideways offset keeps every line visible.
            x = [float(t) + 0.01 * (i - (len(modes) - 1) / 2) for t in ts]
            y = [temps[t][value] for t in ts]
            lo = [temps[t][value] - temps[t][ci][0] for t in ts]
            hi = [temps[t][ci][1] - temps[t][value] for t in ts]
            line = ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=mode)
            best = [i for i, t in enumerate(ts) if temps[t]["best"]]
            ax.scatter([x[i] for i in best], [y[i] for i in best], s=160, facecolors="none",
                       edgecolors=line[0].get_color(), linewidths=2)
        if value == "accuracy":
            ax.set_ylim(-0.03, 1.03)
        ax.set_title(task)
        ax.set_xlabel("temperature")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, out, 110)


def plot_results(results: dict, out_dir: Path) -> None:
    _figure(results, out_dir / "accuracy.png", "accuracy", "accuracy_ci", "accuracy (pass@1)",
            "Accuracy per decode mode (circled: best temperature of each mode)")
    _figure(results, out_dir / "lengths.png", "median_length", "median_length_ci", "median generated tokens",
            "Generated length per decode mode (circled: best-accuracy temperature)")
