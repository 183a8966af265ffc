import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import corpus, test_records

from rolemrc.core.tiny import build_model, train_tokenizer

ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(corpus(), vocab_size=400)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """arch -> directory of a saved tiny model (2 layers, hidden 64) with its tokenizer."""
    dirs = {}
    for seed, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model = build_model(arch, tokenizer, seed=seed, hidden=64, layers=2, intermediate=96)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="session")
def records():
    return test_records(40)
