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
def peaked_model(tmp_path_factory, tokenizer):
    """A random Llama with head dim 32 (vLLM's CPU attention needs 32 or 64) and a scaled-up output head, so
    greedy choices have clear margins and batching noise cannot flip them."""
    import torch

    path = tmp_path_factory.mktemp("peaked-model")
    model = build_model("llama", tokenizer, seed=3, hidden=64, layers=2, intermediate=96, heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def eos_split_prompts(peaked_model, tokenizer):
    """Token-id prompts for log-likelihood requests on `peaked_model`: two whose greedy next token is EOS and two
    whose is not (found by one batched forward over random prompts)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()
    ids = torch.randint(10, len(tokenizer), (2000, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eos = model(input_ids=ids).logits[:, -1].argmax(-1) == tokenizer.eos_token_id
    assert int(eos.sum()) >= 2
    return {"eos": ids[eos][:2].tolist(), "other": ids[~eos][:2].tolist()}


@pytest.fixture(scope="session")
def records():
    return test_records(40)
