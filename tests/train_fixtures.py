"""Small SFT / preference / profile records for the train tests (RoleMRC release shapes)."""

from __future__ import annotations

import random

from fixtures import WORDS

PERSONAS = ("lighthouse keeper", "baker", "librarian", "train driver")


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def sft_records(n: int = 24, seed: int = 0, capitalised: bool = True) -> list[dict]:
    """Conversations with one or two exchanges; replies follow a persona-specific pattern."""
    rng = random.Random(seed)
    role = (lambda r: r.capitalize()) if capitalised else (lambda r: r)
    out = []
    for i in range(n):
        persona = PERSONAS[i % len(PERSONAS)]
        turns = [{"role": role("system"), "content": f"You are a {persona}. {_words(rng, 3, 8)}"}]
        for _ in range(rng.randint(1, 2)):
            turns.append({"role": role("user"), "content": _words(rng, 3, 12) + "?"})
            turns.append({"role": role("assistant"), "content": f"as a {persona} i say {_words(rng, 2, 6)}"})
        out.append({"id": f"s{i}", "conversations": turns, "task": "free_chat"})
    return out


def pair_records(n: int = 24, seed: int = 1) -> list[dict]:
    """Pairs whose chosen reply stays in character and whose rejected reply is a refusal."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        persona = PERSONAS[i % len(PERSONAS)]
        prompt = [{"role": "system", "content": f"You are a {persona}."},
                  {"role": "user", "content": _words(rng, 3, 10) + "?"}]
        out.append({"id": f"p{i}", "prompt": prompt, "chosen": f"as a {persona} i say {_words(rng, 2, 5)}",
                    "rejected": "sorry i cannot answer that", "task": "role_related_mrc_answer_no_narration"})
    return out


def profile_records(n: int = 4) -> list[dict]:
    return [{"id": f"r{i}", "persona": p, "name": f"N{i}", "components": {}, "text": f"The {p} lives by the sea."}
            for i, p in enumerate(PERSONAS[:n])]


# Trainer arguments the bundled profiles resolved to before trainer arguments moved under `trl:` (written down
# from the old code with no GPU and no WORLD_SIZE; output_dir for out="o"). Since then: gradient checkpointing is
# rolemrc's own setting (derived for sft and dpo, left to transformers' default for base) and bf16 autocast on a
# CPU tells the trainer to use it (use_cpu).
_SHARED = {"dataloader_num_workers": 0, "dataloader_pin_memory": False, "disable_tqdm": False,
           "logging_first_step": True, "max_grad_norm": 1.0, "output_dir": "o/checkpoints", "report_to": [],
           "save_strategy": "steps", "save_total_limit": 2, "seed": 0, "use_cpu": False, "max_steps": -1, "weight_decay": 0.0}
_PAPER = {**_SHARED, "bf16": True, "use_cpu": True, "gradient_accumulation_steps": 16, "gradient_checkpointing": True,
          "logging_steps": 10, "max_length": 4096, "num_train_epochs": 1.0, "per_device_train_batch_size": 4,
          "save_steps": 500}
_TINY = {**_SHARED, "bf16": False, "gradient_accumulation_steps": 1, "gradient_checkpointing": False,
         "logging_steps": 5, "save_steps": 100, "per_device_train_batch_size": 8, "num_train_epochs": 1.0}
_TINY_BASE = {k: v for k, v in _TINY.items() if k != "gradient_checkpointing"}
PROFILE_ARGUMENTS_BEFORE = {
    "paper/sft": {**_PAPER, "assistant_only_loss": True, "packing": False, "learning_rate": 2e-05,
                  "lr_scheduler_type": "cosine", "warmup_steps": 0.04},
    "paper/dpo": {**_PAPER, "beta": 0.1, "learning_rate": 4e-07, "lr_scheduler_type": "linear", "warmup_steps": 0.1},
    "tiny/base": {**_TINY_BASE, "learning_rate": 0.003, "lr_scheduler_type": "cosine",
                  "num_train_epochs": 2.0, "per_device_train_batch_size": 16, "warmup_steps": 0.05,
                  "weight_decay": 0.01},
    "tiny/sft": {**_TINY, "assistant_only_loss": True, "packing": False, "learning_rate": 0.0005,
                 "lr_scheduler_type": "cosine", "max_length": 1024, "warmup_steps": 0.04},
    "tiny/dpo": {**_TINY, "beta": 0.1, "learning_rate": 5e-05, "lr_scheduler_type": "linear", "max_length": 1024,
                 "max_steps": 24, "warmup_steps": 0.1},
}
