"""`python -m rolemrc.serve --config serve.yaml`: the same as `rolemrc serve`."""

import typer

from rolemrc.serve.cli import register

app = typer.Typer(add_completion=False)
register(app)

if __name__ == "__main__":
    app()
