"""Writing a Plotly figure as HTML and, where kaleido (the `png` extra) finds Chromium, as PNG."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rolemrc.core.extras import missing

log = logging.getLogger(__name__)

PNG_HINT = " (PNG export needs Chromium: apt-get install -y chromium)"


def write_figure(fig: Any, out: Path, stem: str, *, plotlyjs: bool | str = "directory", width: int | None = 1100,
                 height: int | None = 650) -> dict[str, str]:
    """Write `out/stem.html` and `out/stem.png`; returns {"html": path, "png": path}.

    `plotlyjs`: "directory" shares one plotly.min.js beside the pages of a folder, True embeds it in the page.
    `width`/`height`: the PNG's size in pixels; None takes the figure's layout size (else Plotly's 700 x 500).
    A PNG that cannot be made (kaleido raises several types when Chromium is missing or fails to start) is logged
    and reported under "png_error" (the error's first line and how to install Chromium), never raised."""
    html, png = out / f"{stem}.html", out / f"{stem}.png"
    fig.write_html(str(html), include_plotlyjs=plotlyjs, full_html=True)
    written = {"html": str(html)}
    try:
        fig.write_image(str(png), width=width, height=height)
        written["png"] = str(png)
    except Exception as exc:
        hint = " (PNG export needs kaleido: pip install 'rolemrc[png]')" if missing("png") else PNG_HINT
        log.warning("PNG export of %s failed (%s)%s", stem, exc, hint)
        written["png_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0] + hint
    return written
