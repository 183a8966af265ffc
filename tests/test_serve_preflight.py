"""Start-up configuration errors through the real CLI: a config that cannot serve (a missing or unusable model
directory, a GGUF file, no vLLM, an engine option out of range) is one `error:` line naming the model and setting,
exit 2, before anything loads or the server binds its port (its JSON log never starts)."""

import os
import shutil
import socket
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from rolemrc.core.errors import EXIT_INPUT
from rolemrc.serve.launch import free_port


def serve(config: dict, workdir, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, int]:
    path = workdir / f"serve-{uuid.uuid4().hex}.yaml"   # a name of its own: the cases run in parallel threads
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "rolemrc.serve", "--config", str(path), "--port", str(port)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return done, port


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory, model_dirs):
    """Model directories that cannot be served, each by one fault."""
    root = tmp_path_factory.mktemp("bad-models")
    good = model_dirs["llama"]
    dirs = {"missing": root / "nowhere", "empty": root / "empty"}
    dirs["empty"].mkdir()
    dirs["gguf_file"] = root / "model.Q4_1.gguf"
    dirs["gguf_file"].write_bytes(b"GGUF\x03\x00\x00\x00")
    dirs["gguf_dir"] = root / "gguf-dir"
    dirs["gguf_dir"].mkdir()
    (dirs["gguf_dir"] / "model.Q4_1.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for name in ("garbled", "no_weights", "no_tokenizer", "unloadable"):
        shutil.copytree(good, root / name)
        dirs[name] = root / name
    (dirs["garbled"] / "config.json").write_text("{not json")
    (dirs["unloadable"] / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (dirs["no_weights"] / "model.safetensors").unlink()
    for file in dirs["no_tokenizer"].glob("tokenizer*"):
        file.unlink()
    return dirs


CASES = {   # name -> (model entry or a callable of the bad dirs, extra config, env, what the error line says)
    "missing": (lambda d: {"path": str(d["missing"])}, {}, {}, "no such directory"),
    "empty": (lambda d: {"path": str(d["empty"])}, {}, {}, "no config.json"),
    "gguf_file": (lambda d: {"path": str(d["gguf_file"])}, {}, {}, "a GGUF file, not a model directory"),
    "gguf_dir": (lambda d: {"engine": "vllm", "path": str(d["gguf_dir"])}, {}, {}, "rolemrc models convert"),
    "garbled": (lambda d: {"path": str(d["garbled"])}, {}, {}, "config.json is unreadable"),
    "no_weights": (lambda d: {"path": str(d["no_weights"])}, {}, {}, "no weights"),
    "no_tokenizer": (lambda d: {"path": str(d["no_tokenizer"])}, {}, {}, "no tokenizer"),
    "no_vllm_python": (lambda d: {"engine": "vllm", "path": str(d["good"])}, {},
                       {"ROLEMRC_VLLM_PYTHON": "/nonexistent/python"}, "the vLLM interpreter '/nonexistent/python'"),
    "python_without_vllm": (lambda d: {"engine": "vllm", "path": str(d["good"])}, {},
                            {"ROLEMRC_VLLM_PYTHON": sys.executable}, "cannot import vllm"),
    "memory": (lambda d: {"engine": "vllm", "path": str(d["good"]), "memory_utilization": 1.5}, {}, {},
               "memory_utilization is 1.5; it must be > 0 and <= 1"),
    "restart_max": (lambda d: {"engine": "vllm", "path": str(d["good"]), "restart_max": -1}, {}, {},
                    "restart_max is -1; it must be >= 0"),
    "restart_window": (lambda d: {"engine": "vllm", "path": str(d["good"]), "restart_window_s": "long"}, {}, {},
                       "restart_window_s must be a number"),
    "vllm_args": (lambda d: {"engine": "vllm", "path": str(d["good"]), "vllm_args": "--enforce-eager"}, {}, {},
                  "vllm_args must be a list of strings"),
    "on_engine_dead": (lambda d: {"path": str(d["good"])}, {"on_engine_dead": "shrug"}, {}, "on_engine_dead 'shrug'"),
    "dtype": (lambda d: {"path": str(d["good"]), "dtype": "float8"}, {}, {}, "dtype 'float8' is not one of"),
    # auth fails closed: a key source that yields no key, a role that is not one, a reachable host without keys
    "empty_key_env": (lambda d: {"path": str(d["good"])}, {"api_key_env": "ROLEMRC_API_KEYS"},
                      {"ROLEMRC_API_KEYS": ","}, "$ROLEMRC_API_KEYS holds no API key"),
    "key_role": (lambda d: {"path": str(d["good"])}, {"api_key_env": "ROLEMRC_API_KEYS"},
                 {"ROLEMRC_API_KEYS": "k1:admin,k2:root"}, "a key's role must be one of ('serve', 'admin'), not 'root'"),
    "open_host": (lambda d: {"path": str(d["good"])}, {"host": "0.0.0.0"}, {},
                  "host 0.0.0.0 is reachable from other machines, but no API keys are configured"),
    "models_list": (lambda d: {"path": str(d["good"])}, {"models": [{"name": "m", "path": "x"}]}, {},
                    "`models` must be a mapping of names, as `models: {NAME: {path: DIR}}`, not a list"),
    "allowed_hosts": (lambda d: {"path": str(d["good"])}, {"allowed_hosts": ["api.example:8000"]}, {},
                      "allowed_hosts: 'api.example:8000' is not a host name or IP address"),
}
CONFIG_WIDE = {"models_list", "on_engine_dead", "empty_key_env", "key_role", "open_host", "allowed_hosts"}   # errors naming no model


def test_configuration_errors_are_one_line_before_the_port_is_bound(bad_dirs, model_dirs, tmp_path):
    dirs = {**bad_dirs, "good": model_dirs["llama"]}

    def run(case):
        entry, extra, env, _ = CASES[case]
        return serve({"models": {"m": entry(dirs)}, "db": None, **extra}, tmp_path, env)

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(CASES, pool.map(run, CASES)))
    for case, (done, port) in results.items():
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert done.returncode == EXIT_INPUT, (case, lines)
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, lines)   # no log: the server never started
        assert CASES[case][3] in lines[0], (case, lines[0])
        assert "model 'm'" in lines[0] or case in CONFIG_WIDE, (case, lines[0])
        assert not listening(port), case


def test_a_model_that_fails_to_load_is_one_error_line_and_exit_2(bad_dirs, tmp_path):
    """Past the checks, a model transformers cannot load fails the start: the server's log says why, then one
    `error:` line naming the model, exit 2, and the port was never bound."""
    done, port = serve({"models": {"m": str(bad_dirs["unloadable"])}, "db": None}, tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == EXIT_INPUT, done.stderr[-2000:]
    assert len(errors) == 1 and "model 'm' did not load" in errors[0] and "no-such-architecture" in errors[0], errors
    assert "Uvicorn running" not in done.stderr and not listening(port)


def test_a_launched_server_holds_its_port_from_the_start_and_listens_once_up(model_dirs, tmp_path):
    """The launcher binds the port and hands the socket to the server, which listens on it only once its engines
    are up: meanwhile nothing else can be given the port (another launch, an engine's own sockets; vLLM opens many),
    and nothing answers on it."""
    import errno
    import time

    from rolemrc.serve import launch

    server = launch.launch_server({"models": {"t": {"path": str(model_dirs["llama"])}}, "db": None}, workdir=tmp_path)
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", server.port))
        assert taken.value.errno == errno.EADDRINUSE
        assert not listening(server.port)   # bound, not yet listening: a client is refused, never answered by another
        deadline = time.monotonic() + 120
        while not listening(server.port) and server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listening(server.port), server.logs()[-2000:]
        assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"
    finally:
        server.signal(15)
        server.wait()
