"""brisk serve as a drop-in for trtllm-serve and vllm serve, run as a user runs it (the `brisk` binary of the venv, a
subprocess per command):

- the TensorRT-LLM gpt-oss guide's commands and YAML files verbatim (tests/data/trtllm_gpt_oss_guide/), `trtllm-serve`
  replaced by `brisk serve`, the model id `openai/gpt-oss-120b` found in a temporary Hugging Face cache holding the
  bundled demo model while the Hub cannot be reached; then the guide's /health and chat curl requests;
- a `vllm serve`-style command line, each flag's effect checked;
- start-up errors a user can act on: one line on stderr, exit code 2, no traceback (but with --log-level debug).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from brisk.config import EngineConfig
from tests.server_utils import STARTUP_TIMEOUT_S, free_port, wait_until
from tests.tiny_models import make_tiny_llama_with_tokenizer

GUIDE = Path(__file__).resolve().parent / "data" / "trtllm_gpt_oss_guide"
DEMO = Path(__file__).resolve().parents[1] / "brisk" / "demo_model"
MODEL_ID = "openai/gpt-oss-120b"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
BIN = Path(sys.executable).parent  # the venv's bin: `brisk` and `python`
# The Hub is out of reach during these tests whatever the machine's network (a closed local port: connections are
# refused at once), so the model id must come from the cache, and nothing is ever downloaded.
UNREACHABLE_HUB = "http://127.0.0.1:9"


def guide_blocks() -> dict[str, str]:
    """The guide's commands by name (commands.sh: each under a `## name` line)."""
    blocks: dict[str, str] = {}
    name = None
    for line in (GUIDE / "commands.sh").read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            blocks[name] = ""
        elif name is not None and line.strip():
            blocks[name] += line + "\n"
    return {k: v.strip() for k, v in blocks.items()}


BLOCKS = guide_blocks()
SERVE_COMMANDS = [name for name in BLOCKS if name.startswith(("low_latency", "max_throughput"))]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hugging Face cache holding the demo model as openai/gpt-oss-120b (main), and a second revision."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--openai--gpt-oss-120b"
    for ref, commit in (("main", SNAPSHOT), ("v2", "f" * 40)):
        shutil.copytree(DEMO, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    (repo / "snapshots" / ("f" * 40) / "REVISION").write_text("v2\n")
    return home


def user_env(hf_home: Path, state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "OMPI_", "PMIX_"))}
    env.update(
        HF_HOME=str(hf_home),
        HF_ENDPOINT=UNREACHABLE_HUB,
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        XDG_STATE_HOME=str(state),
    )
    return env


def session_cpu_kernels() -> list[str]:
    """`pytest --cpu-kernels X` reaches the server as `--cpu_kernels X` (the one word added to a command)."""
    choice = EngineConfig.model_fields["cpu_kernels"].default
    return [] if choice == "auto" else ["--cpu_kernels", choice]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class Command:
    """A shell command run as a user runs it, in its own process group; its output kept in a file."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.command = command
        self.log_path = cwd / f"log-{time.monotonic_ns()}.txt"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def server_pid(self) -> int:
        """brisk serve's pid: the command's own process, or (under mpirun) its child running brisk."""
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop(0)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            if any(part.endswith(b"/brisk") for part in cmdline) and b"serve" in cmdline:
                return pid
            todo += [int(c) for c in children]
        return self.proc.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            # SIGTERM to brisk (as a service manager sends it; mpirun then ends with its one process): it drains and
            # exits 0
            os.kill(self.server_pid(), signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def run_once(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_error(stderr: str, *needles: str) -> str:
    """brisk's part of stderr ends with one `brisk serve: error:` line (log lines may come before it; mpirun adds its
    own report after), and holds no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("brisk serve: error:")]
    assert len(errors) == 1, stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def curl_or_httpx(command: str, cwd: Path, env: dict[str, str]) -> str:
    """A guide curl command's stdout: curl as written where there is curl, else the same request by httpx."""
    if shutil.which("curl"):
        return subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        ).stdout
    words = shlex.split(command)
    url = next(w for w in words if "localhost" in w)
    url = url if url.startswith("http") else f"http://{url}"
    if "-d" in words:
        body = json.loads(words[words.index("-d") + 1])
        return httpx.post(url, json=body, timeout=600).text + "\n"
    return f"Status: {httpx.get(url, timeout=10).status_code}\n"


# ---- the guide ---------------------------------------------------------------------------------------------------
def test_the_guides_yaml_files():
    """The two YAML files as brisk reads them (on this machine, and what a GPU would run)."""
    low = EngineConfig.build("m", GUIDE / "low_latency.yaml", device="cpu")
    assert not low.enable_attention_dp and low.enable_mixed_sampler
    assert low.cuda_graph_config is not None and (
        low.cuda_graph_config.max_batch_size,
        low.cuda_graph_config.enable_padding,
    ) == (8, True)
    high = EngineConfig.build("m", GUIDE / "max_throughput.yaml", device="cpu")
    assert high.enable_attention_dp and high.stream_interval == 10
    assert high.cuda_graph_config is not None and high.cuda_graph_config.max_batch_size == 640
    for cfg, name in ((low, "TRTLLM"), (high, "CUTLASS")):
        assert cfg.moe_config.backend == "auto"
        _, notes = cfg.on_device("cuda", name)
        assert f"moe_config.backend {name}: brisk's Triton MXFP4 grouped GEMM runs on this GPU" in notes
    # "(H200 Only) Using OpenAI Triton Kernels for MoE": the snippet added to the YAML file, or the flag
    snippet = (GUIDE / "triton_moe.yaml").read_text()
    assert BLOCKS["moe_backend_flag"] == "--moe_backend TRITON"
    for cfg in (
        EngineConfig.model_validate({"model": "m", **_yaml((GUIDE / "low_latency.yaml").read_text() + snippet)}),
        EngineConfig.build("m", GUIDE / "low_latency.yaml", moe_backend="TRITON", device="cuda"),  # as on a GPU
    ):
        assert cfg.moe_config.backend == "triton"


def _yaml(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


@pytest.fixture
def guide_dir(tmp_path) -> Path:
    for name in ("low_latency.yaml", "max_throughput.yaml"):
        shutil.copy(GUIDE / name, tmp_path / name)
    return tmp_path


def _serve_the_guide(command: str, guide_dir: Path, hf_home: Path) -> None:
    """Run one of the guide's server commands, then its /health and chat requests against it."""
    port = 8000 if port_free(8000) else free_port()  # 8000 as written, unless this machine already uses it
    env = user_env(hf_home, guide_dir / "state")
    serve = command.replace("trtllm-serve", "brisk serve").replace("--port 8000", f"--port {port}")
    serve += "".join(f" {w}" for w in session_cpu_kernels())
    health = BLOCKS["health"].replace(":8000", f":{port}")
    chat = BLOCKS["chat"].replace(":8000", f":{port}")
    tp_size = int(re.search(r"--tp_size (\d+)", command).group(1))
    server = Command(serve, guide_dir, env)
    try:
        up = wait_until(
            lambda: server.proc.poll() is not None or "Status: 200" in curl_or_httpx(health, guide_dir, env),
            timeout=STARTUP_TIMEOUT_S,
        )
        assert up, f"not serving after {STARTUP_TIMEOUT_S}s:\n{server.log()}"
        if server.proc.poll() is not None:
            # 4 and 8 GPUs on a machine without them: one line saying why, exit code 2, no traceback
            assert tp_size > 1, server.log()
            assert server.proc.returncode == 2, server.log()
            assert_one_line_error(server.log(), f"tp_size {tp_size}")
            return
        assert "Status: 200" in curl_or_httpx(health, guide_dir, env)
        body = json.loads(curl_or_httpx(chat, guide_dir, env))
        assert body["model"] == MODEL_ID and body["object"] == "chat.completion", body
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and choice["message"]["role"] == "assistant"
        assert 0 < body["usage"]["completion_tokens"] <= 1024
        log = server.log()
        for note in ("moe_config.backend", "trust_remote_code: brisk runs no code from checkpoints"):
            assert note in log
    finally:
        code = server.stop()
    assert code == 0, f"exit code {code}:\n{server.log()}"  # drained and exited on SIGTERM


@pytest.mark.parametrize("name", SERVE_COMMANDS)
def test_the_guides_commands(name, guide_dir, hf_home):
    """Each command as written: --host 0.0.0.0 --port 8000 --backend pytorch --tp_size --ep_size --max_batch_size
    --trust_remote_code --extra_llm_api_options (the YAML files) --kv_cache_free_gpu_memory_fraction."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian's openmpi-bin; .ci/run installs it): the guide's mpirun form")
    _serve_the_guide(BLOCKS[name], guide_dir, hf_home)


def test_the_guides_command_without_mpirun_and_with_the_moe_flag(guide_dir, hf_home):
    """The trtllm-serve command alone (as the guide writes its newer 4-GPU one), with --moe_backend TRITON added."""
    command = BLOCKS["low_latency_1gpu"].split("\\\n", 1)[1] + " \\\n  " + BLOCKS["moe_backend_flag"]
    _serve_the_guide(command, guide_dir, hf_home)


def test_model_id_from_the_hf_cache_without_the_hub(hf_home, tmp_path):
    """No HF_HUB_OFFLINE: the Hub is tried, refuses, and the cached snapshot of the revision asked for is served."""
    env = user_env(hf_home, tmp_path)
    code = (
        "from brisk.hub import resolve_model; import sys; "
        f"print(resolve_model('{MODEL_ID}')); print(resolve_model('{MODEL_ID}', revision='v2'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    main, v2 = out.stdout.split()
    assert main.endswith(SNAPSHOT) and (Path(main) / "model.safetensors").is_file()
    assert (Path(v2) / "REVISION").read_text() == "v2\n"


# ---- start-up errors -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("llama"))


CORES = os.cpu_count() or 1


@pytest.mark.parametrize(
    "args, needles",
    [
        ("openai/gpt-oss-20b", ["model 'openai/gpt-oss-20b' is not in the Hugging Face cache", "pass a local folder"]),
        ("/no/such/folder", ["is not a directory", "MODEL"]),
        (f"--tp_size {CORES + 1}", [f"tp_size {CORES + 1} needs {CORES + 1} devices", "lower --tp_size"]),
        ("--backend tensorrt", ["brisk has no tensorrt engine"]),
        ("--kv-cache-dtype fp8_e5m2", ["kv_cache_config.dtype", "fp8_e5m2 is not supported"]),
        ("--api-server-count 4 --num-postprocess-workers 2", ["api_server_count 4 and num_postprocess_workers 2"]),
        ("LLAMA --tool-call-parser openai", ["--tool-call-parser", "harmony models"]),
        ("--max-num-seqs 0", ["max_batch_size", "max_num_seqs"]),
        ("--enable-lora --max-loras 2", ["enable-lora", "no LoRA adapters"]),  # a peer's option brisk does not have
        # raised in the engine process (as a KV cache too small for the GPU would be), reported by the server
        (
            '--speculative-config \'{"method": "eagle3", "num_speculative_tokens": 2, "model": "NOWHERE"}\'',
            ["speculative"],
        ),
    ],
)
def test_start_up_errors_are_one_line(args, needles, llama, hf_home, tmp_path):
    args = args.replace("LLAMA", llama).replace("NOWHERE", str(tmp_path / "nowhere"))
    env = user_env(hf_home, tmp_path)
    done = run_once(f"brisk serve {args} --port {free_port()}", tmp_path, env)
    assert done.returncode == 2, done.stderr
    assert_one_line_error(done.stderr, *needles)
    assert done.stderr.rstrip().splitlines()[-1].startswith("brisk serve: error:")
    # --log-level debug: the same line, then the traceback
    debug = run_once(f"brisk serve {args} --port {free_port()} --log-level debug", tmp_path, env)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_port_in_use_is_one_line(hf_home, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_once(f"brisk serve --port {port}", tmp_path, user_env(hf_home, tmp_path))
    assert done.returncode == 2
    assert_one_line_error(done.stderr, f"port {port}", "in use", "--port")


# ---- vllm serve ------------------------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["yes", "no", "perchance"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["verdict", "count"],
}
VLLM_FLAGS = (
    "--max-model-len 512 --gpu-memory-utilization 0.5 --max-num-seqs 2 --max-num-batched-tokens 512 "
    "--no-enable-prefix-caching --tensor-parallel-size 1 --data-parallel-size 1 --enable-expert-parallel "
    "--async-scheduling --enforce-eager --kv-cache-dtype auto --block-size 16 --seed 0 "
    "--served-model-name gpt-oss openai/gpt-oss-120b --max-logprobs 5 --generation-config auto "
    "--tool-call-parser openai --reasoning-parser openai_gptoss --enable-auto-tool-choice "
    "--uvicorn-log-level warning --disable-log-requests --api-server-count 1 "
    """--structured-outputs-config '{"disable_any_whitespace": false}' --config vllm.yaml """
    """--default-chat-template-kwargs '{"reasoning_effort": "low"}' """
    """--reasoning-effort-map '{"minimal": "low", "xhigh": "high"}' --disable-uvicorn-access-log """
    "--return-tokens-as-token-ids --sse-keep-alive-interval 30 --enable-tokenizer-info-endpoint "
    "--enable-force-include-usage"
)


@pytest.fixture(scope="module")
def vllm_server(hf_home, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("vllm")
    (cwd / "vllm.yaml").write_text("trust-remote-code: true\nhost: 127.0.0.1\n")  # vLLM's --config: flags by name
    with serving(f"brisk serve {MODEL_ID} {VLLM_FLAGS}", cwd, hf_home) as (url, server):
        yield url, server


@contextlib.contextmanager
def serving(command: str, cwd: Path, hf_home: Path) -> Iterator[tuple[str, Command]]:
    """`command` (a brisk serve, given a free --port here) run until /health answers; SIGTERM at the end."""
    port = free_port()
    server = Command(f"{command} --port {port} " + " ".join(session_cpu_kernels()), cwd, user_env(hf_home, cwd))
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return server.proc.poll() is not None or httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(healthy, timeout=STARTUP_TIMEOUT_S) and server.proc.poll() is None, server.log()
        yield url, server
    finally:
        server.stop()


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Good morrow"}], "max_tokens": 16, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _final_channel_prompt() -> list[int]:
    from transformers import AutoTokenizer

    from brisk.harmony.chat import render_chat

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    prompt = render_chat(tokenizer, [{"role": "user", "content": "Speak"}], harmony=True)
    return prompt + tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)


def test_vllm_command_serves(vllm_server):
    url, server = vllm_server
    # --served-model-name: the first name is reported, every name is served
    for name in ("gpt-oss", MODEL_ID):
        r = _chat(url, model=name)
        assert r.status_code == 200 and r.json()["model"] == "gpt-oss", r.text
    assert _chat(url, model="other").status_code == 404
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["gpt-oss", MODEL_ID]
    # --default-chat-template-kwargs: every prompt is rendered with them (gpt-oss: the reasoning effort)
    messages = [{"role": "user", "content": "Good morrow"}]
    tokens = httpx.post(f"{url}/tokenize", json={"model": "gpt-oss", "messages": messages}).json()["tokens"]
    prompt = httpx.post(f"{url}/detokenize", json={"model": "gpt-oss", "tokens": tokens}).json()["prompt"]
    assert "Reasoning: low" in prompt, prompt
    # --return-tokens-as-token-ids: logprobs name tokens token_id:N, unless a request says otherwise
    r = _chat(url, logprobs=True, top_logprobs=2, max_tokens=24, return_token_ids=True).json()["choices"][0]
    entries = r["logprobs"]["content"]
    assert entries and all(e["token"].startswith("token_id:") for e in entries)
    assert all(int(e["token"].split(":")[1]) in r["token_ids"] for e in entries)
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    r = _chat(url, logprobs=True, max_tokens=24, return_tokens_as_token_ids=False).json()["choices"][0]
    assert not any(e["token"].startswith("token_id:") for e in r["logprobs"]["content"])
    # --reasoning-effort-map: efforts gpt-oss does not have are rewritten to ones it has; one not in the map is a 400
    for effort in ("minimal", "xhigh", "high"):
        r = _chat(url, reasoning_effort=effort)
        assert r.status_code == 200, (effort, r.text)
    body = {"model": "gpt-oss", "input": "Good morrow", "max_output_tokens": 8, "reasoning": {"effort": "minimal"}}
    assert httpx.post(f"{url}/v1/responses", json=body, timeout=120).status_code == 200
    r = _chat(url, reasoning_effort="none")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    assert "--reasoning-effort-map" in r.json()["error"]["message"]
    body["reasoning"] = {"effort": "max"}
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
    # --max-model-len 512: a longer prompt is a 400
    r = _chat(url, messages=[{"role": "user", "content": "Speak " * 600}])
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]
    # --max-logprobs 5
    assert _chat(url, logprobs=True, top_logprobs=5).status_code == 200
    r = _chat(url, logprobs=True, top_logprobs=6)
    assert r.status_code == 400 and "max_logprobs" in r.json()["error"]["message"]
    # --no-enable-prefix-caching: a prompt sent twice hits nothing
    for _ in range(2):
        assert _chat(url, messages=[{"role": "user", "content": "To be or not to be " * 20}]).status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("brisk:prefix_cache_hits_total")
    ]
    assert hits == [0.0]  # (the same prompts hit on a server with prefix caching: tests/test_options.py, offline)
    log = server.log()
    config, _ = json.JSONDecoder().raw_decode(log.split("configuration in effect:\n", 1)[1])
    engine = config["engine"]
    assert engine["cuda_graph_config"] is None  # --enforce-eager
    assert engine["disable_overlap_scheduler"] is False and "overlap scheduling on" in log  # --async-scheduling
    assert engine["kv_cache_config"]["tokens_per_block"] == 16 and "KV blocks of 16 tokens" in log  # --block-size
    assert engine["trust_remote_code"] is True and config["server"]["host"] == "127.0.0.1"  # --config vllm.yaml
    assert "gpu_memory_utilization 0.5 on a CPU" in log
    assert config["server"]["reasoning_parser"] == "openai_gptoss" and config["server"]["api_server_count"] == 1
    # --enable-tokenizer-info-endpoint: the tokenizer's configuration and the chat template in effect
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["tokenizer_class"] and "<|start|>" in info["chat_template"]
    assert not any(str(v).startswith(("/", str(Path.home()))) for v in info.values() if isinstance(v, str))
    # --sse-keep-alive-interval 30: streams go through the keep-alive path whole (its comments: test_stream_path.py)
    assert config["server"]["sse_keep_alive_interval"] == 30
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) > 2
    # --enable-force-include-usage: that stream (no stream_options) ended with its usage
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] > 0
    # --uvicorn-log-level warning: uvicorn's info lines are gone; --disable-log-requests: so are brisk's request lines
    assert "Application startup complete" not in log and "brisk.server.requests" not in log


RECIPE = Path(__file__).resolve().parent / "data" / "vllm_gpt_oss_recipe"


def test_vllm_gpt_oss_recipe_serves(hf_home, tmp_path):
    """vLLM's gpt-oss recipe for Hopper: its launch command with its YAML file as written (tests/data/
    vllm_gpt_oss_recipe/: no-enable-prefix-caching, max-cudagraph-capture-size, max-num-batched-tokens,
    stream-interval), `vllm serve` -> `brisk serve`, the model given as --model (the recipe's docker form)."""
    shutil.copy(RECIPE / "GPT-OSS_Hopper.yaml", tmp_path)
    command = f"brisk serve --model {MODEL_ID} --config GPT-OSS_Hopper.yaml --tensor-parallel-size 1"
    with serving(command, tmp_path, hf_home) as (url, server):
        body = {"model": MODEL_ID, "prompt": "Once", "max_tokens": 45, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert 3 <= len(chunks) <= 4, chunks  # stream-interval 20: 45 tokens in 3 chunks (and the finish)
        config, _ = json.JSONDecoder().raw_decode(server.log().split("configuration in effect:\n", 1)[1])
        engine = config["engine"]
        assert engine["kv_cache_config"]["enable_block_reuse"] is False  # no-enable-prefix-caching: true
        assert engine["cuda_graph_config"]["max_batch_size"] == 2048 and engine["max_num_tokens"] == 8192
    assert server.stop() == 0, server.log()  # drained and exited on SIGTERM


def test_vllm_max_num_seqs_caps_the_running_batch(vllm_server):
    """--max-num-seqs 2: with two long requests running, a third waits until one of them finishes."""
    url, _ = vllm_server
    prompt = _final_channel_prompt()
    first_token, finished = [threading.Event(), threading.Event()], {}

    def stream(i: int) -> None:
        body = {"model": "gpt-oss", "prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_token[i].set()
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in first_token)
    sent = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-oss", "prompt": prompt, "max_tokens": 1}, timeout=300)
    answered = time.monotonic()
    for t in threads:
        t.join(300)
    assert r.status_code == 200
    assert min(finished.values()) > sent  # both were running when the third came
    assert answered >= min(finished.values())  # and it ran only once one of them was done


def test_vllm_structured_outputs_whitespace_switch(vllm_server):
    """The server allows whitespace (--structured-outputs-config); a request's own switch makes its JSON compact."""
    url, _ = vllm_server
    prompt = _final_channel_prompt()

    def sample(seed: int, **switch) -> str:
        body = {
            "model": "gpt-oss",
            "prompt": prompt,
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": seed,
            "structured_outputs": {"json": SCHEMA, **switch},
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    spaced = [sample(seed) for seed in range(8)]
    compact = [sample(seed, disable_any_whitespace=True) for seed in range(8)]
    assert any(re.search(r"\s", text) for text in spaced)
    assert all(text == json.dumps(json.loads(text), separators=(",", ":")) for text in compact)
