"""The scenarios' plots: matplotlib on its file-only backend, and one way to write a figure.

Every scenario draws through `pyplot()` and writes through `save()`, so none picks a backend,
lays out or closes a figure on its own; `save_results()` writes a scenario's JSON and plot pair.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


def save_results(out: str | Path, name: str, results: dict, plot: Callable[[Path], None]) -> None:
    """out/NAME.json with the results, out/NAME.png drawn by `plot(path)`, and a line saying so."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, png_path = folder / f"{name}.json", folder / f"{name}.png"
    json_path.write_text(json.dumps(results, indent=2))
    plot(png_path)
    print(f"\nwrote {json_path} and {png_path}")
