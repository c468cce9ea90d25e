"""The plotting every experiment's table shares: matplotlib is an optional extra (`fullband[plot]`), so a table
prints without it and says why there is no plot."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (with a message) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fullband[plot]')", file=sys.stderr)
        return None
    return plt


def save(fig, out: Path, dpi: int) -> Path:
    """Lay out, write and close `fig`; returns `out`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
