"""A/B experiments over `rolemrc serve`: the server assigns arms and logs each request (serve/store/); this package
creates experiments and scores them, outside the serving process.

    from rolemrc.ab import build_report, experiment_from_sweep
    from rolemrc.serve.store import Store
    created = experiment_from_sweep("runs/sweep", "best:2", "http://localhost:8000/v1")   # cells -> arms
    ...   # traffic with `experiment` set; the server logs every request to its `db`
    report = build_report(Store.open("ab.sqlite"), created["experiment"]["id"])                # over the request log

from_sweep: a finished sweep's best cells as a served experiment (HTTP only); report: per-arm judge and reference
scores, operational stats and per-user tests of each arm against the first, read from the request log (SQLite or PostgreSQL).
"""

from rolemrc.core.lazy import lazy_package

lazy_package(__name__, {"rolemrc.ab.report": ["build_report", "report_html", "UnknownExperimentError"],
                        "rolemrc.ab.from_sweep": ["experiment_from_sweep"]})

__all__ = ["UnknownExperimentError", "build_report", "experiment_from_sweep", "report_html"]
