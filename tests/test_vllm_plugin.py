"""rolemrc's vLLM plugin (vllm_plugin/, installed into .venv-vllm by `make vllm`): its grouped LoRA ops equal vLLM's
own on random inputs except on rows without an adapter, where vLLM's are wrong; vLLM finds it through its
`vllm.general_plugins` entry point; it acts only on the vLLM versions and platform it was tested on. Served end to
end, tests/test_serve_vllm.py runs with it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from fixtures import vllm_or_skip

from rolemrc.serve.engines.vllm import lora_path, vllm_build

ROOT = Path(__file__).resolve().parents[1]
VLLM = vllm_or_skip()


def test_grouped_ops_equal_vllms_own_and_leave_rows_without_an_adapter_alone():
    done = subprocess.run([VLLM, str(ROOT / "tests" / "vllm_ops_check.py")], capture_output=True, text=True, timeout=300)
    tally = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and tally["failures"] == [], done.stdout + done.stderr
    assert tally["cases"] == 144 and tally["rows_with_adapter"] > 500 and tally["rows_without"] > 500
    assert tally["original_wrong_on_minus_one"] > 0   # the bug the plugin works around is there in this vLLM


GATE = """import json, os, importlib.metadata as m
import rolemrc_vllm_plugin as p
out = {"entry_points": [e.value for e in m.entry_points(group="vllm.general_plugins")], "status": p.status()}
os.environ["ROLEMRC_VLLM_PLUGIN"] = "0"; out["off"] = p.status(); del os.environ["ROLEMRC_VLLM_PLUGIN"]
os.environ["VLLM_PLUGINS"] = "lora_filesystem_resolver"; out["unlisted"] = p.status(); del os.environ["VLLM_PLUGINS"]
import vllm.lora.punica_wrapper.punica_cpu as c, vllm.lora.ops.torch_ops as t
p.TESTED = ("0.33.0",); p.register(); out["other"] = [c.bgmv_shrink.__module__, p.status()[1]]
p.TESTED = ("0.32.0",); p.register(); p.register(); out["on"] = [c.bgmv_shrink.__module__, t.sgmv_expand.__module__]
print(json.dumps(out))"""


def test_vllm_finds_the_plugin_and_it_acts_only_where_tested():
    done = subprocess.run([VLLM, "-c", GATE], capture_output=True, text=True, timeout=300)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "rolemrc_vllm_plugin:register" in found["entry_points"], done.stderr
    assert found["status"] == [True, "grouped LoRA ops replace vLLM 0.32.0's torch ops (CPU)"]
    assert found["off"] == [False, "off (ROLEMRC_VLLM_PLUGIN=0)"]
    assert "does not name rolemrc_grouped_lora, so vLLM does not load it" in found["unlisted"][1]   # nor the engine
    assert found["other"][0] == "vllm.lora.ops.torch_ops.lora_ops"   # another version: vLLM's own ops stay
    assert "not a version it was tested against (0.33.0)" in found["other"][1]
    assert found["on"] == ["rolemrc_vllm_plugin.ops", "rolemrc_vllm_plugin.ops"]   # idempotent


def test_the_engine_says_which_lora_path_serves():
    assert lora_path(True, (True, "active"), None) == (
        False, "rolemrc's grouped LoRA ops (vLLM plugin); unrestrained requests on the base model")
    identity, line = lora_path(True, None, None)
    assert identity and "rolemrc's vLLM plugin not installed" in line and "zero adapter" in line
    identity, line = lora_path(True, (False, "off (ROLEMRC_VLLM_PLUGIN=0)"), None)
    assert identity and "plugin inactive: off" in line
    assert lora_path(False, None, None) == (False, "vLLM's LoRA kernels; unrestrained requests on the base model")
    assert lora_path(True, (True, "active"), True)[0]   # identity_adapter: true still forces it


def test_the_engines_probe_of_vllm_is_kept_per_install_and_environment(tmp_path, monkeypatch):
    """`vllm_build` asks vLLM's interpreter once (importing vLLM, ~5 s) and keeps the answer under a key of the
    install and the variables the plugin reads: the same answer again without the import, another for another value."""
    monkeypatch.setenv("ROLEMRC_CACHE", str(tmp_path))
    active = (True, (True, "grouped LoRA ops replace vLLM 0.32.0's torch ops (CPU)"))
    assert vllm_build(VLLM) == active
    kept = list((tmp_path / "vllm-build").iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == [True, list(active[1])]
    kept[0].write_text(json.dumps([True, [True, "as kept"]]))   # what the next probe answers comes from the file
    assert vllm_build(VLLM) == (True, (True, "as kept"))
    assert vllm_build(VLLM, os.environ | {"ROLEMRC_VLLM_PLUGIN": "0"}) == (True, (False, "off (ROLEMRC_VLLM_PLUGIN=0)"))
    assert len(list((tmp_path / "vllm-build").iterdir())) == 2
