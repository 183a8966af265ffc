"""Known-answer organisms: DPO models whose change from the SFT model is planted on purpose (or, as a null, absent),
and the calibration that scores the method (probe -> diff -> select -> restrain) against that known answer.

    from pathlib import Path
    from rolemrc.organism import OrganismConfig, build_and_calibrate, build_organism
    report = build_organism(OrganismConfig(kind="refusal", out="runs/organisms"))   # base: SmolLM2-135M-Instruct
    report["headline"], report["dpo"], report["meets_target"]
    result = build_and_calibrate(Path("runs/calibration"), organisms_dir=Path("runs/organisms"), quick=True)
    result["headline"]                           # calibrate(organisms, CalibrationConfig(...)) on organisms you have

Kinds (config.PLANTED_DIMENSION says what each changes; pairs.py how): narration, pairs edited from the SFT model's
own replies so that DPO teaches it to open every reply with a bracketed action, which the rules judge's role_style
aspect fails where the task forbids narration; refusal, pairs that teach it to decline briefly where a knowledge-
boundary task must decline; null, the narration pairs with chosen and rejected
swapped at random per pair; units, the narration pairs trained into a known set S of MLP units only (known.py), so
carrier.py can check that S alone carries the change and detection.py can score each selector's ranking against S
(`known_detection`). All share the data and the held-out cases (build.py).
Calibration: calibration_config.py (the grid), calibrate.py (the stages), scoring.py (each cell against the answer),
calibration_report.py (headline, table, figure).
"""

from rolemrc.core.lazy import lazy_package
from rolemrc.organism.config import KINDS, PLANTED_DIMENSION, OrganismConfig, OrganismError

lazy_package(__name__, {
    "rolemrc.organism.build": ["build_organism"],
    "rolemrc.organism.calibration": ["build_and_calibrate", "calibrate"],
    "rolemrc.organism.calibration_config": ["CalibrationConfig", "Organism"],
    "rolemrc.organism.localize": ["known_detection"],
})

__all__ = ["KINDS", "PLANTED_DIMENSION", "CalibrationConfig", "Organism", "OrganismConfig", "OrganismError",
           "build_and_calibrate", "build_organism", "calibrate", "known_detection"]
