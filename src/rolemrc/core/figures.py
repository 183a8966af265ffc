"""Writing Plotly figures as HTML and, where kaleido (the `png` extra) finds Chromium, as PNG. `ROLEMRC_PNG=0`
writes the HTML alone: each process that exports starts a Chromium (about 5 CPU-seconds), which a job on a
headless node or in CI may not want."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolemrc.core.extras import missing

log = logging.getLogger(__name__)

PNG_HINT = " (PNG export needs Chromium: apt-get install -y chromium)"


def write_figures(figures: Mapping[str, Any], out: Path, *, plotlyjs: bool | str = "directory",
                  width: int | None = 1100, height: int | None = 650) -> dict[str, dict[str, str]]:
    """Write each figure (stem -> Plotly figure) as `out/stem.html` and `out/stem.png`; the process's first export
    starts a Chromium of its own, and every later one uses one kept Chromium (`keep_chromium`); returns
    stem -> {"html": path, "png": path} ({"html": path} where `png_wanted()` is False).

    `plotlyjs`: "directory" shares one plotly.min.js beside the pages of a folder, True embeds it in each page.
    `width`/`height`: the PNGs' size in pixels; None takes each figure's layout size (else Plotly's 700 x 500).
    PNGs that cannot be made (kaleido raises several types when Chromium is missing or fails to start) are logged
    and reported under "png_error" (the error's first line and how to install Chromium), never raised."""
    global _EXPORTED_BY
    written = {}
    for stem, fig in figures.items():
        html = out / f"{stem}.html"
        fig.write_html(str(html), include_plotlyjs=plotlyjs, full_html=True)
        written[stem] = {"html": str(html)}
    if not png_wanted():
        return written
    pngs = {stem: out / f"{stem}.png" for stem in figures}
    try:
        import plotly.io as pio

        if os.getpid() == _EXPORTED_BY:   # a second export: Chromium is known to start here, keep one for the rest
            try:
                keep_chromium()
            except Exception as exc:   # this export starts its own Chromium, as the first did
                log.debug("kaleido's server did not start (%s)", exc)
        with _EXPORTING, warnings.catch_warnings():   # the kept server answers one caller at a time; it took
            warnings.filterwarnings("ignore", "The kopts argument is ignored", UserWarning)   # the headers at start
            pio.write_images(list(figures.values()), [str(p) for p in pngs.values()],   # per figure: kaleido's batch
                             width=[width or fig.layout.width for fig in figures.values()],   # ignores the layout's size
                             height=[height or fig.layout.height for fig in figures.values()])
    except Exception as exc:
        hint = " (PNG export needs kaleido: pip install 'rolemrc[png]')" if missing("png") else PNG_HINT
        log.warning("PNG export of %s failed (%s)%s", ", ".join(figures), exc, hint)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        error = f"{type(exc).__name__}: {first}{hint}"
        return {stem: paths | {"png_error": error} for stem, paths in written.items()}
    _EXPORTED_BY = os.getpid()
    return {stem: paths | {"png": str(pngs[stem])} for stem, paths in written.items()}


def png_wanted() -> bool:
    """False where `ROLEMRC_PNG` is 0, false, no or off: figures are written as HTML alone."""
    return os.environ.get("ROLEMRC_PNG", "1").strip().lower() not in ("0", "false", "no", "off")


_EXPORTED_BY: int | None = None        # the process that has exported a PNG (a forked child has not)
_CHROMIUM_KEPT_BY: int | None = None   # the process that started kaleido's server
_EXPORTING = threading.Lock()


def keep_chromium() -> None:
    """Keep kaleido's server and its one Chromium for this process's exports: a start costs ~2 s, each image on a
    kept one ~0.15 s. Called once a first export has shown that Chromium starts (a server whose Chromium cannot start
    would hang its callers); a process that exports once starts one Chromium, not two. A forked child forgets the
    parent's server (its thread is not in the child) and exports as the parent first did."""
    global _CHROMIUM_KEPT_BY
    if os.getpid() == _CHROMIUM_KEPT_BY:
        return
    import kaleido
    import plotly.io as pio
    from kaleido._sync_server import GlobalKaleidoServer

    if _CHROMIUM_KEPT_BY is None:
        os.register_at_fork(after_in_child=lambda: setattr(GlobalKaleidoServer(), "_initialized", False))
    kaleido.start_sync_server(headers=pio.defaults.headers, silence_warnings=True)
    _CHROMIUM_KEPT_BY = os.getpid()


def write_figure(fig: Any, out: Path, stem: str, **options: Any) -> dict[str, str]:
    """`write_figures` of one figure: {"html": path, "png": path} (or "png_error")."""
    return write_figures({stem: fig}, out, **options)[stem]
