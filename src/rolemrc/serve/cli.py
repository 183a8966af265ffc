"""`rolemrc serve --config serve.yaml [--host --port --engine]`."""

from __future__ import annotations

from pathlib import Path

import typer

from rolemrc.core.extras import needs
from rolemrc.serve.engines import EngineName


def register(app: typer.Typer) -> None:
    @app.command("serve")
    @needs("serve")
    def serve_cmd(
        config: Path = typer.Option(..., "--config", "-c", help="serve YAML (models, restraints, limits, keys, db)"),
        host: str = typer.Option(None, help="bind address (default: the config's, 127.0.0.1)"),
        port: int = typer.Option(None, help="port (default: the config's, 8000)"),
        engine: EngineName = typer.Option(None, help="override every model's engine"),
        socket_fd: int = typer.Option(None, hidden=True, help="an inherited socket already bound to --host/--port (a "
                                                             "launcher's, `serve.launch`), listened on once the "
                                                             "engines are up"),
    ) -> None:
        """Serve models over an OpenAI-compatible API with restraints and A/B experiments."""
        from rolemrc.serve.config import ServeConfig

        checked = ServeConfig.load(config, engine.value if engine else None)
        host = host or checked.host
        keys = checked.check_auth(host)
        checked.preflight()   # every config error before the server's imports (torch, the engines): in a blink
        from rolemrc.serve.server import serve

        serve(checked, keys, host, port, socket_fd)
