"""The scenarios' plots: matplotlib on its file-only backend, and one way to write a figure.

Every scenario draws through `pyplot()` and writes through `save()`, so none picks a backend,
lays out or closes a figure on its own.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend: scenarios run on servers with no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, dpi: int = 110) -> None:
    """Lay out `fig`, write it to `path` and free it (a scenario may draw many in one process)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
