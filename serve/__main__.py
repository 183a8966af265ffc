"""`python -m rolemrc.serve --config serve.yaml`: the same as `rolemrc serve`, run by the `rolemrc` command (so
errors are reported its way)."""

import sys

from rolemrc.cli import app

if __name__ == "__main__":
    app(args=["serve", *sys.argv[1:]], prog_name="rolemrc")
