import json

import pytest
import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.io import JsonlError, read_jsonl, write_jsonl
from rolemrc.core.modeling import context_window, dir_fingerprint, load_model, model_fingerprint
from rolemrc.core.records import RecordError, normalize_turns, prompt_turns
from rolemrc.core.taxonomy import TASK_COUNTS, TASKS, dimensions_for_task, judge_aspects_for_task


def test_taxonomy_matches_published_histogram():
    assert len(TASKS) == 18 and sum(TASK_COUNTS.values()) == 1400
    calls: dict[str, int] = {}
    for task, n in TASK_COUNTS.items():
        for aspect in judge_aspects_for_task(task):
            calls[aspect.dimension] = calls.get(aspect.dimension, 0) + n
    assert calls == {"knowledge_boundary": 600, "role_style": 400, "nested": 158, "multi_turn": 400, "prioritized": 42}
    assert dimensions_for_task("role_related_mrc_answer_with_narration") == ("knowledge_boundary", "role_style")
    assert dimensions_for_task("role_unrelated_mrc_refused_no_narration-2ndanswer") == ("multi_turn",)
    assert dimensions_for_task("role_unrelated_mrc_answer_no_narration-2ndanswer") == ()  # not a published variant
    assert dimensions_for_task("free_chat") == () and dimensions_for_task(None) == ()


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(JsonlError, match=r"x.jsonl:3: invalid JSON"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(JsonlError, match=r"x.jsonl:2: expected a JSON object"):
        read_jsonl(path)
    with pytest.raises(JsonlError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl")
    assert write_jsonl(path, [{"a": 1}, {"b": "é"}]) == 2
    assert read_jsonl(path) == [{"a": 1}, {"b": "é"}]


def test_turns_normalised_and_checked():
    turns = normalize_turns([{"role": "System", "content": "s"}, {"role": "User", "content": "u"}])
    assert [t["role"] for t in turns] == ["system", "user"]
    with pytest.raises(RecordError, match="unknown role"):
        normalize_turns([{"role": "narrator", "content": "x"}])
    sft = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert prompt_turns(sft) == [{"role": "user", "content": "q"}]
    with pytest.raises(RecordError, match="no 'question'"):
        prompt_turns({"id": 1})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_fixture_models_load_and_chat(model_dirs, arch):
    model, tok = load_model(model_dirs[arch], dtype="float32", device="cpu")
    text = render_chat(tok, [{"role": "user", "content": "hello"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()
    assert dir_fingerprint(model_dirs[arch]) == dir_fingerprint(model_dirs[arch])
    assert len(model_fingerprint(model)) == 16


def test_load_model_rejects_non_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        load_model(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(FileNotFoundError, match=r"a PEFT adapter folder, not a model; merge it .*merge_and_unload\(\)"):
        load_model(tmp_path)


def test_checkpoint_dtype_is_what_auto_means_for_weights(tmp_path):
    from rolemrc.core.modeling import checkpoint_dtype

    for config, expected in (({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                             ({}, "float32"), ({"dtype": "int8"}, "float32")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert checkpoint_dtype(tmp_path) == expected, config


def test_context_window_fallback_order():
    from types import SimpleNamespace as NS

    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    from rolemrc.core.tiny import tiny_config

    assert context_window(tiny_config("llama", 300, max_positions=512)) == 512
    assert context_window(NS(config=tiny_config("gpt2", 300, max_positions=256))) == 256   # a model: its config
    assert context_window(NS(n_positions=128), NS(model_max_length=64)) == 128
    assert context_window(NS(), NS(model_max_length=64)) == 64
    assert context_window(NS(), NS(model_max_length=VERY_LARGE_INTEGER)) is None   # transformers' "unknown"
    assert context_window(NS(), default=2048) == 2048


MISSING_BROWSER = """
import json, logging, sys
from pathlib import Path
import plotly.graph_objects as go
from rolemrc.core.figures import write_figures
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s")
figures = {f"f{k}": go.Figure(go.Heatmap(z=[[k, 1], [2, 3]])) for k in range(3)}
print(json.dumps(write_figures(figures, Path(sys.argv[1]), width=200, height=150)))
"""


def test_figures_keep_one_chromium_and_report_a_missing_browser(tmp_path, monkeypatch):
    """A process's first export starts a Chromium of its own, and every later one comes from one kept Chromium
    (kaleido's server; a forked child starts its own). On a machine without a browser (a fresh process) every figure
    keeps its HTML and says why it has no PNG, in one logged warning, and nothing raises."""
    import os
    import subprocess
    import sys

    import plotly.graph_objects as go
    from kaleido._sync_server import GlobalKaleidoServer

    from rolemrc.core import figures as module
    from rolemrc.core.figures import write_figures

    monkeypatch.setenv("ROLEMRC_PNG", "1")
    figures = {f"f{k}": go.Figure(go.Heatmap(z=[[k, 1], [2, 3]])) for k in range(3)}
    exported = os.getpid() == module._EXPORTED_BY   # by an earlier test of this worker
    for round_ in ("first", "second"):
        (tmp_path / round_).mkdir()
        written = write_figures(figures, tmp_path / round_, width=200, height=150)
        for stem, paths in written.items():
            assert (tmp_path / round_ / f"{stem}.html").is_file()
            assert (tmp_path / round_ / f"{stem}.png").read_bytes().startswith(b"\x89PNG"), paths
        assert GlobalKaleidoServer().is_running() == (exported or round_ == "second"), round_
    child = os.fork()
    if not child:   # the parent's server thread is not here: the child must not queue work for it
        os._exit(0 if not GlobalKaleidoServer().is_running() else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    (tmp_path / "none").mkdir()
    done = subprocess.run([sys.executable, "-c", MISSING_BROWSER, str(tmp_path / "none")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "BROWSER_PATH": str(tmp_path / "no-browser")})
    assert done.returncode == 0, done.stderr[-2000:]
    missing = json.loads(done.stdout)
    assert all(paths["png_error"].endswith("(PNG export needs Chromium: apt-get install -y chromium)")
               for paths in missing.values()), missing
    assert [line for line in done.stderr.splitlines() if line.startswith("rolemrc.core.figures")] == [
        "rolemrc.core.figures WARNING"]


@pytest.mark.parametrize("setting", ["0", "off", "False"])
def test_rolemrc_png_off_writes_the_html_alone(tmp_path, monkeypatch, setting):
    import plotly.graph_objects as go

    from rolemrc.core.figures import write_figures

    monkeypatch.setenv("ROLEMRC_PNG", setting)
    written = write_figures({"a": go.Figure(go.Bar(y=[1]))}, tmp_path)
    assert written == {"a": {"html": str(tmp_path / "a.html")}} and not list(tmp_path.glob("*.png"))


def test_figure_pngs_take_the_layout_size_unless_given_one(tmp_path, monkeypatch):
    import plotly.graph_objects as go
    from PIL import Image

    from rolemrc.core.figures import write_figures

    monkeypatch.setenv("ROLEMRC_PNG", "1")
    figures = {"sized": go.Figure(go.Bar(y=[1, 2]), layout={"width": 900, "height": 300}), "plain": go.Figure(go.Bar(y=[1]))}
    written = write_figures(figures, tmp_path, width=None, height=None)
    assert [Image.open(written[stem]["png"]).size for stem in figures] == [(900, 300), (700, 500)]
