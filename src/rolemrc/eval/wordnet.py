"""Offline WordNet for nltk's METEOR, assembled from Debian's `wordnet-base` + `wordnet-sense-index`.

nltk wants `<nltk_data>/corpora/wordnet/` with the WordNet 3.0 database files plus a `lexnames`
file that Debian does not ship; we copy the files (36 MB, once) into a cache folder, since nltk
refuses symlinks and hard links (they could leave its root), and write `lexnames` (the 45 names of `man 5 lexnames`).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

from rolemrc.core.io import cache_dir
from rolemrc.eval.errors import MetricUnavailable

DEBIAN_WORDNET = Path("/usr/share/wordnet")
NEEDED = ("data.noun", "data.verb", "data.adj", "data.adv", "index.noun", "index.verb", "index.adj", "index.adv",
          "noun.exc", "verb.exc", "adj.exc", "adv.exc", "index.sense")
LEXNAMES = ["adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact", "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object", "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion", "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl"]
FILENUM = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


class WordNetMissing(MetricUnavailable):
    """WordNet is not installed, so METEOR cannot be computed."""


def lexnames_text() -> str:
    return "".join(f"{i:02d}\t{name}\t{FILENUM[name.split('.')[0]]}\n" for i, name in enumerate(LEXNAMES))


def ensure_wordnet(source: Path | None = None, nltk_data: Path | None = None) -> Path:
    """Build (once) an nltk_data folder with WordNet from `source` (default $ROLEMRC_WORDNET or
    /usr/share/wordnet), put it on nltk's path, return it."""
    import nltk

    source = Path(source or os.environ.get("ROLEMRC_WORDNET") or DEBIAN_WORDNET)
    missing = [name for name in NEEDED if not (source / name).is_file()]
    if missing:
        raise WordNetMissing(
            f"WordNet not found in {source} (missing {', '.join(missing)}); METEOR needs it. Install it offline with "
            "`apt-get install -y wordnet-base wordnet-sense-index` (scripts/system-deps.sh does this)")
    nltk_data = Path(nltk_data or cache_dir() / "nltk_data")
    target = nltk_data / "corpora" / "wordnet"
    target.mkdir(parents=True, exist_ok=True)
    for name in NEEDED:
        copy = target / name
        if not copy.is_file() or copy.stat().st_size != (source / name).stat().st_size:
            tmp = copy.with_suffix(copy.suffix + ".tmp")
            tmp.unlink(missing_ok=True)
            shutil.copyfile(source / name, tmp)
            os.replace(tmp, copy)
    lexnames = target / "lexnames"
    if not lexnames.is_file() or lexnames.read_text() != lexnames_text():
        lexnames.write_text(lexnames_text())
    if str(nltk_data) not in nltk.data.path:
        nltk.data.path.insert(0, str(nltk_data))
    return nltk_data



def wordnet_reader() -> Any:
    """nltk's WordNet reader on the corpus `ensure_wordnet` builds (checked on each call), loaded once per process,
    without the map from another WordNet version to this one that nltk's reader makes on every load (it reads
    index.sense twice to map 3.0 onto itself: over half the load's time). METEOR's synonym matches use no such map."""
    return _reader(str(ensure_wordnet() / "corpora" / "wordnet"))


@functools.cache
def _reader(root: str) -> Any:
    import warnings

    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class WordNet30(WordNetCorpusReader):
        def map_wn(self, version: str = "wordnet") -> None:
            return None

    with warnings.catch_warnings():   # "the multilingual functions are not available": METEOR uses none
        warnings.simplefilter("ignore", UserWarning)
        return WordNet30(root, None)
