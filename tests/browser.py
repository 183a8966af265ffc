"""Headless Debian Chromium driven by Playwright (no browser download: uses /usr/bin/chromium)."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-quic"]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("Debian chromium is required for page tests (scripts/system-deps.sh installs it)")
    return path


@contextmanager
def chromium():
    """Yield one headless Chromium (a Playwright browser context) for the pages of a module: a launch costs ~2 s."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        context = pw.chromium.launch_persistent_context(profile, executable_path=chromium_path(), headless=True,
                                                        args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


@contextmanager
def browser_page(context):
    """Yield (page, errors), a fresh page of `context` (`chromium()`); errors collects console errors and uncaught
    page exceptions."""
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page, errors
    finally:
        page.close()
