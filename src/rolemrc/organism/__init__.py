"""Known-answer organisms: DPO models whose change from the SFT model is planted on purpose (or, as a null, absent),
so the method (probe -> diff -> select -> restrain) can be scored against the right answer.

    from rolemrc.organism import OrganismConfig, build_organism
    report = build_organism(OrganismConfig(kind="planted", out="runs/organisms"))   # base: SmolLM2-135M-Instruct
    report["headline"], report["dpo"], report["meets_target"]

planted: pairs edited from the SFT model's own replies so that DPO teaches it to open every reply with a bracketed
action, which the rules judge's role_style aspect fails where the task forbids narration (pairs.py). null: the same
pairs with chosen and rejected swapped at random per pair. Both share the data, replies and held-out cases (build.py).
"""

from rolemrc.core.lazy import lazy_package
from rolemrc.organism.config import KINDS, PLANTED_DIMENSION, OrganismConfig, OrganismError

lazy_package(__name__, {"rolemrc.organism.build": ["build_organism"]})

__all__ = ["KINDS", "PLANTED_DIMENSION", "OrganismConfig", "OrganismError", "build_organism"]
