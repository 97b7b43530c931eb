"""Start, query and stop a real SGLang 0.5.23 server on CPU, for tests. Standard library only.

The test process (the main venv, /work/main/.venv) drives a server that runs in the SGLang venv
built by tests/sglang/setup.sh (`${SGLANG_VENV:-.venv-sglang}`), over HTTP (urllib).

    from tests.sglang.server import SGLangServer          # or: import server (same folder)
    with SGLangServer(tp=2, prefix=[TT, "record", "-o", out, "--"]) as srv:
        out = srv.generate([1, 2, 3, 4], max_new_tokens=8)
    srv.exit_code

As a script (prints start time, RSS, the generated tokens, the exit code):

    python tests/sglang/server.py --tp 2 [--aux] [--prefix "tensor-trace record -o OUT --"]

The server: tests/data/tiny-llama (2-layer Llama, dummy weights, which are seeded, so TP=1 and
TP=2 give the same tokens), `--device cpu --attention-backend torch_native`, KV cache capped by
`--max-total-tokens 4096`. Environment: SGLANG_USE_CPU_ENGINE=1, SGLANG_CPU_OMP_THREADS_BIND
("0|1" at TP=2, one core per rank; unset at TP=1: rank 0 then binds to the cores of NUMA node 0),
and tests/sglang/shims first on PYTHONPATH for the `sgl_kernel` stand-in (never installed into
the venv, so it cannot shadow a real sgl_kernel).

Stopping: SIGINT to the process group the launcher was started in (its own session), as Ctrl-C
would; `tensor-trace record` forwards it to the server's group. After `stop_timeout`, SIGKILL to
every process of the tree (collected from /proc while it was still a tree).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
SHIMS_DIR = HERE / "shims"
TINY_LLAMA = REPO_ROOT / "tests" / "data" / "tiny-llama"
VENV = REPO_ROOT / os.environ.get("SGLANG_VENV", ".venv-sglang")  # an absolute SGLANG_VENV wins
VENV_MARKER = VENV / ".tt-sglang-setup"  # written by setup.sh when the venv is complete

DEFAULT_INPUT_IDS = [1, 2, 3, 4]
EAGLE3_AUX_ARGS = [
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm", "EAGLE3",
    "--return-aux-hidden-state-layer-ids", "0",
]


class ServerError(RuntimeError):
    """The server did not start, answered an error, or could not be stopped."""


def venv_python() -> Path:
    return VENV / "bin" / "python"


def venv_ready() -> tuple[bool, str]:
    """(ready, reason): whether setup.sh has built the SGLang venv."""
    if not venv_python().exists():
        return False, f"{VENV} does not exist: run `bash tests/sglang/setup.sh` (about 2 minutes, 2.8 GB)"
    if not VENV_MARKER.exists():
        return False, f"{VENV} is incomplete (no {VENV_MARKER.name}): rerun `bash tests/sglang/setup.sh`"
    return True, ""


def free_port(low: int = 30000, high: int = 32500) -> int:
    """A free port below the kernel's ephemeral range (32768 up by default), which outgoing
    connections take their ports from: the server binds it about a minute after it is chosen,
    and meanwhile the connections of other servers starting at the same time (gloo, the
    TCPStore) could take an ephemeral one (EADDRINUSE seen with three at once). 30000-32500:
    above SGLang's own choice for its NCCL port (22000-29999), and DP attention's ports (the
    server's + 233 to 240) stay under 32768."""
    for port in random.sample(range(low, high + 1), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(tp: int, port: int, *, model_path: Path | str = TINY_LLAMA, extra_args=(),
                   load_format: str = "dummy", python: Path | str | None = None) -> list[str]:
    return [
        str(python or venv_python()), "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--load-format", load_format,
        "--skip-tokenizer-init",
        "--device", "cpu",
        "--tp", str(tp),
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        "--max-total-tokens", "4096",
        "--disable-custom-all-reduce",
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]


def server_env(tp: int, base: dict | None = None, extra: dict | None = None, standins=()) -> dict:
    """The server's environment. ``standins``: modules of shims/tt_sglang_standins to apply in
    every SGLang process (e.g. ``("wide_dummy",)``), through TT_SGLANG_STANDINS."""
    env = dict(os.environ if base is None else base)
    if standins:
        env["TT_SGLANG_STANDINS"] = ",".join(standins)
    else:
        env.pop("TT_SGLANG_STANDINS", None)
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # else: "No module named 'vllm'" from the rotary embedding
    if tp > 1:
        # One core per rank; without it, an assertion that TP size <= number of NUMA nodes.
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    else:
        env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    # The sgl_kernel stand-in goes on PYTHONPATH (inherited by the spawned TP workers).
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(SHIMS_DIR) + (os.pathsep + old if old else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("VIRTUAL_ENV", None)
    if extra:
        env.update(extra)
    return env


# ---------------------------------------------------------------- /proc helpers (Linux)

def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, starttime) of pid, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def process_tree(root: int) -> dict[int, int]:
    """{pid: starttime} of root and all its descendants."""
    children: dict[int, list[int]] = {}
    info = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st:
            info[pid] = st
            children.setdefault(st[0], []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in info and pid not in tree:
            tree[pid] = info[pid][2]
            todo.extend(children.get(pid, []))
    return tree


def rss_of(pids) -> dict[int, int]:
    """{pid: resident bytes} (VmRSS) of the pids still alive."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return out


# ---------------------------------------------------------------- the server

class SGLangServer:
    """One SGLang server process tree. Use as a context manager, or start()/stop()."""

    def __init__(self, tp: int = 1, *, prefix=(), extra_args=(), env: dict | None = None,
                 port: int | None = None, log_path: str | Path | None = None,
                 startup_timeout: float = 120.0, stop_timeout: float = 30.0,
                 model_path: Path | str = TINY_LLAMA, load_format: str = "dummy",
                 cwd: str | Path | None = None, standins=()):
        self.tp = tp
        self.prefix = [str(p) for p in prefix]
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = self.prefix + server_command(tp, self.port, model_path=model_path, load_format=load_format,
                                                    extra_args=[str(a) for a in extra_args])
        self.env = server_env(tp, extra=env, standins=standins)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"sglang-tp{tp}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.cwd = str(cwd or REPO_ROOT)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.peak_rss: int = 0
        self.exit_code: int | None = None
        self.killed = False
        self.n_processes: int | None = None  # processes of the tree once ready
        self._known: dict[int, int] = {}  # pid -> starttime of every process seen in the tree

    # -- lifecycle

    def start(self) -> "SGLangServer":
        ready, reason = venv_ready()
        if not ready:
            raise ServerError(reason)
        log = open(self.log_path, "wb")
        log.write(("$ " + shlex.join(self.command) + "\n").encode())
        log.flush()
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.n_processes = len(self.pids())
        self.sample_rss()
        return self

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        while True:
            self._remember_tree()
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"SGLang server exited with {code} before it was ready "
                                  f"({time.monotonic() - t0:.1f} s)\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"SGLang server not ready after {self.startup_timeout:.0f} s "
                                  f"(GET {self.base_url}/health)\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> int:
        """SIGINT to the launcher's process group; SIGKILL to the whole tree after stop_timeout."""
        if self.proc is None:
            raise ServerError("not started")
        if self.exit_code is not None:
            return self.exit_code
        self._remember_tree()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline:
            self._remember_tree()
            if self.proc.poll() is not None and not self._alive():
                break
            time.sleep(0.2)
        else:
            self._kill_all()
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.exit_code is None:
            self.stop()

    # -- process tree

    def _remember_tree(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._known.update(process_tree(self.proc.pid))

    def _alive(self) -> list[int]:
        """Processes of the tree still running (same pid and start time; zombies excluded)."""
        alive = []
        for pid, start in self._known.items():
            st = _stat(pid)
            if st and st[2] == start:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if state != "Z":
                    alive.append(pid)
        return alive

    def _kill_all(self) -> None:
        self.killed = True  # stop() had to SIGKILL
        with open(self.log_path, "ab") as log:
            log.write(f"\n[server.py] not stopped after SIGINT + {self.stop_timeout:.0f} s: SIGKILL\n".encode())
        for pid in self._alive():  # only processes of the tree this object started
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        t_end = time.monotonic() + 10
        while self._alive() and time.monotonic() < t_end:
            time.sleep(0.1)

    def pids(self) -> list[int]:
        self._remember_tree()
        return self._alive()

    def sample_rss(self) -> int:
        """Total RSS of the tree now (bytes); also updates peak_rss."""
        total = sum(rss_of(self.pids()).values())
        self.peak_rss = max(self.peak_rss, total)
        return total

    # -- HTTP

    def request(self, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"{'POST' if data else 'GET'} {path} -> HTTP {e.code}: "
                              f"{e.read()[:2000].decode(errors='replace')}\n{self.log_tail(20)}") from None

    def generate(self, input_ids=DEFAULT_INPUT_IDS, max_new_tokens: int = 8, *,
                 return_hidden_states: bool = False, timeout: float = 60.0) -> dict:
        """POST /generate for one prompt; returns that prompt's result (output_ids, meta_info...)."""
        body = {"input_ids": [list(input_ids)],
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        if return_hidden_states:
            body["return_hidden_states"] = True
        out = self.request("/generate", body, timeout=timeout)
        self.sample_rss()
        return out[0] if isinstance(out, list) else out

    # -- logs

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return f"---- last {min(lines, len(text))} lines of {self.log_path} ----\n" + "\n".join(text[-lines:])


def at_once(*calls):
    """Run each call (a function of no arguments, e.g. one that serves a server and returns its
    tokens) in a thread of its own, all started together; their results, in order. A starting
    TP=2 server keeps about one of two cores busy (42 CPU-seconds for the tiny Llama, which is
    up in about 40 s on an idle 2-core machine), so two started together are up well before two
    in a row. Every call ends (its server stopped) before the first exception is raised."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.result() for f in futures]


# ---------------------------------------------------------------- a seeded real checkpoint

# Seed 17: greedy decoding of DEFAULT_INPUT_IDS never meets a near tie (the smallest top-1 minus
# top-2 logit gap over 8 steps is 0.47, logits' std about 4; seed 0 has a 0.007 gap at step 3,
# where TP=1 and TP=2 then part ways in bf16) and never emits eos (id 2).
SEED = 17
# transformers' LlamaForCausalLM (float32) on that checkpoint, greedy, prompt DEFAULT_INPUT_IDS:
SEEDED_REFERENCE_TOKENS = [70, 164, 84, 74, 20, 225, 89, 21]

_CHECKPOINT_SCRIPT = r"""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import save_file

config_path, dest, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
cfg = json.loads(config_path.read_text())
h, inter, nl = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
nh, nkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
hd = cfg.get("head_dim", h // nh)
g = torch.Generator().manual_seed(seed)

def randn(*shape, std):
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).contiguous()

def ones(n):
    return torch.ones(n, dtype=torch.bfloat16)

w = {"model.embed_tokens.weight": randn(vocab, h, std=1.0),
     "model.norm.weight": ones(h),
     "lm_head.weight": randn(vocab, h, std=0.5)}
for i in range(nl):
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = ones(h)
    w[p + "post_attention_layernorm.weight"] = ones(h)
    w[p + "self_attn.q_proj.weight"] = randn(nh * hd, h, std=h ** -0.5)
    w[p + "self_attn.k_proj.weight"] = randn(nkv * hd, h, std=h ** -0.5)
    w[p + "self_attn.v_proj.weight"] = randn(nkv * hd, h, std=h ** -0.5)
    w[p + "self_attn.o_proj.weight"] = randn(h, nh * hd, std=(nh * hd) ** -0.5)
    w[p + "mlp.gate_proj.weight"] = randn(inter, h, std=h ** -0.5)
    w[p + "mlp.up_proj.weight"] = randn(inter, h, std=h ** -0.5)
    w[p + "mlp.down_proj.weight"] = randn(h, inter, std=inter ** -0.5)
dest.mkdir(parents=True, exist_ok=True)
shutil.copyfile(config_path, dest / "config.json")
save_file(w, str(dest / "model.safetensors"), metadata={"format": "pt"})
"""


def make_seeded_checkpoint(dest: Path | str, seed: int = SEED, config: Path | str = TINY_LLAMA / "config.json",
                           python: Path | str | None = None) -> Path:
    """Write config.json + model.safetensors of the tiny Llama with seeded random weights into dest.

    Why not `--load-format dummy` for a TP=1 vs TP=2 comparison: SGLang's dummy loader seeds
    every parameter *as allocated on each rank* (same seed, uniform +-1e-3), so a TP=2 rank's
    shard is not a slice of the TP=1 tensor: the two servers run different models, and with
    +-1e-3 weights every logit is log(1/256) to 1e-6, so the greedy tokens are ties broken by
    rounding noise. These weights (unit norms, 1/sqrt(fan_in) linears) give the same model at
    any TP and logits far apart. Runs in the SGLang venv (it has torch and safetensors).
    """
    dest = Path(dest)
    subprocess.run([str(python or venv_python()), "-c", _CHECKPOINT_SCRIPT, str(config), str(dest), str(seed)],
                   check=True, capture_output=True, timeout=120)
    return dest


def serve_once(tp: int, model_path, log_path, *, prefix=(), standins=(), extra_args=(),
               max_new_tokens: int = 3, flush_s: float = 1.0):
    """Start a server, generate once from DEFAULT_INPUT_IDS, give the ranks' flush threads
    ``flush_s`` to write the last steps before SIGINT, stop it: (output token ids, server)."""
    srv = SGLangServer(tp, model_path=model_path, extra_args=list(extra_args), log_path=log_path,
                       prefix=list(prefix), standins=tuple(standins), startup_timeout=600, stop_timeout=120)
    with srv:
        tokens = output_ids(srv.generate(DEFAULT_INPUT_IDS, max_new_tokens=max_new_tokens))
        time.sleep(flush_s)
    assert not srv.killed, srv.log_tail()
    return tokens, srv


def output_ids(result: dict) -> list[int]:
    """The generated token ids of one /generate result."""
    if "output_ids" in result:
        return list(result["output_ids"])
    raise ServerError(f"no output_ids in {sorted(result)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--aux", action="store_true", help="EAGLE-3 aux hidden-state flags, and ask for hidden states")
    p.add_argument("--prefix", default="", help='wrapper command, e.g. "tensor-trace record -o OUT --"')
    p.add_argument("--log", default=None)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seeded", metavar="DIR", default=None,
                   help="write a seeded real checkpoint into DIR and serve it instead of dummy weights")
    a = p.parse_args(argv)
    model = dict(model_path=make_seeded_checkpoint(a.seeded), load_format="safetensors") if a.seeded else {}
    srv = SGLangServer(a.tp, prefix=shlex.split(a.prefix), extra_args=EAGLE3_AUX_ARGS if a.aux else (),
                       log_path=a.log, **model)
    print(f"log: {srv.log_path}\n$ {shlex.join(srv.command)}", flush=True)
    with srv:
        print(f"ready in {srv.startup_s:.1f} s; {len(srv.pids())} processes, RSS {srv.sample_rss() / 2**30:.2f} GiB")
        t = time.monotonic()
        res = srv.generate(max_new_tokens=a.max_new_tokens, return_hidden_states=a.aux)
        print(f"generate: {time.monotonic() - t:.2f} s, output_ids {output_ids(res)}")
        hs = res.get("meta_info", {}).get("hidden_states")
        if hs is not None:
            print(f"hidden_states: {_shape(hs)}")
        print(f"peak RSS {srv.peak_rss / 2**30:.2f} GiB")
    print(f"exit code {srv.exit_code}")
    return 0


def _shape(x):
    shape = []
    while isinstance(x, list):
        shape.append(len(x))
        x = x[0] if x else None
    return shape


if __name__ == "__main__":
    sys.exit(main())
