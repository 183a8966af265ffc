"""`python -m rolemrc.serve --config serve.yaml`: the same as `rolemrc serve`, with the same error convention (one
`error:` line, exit 2, for bad input), built from serve's own CLI so serve imports nothing above it."""

import sys

from rolemrc.core.cli import cli_app
from rolemrc.serve.cli import register

if __name__ == "__main__":
    app = cli_app(help="rolemrc serve")
    app.callback()(lambda: None)   # a group (which reports errors), not typer's single-command app
    register(app)
    app(args=["serve", *sys.argv[1:]], prog_name="rolemrc")
