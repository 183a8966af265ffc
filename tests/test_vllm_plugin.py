"""rolemrc's vLLM plugin (vllm_plugin/, installed into .venv-vllm by `make vllm`): its grouped LoRA ops equal vLLM's
own on random inputs except on rows without an adapter, where vLLM's are wrong; vLLM finds it through its
`vllm.general_plugins` entry point; it acts only on the vLLM versions and platform it was tested on. Served end to
end, tests/test_serve_vllm.py runs with it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rolemrc.serve.engines.vllm import lora_path, vllm_build, vllm_python
from rolemrc.serve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
try:
    VLLM = vllm_python("test")
except ConfigError as exc:
    if os.environ.get("ROLEMRC_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vLLM is not installed ({exc})", allow_module_level=True)


def in_vllm(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([VLLM, "-c", code], capture_output=True, text=True, env=os.environ | env, timeout=300)


def test_grouped_ops_equal_vllms_own_and_leave_rows_without_an_adapter_alone():
    done = subprocess.run([VLLM, str(ROOT / "tests" / "vllm_ops_check.py")], capture_output=True, text=True, timeout=300)
    tally = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and tally["failures"] == [], done.stdout + done.stderr
    assert tally["cases"] == 96 and tally["rows_with_adapter"] > 500 and tally["rows_without"] > 500
    assert tally["original_wrong_on_minus_one"] > 0   # the bug the plugin works around is there in this vLLM


def test_vllm_finds_the_plugin_and_it_acts_only_where_tested():
    found = in_vllm("from importlib.metadata import entry_points; "
                    "print([e.value for e in entry_points(group='vllm.general_plugins')])")
    assert "rolemrc_vllm_plugin:register" in found.stdout, found.stderr
    cpu, plugin = vllm_build(VLLM)
    assert cpu and plugin == (True, "grouped LoRA ops replace vLLM 0.32.0's torch ops (CPU)")
    off = in_vllm("import rolemrc_vllm_plugin as p; print(p.status())", ROLEMRC_VLLM_PLUGIN="0")
    assert "(False, 'off (ROLEMRC_VLLM_PLUGIN=0)')" in off.stdout
    unlisted = in_vllm("import rolemrc_vllm_plugin as p; print(p.status())", VLLM_PLUGINS="lora_filesystem_resolver")
    assert "does not name rolemrc_grouped_lora, so vLLM does not load it" in unlisted.stdout   # nor the engine count on it
    other = in_vllm("import rolemrc_vllm_plugin as p; p.TESTED = ('0.33.0',); p.register(); "
                    "import vllm.lora.punica_wrapper.punica_cpu as c; print(c.bgmv_shrink.__module__, p.status()[1])")
    assert other.stdout.split()[0] == "vllm.lora.ops.torch_ops.lora_ops"   # vLLM's own ops stay
    assert "not a version it was tested against (0.33.0)" in other.stdout
    on = in_vllm("import rolemrc_vllm_plugin as p; p.register(); p.register(); "
                 "import vllm.lora.punica_wrapper.punica_cpu as c, vllm.lora.ops.torch_ops as t; "
                 "print(c.bgmv_shrink.__module__, t.sgmv_expand.__module__)")
    assert on.stdout.split() == ["rolemrc_vllm_plugin.ops", "rolemrc_vllm_plugin.ops"], on.stderr


def test_the_engine_says_which_lora_path_serves():
    assert lora_path(True, (True, "active"), None) == (
        False, "rolemrc's grouped LoRA ops (vLLM plugin); unrestrained requests on the base model")
    identity, line = lora_path(True, None, None)
    assert identity and "rolemrc's vLLM plugin not installed" in line and "zero adapter" in line
    identity, line = lora_path(True, (False, "off (ROLEMRC_VLLM_PLUGIN=0)"), None)
    assert identity and "plugin inactive: off" in line
    assert lora_path(False, None, None) == (False, "vLLM's LoRA kernels; unrestrained requests on the base model")
    assert lora_path(True, (True, "active"), True)[0]   # identity_adapter: true still forces it
