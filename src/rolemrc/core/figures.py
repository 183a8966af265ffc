"""Writing Plotly figures as HTML and, where kaleido (the `png` extra) finds Chromium, as PNG."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolemrc.core.extras import missing

log = logging.getLogger(__name__)

PNG_HINT = " (PNG export needs Chromium: apt-get install -y chromium)"


def write_figures(figures: Mapping[str, Any], out: Path, *, plotlyjs: bool | str = "directory",
                  width: int | None = 1100, height: int | None = 650) -> dict[str, dict[str, str]]:
    """Write each figure (stem -> Plotly figure) as `out/stem.html` and `out/stem.png`, every PNG in one Chromium
    session (a session's start costs ~1.7 s, each further image ~0.15 s); returns stem -> {"html": path, "png": path}.

    `plotlyjs`: "directory" shares one plotly.min.js beside the pages of a folder, True embeds it in each page.
    `width`/`height`: the PNGs' size in pixels; None takes each figure's layout size (else Plotly's 700 x 500).
    PNGs that cannot be made (kaleido raises several types when Chromium is missing or fails to start) are logged
    and reported under "png_error" (the error's first line and how to install Chromium), never raised."""
    written = {}
    for stem, fig in figures.items():
        html = out / f"{stem}.html"
        fig.write_html(str(html), include_plotlyjs=plotlyjs, full_html=True)
        written[stem] = {"html": str(html)}
    pngs = {stem: out / f"{stem}.png" for stem in figures}
    try:
        import plotly.io as pio

        pio.write_images(list(figures.values()), [str(p) for p in pngs.values()],   # per figure: kaleido's batch
                         width=[width or fig.layout.width for fig in figures.values()],   # ignores the layout's size
                         height=[height or fig.layout.height for fig in figures.values()])
    except Exception as exc:
        hint = " (PNG export needs kaleido: pip install 'rolemrc[png]')" if missing("png") else PNG_HINT
        log.warning("PNG export of %s failed (%s)%s", ", ".join(figures), exc, hint)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        error = f"{type(exc).__name__}: {first}{hint}"
        return {stem: paths | {"png_error": error} for stem, paths in written.items()}
    return {stem: paths | {"png": str(pngs[stem])} for stem, paths in written.items()}


def write_figure(fig: Any, out: Path, stem: str, **options: Any) -> dict[str, str]:
    """`write_figures` of one figure: {"html": path, "png": path} (or "png_error")."""
    return write_figures({stem: fig}, out, **options)[stem]
