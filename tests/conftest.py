"""Shared helpers: launching real training runs (accelerate launch, gloo on CPU) in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml

# Without a GPU, Triton kernels (Liger's loss head) run in Triton's CPU interpreter. Triton reads the switch when
# its modules are imported, so it is set here, before any test imports them; launches inherit it (run_env).
if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist (scripts/test.sh runs the fast tests with -n 2, a worker per core) each worker's torch computes
# on one thread, as launched runs do: two workers of two threads each on 2 cores would contend for every op. Read when
# torch is imported, after this.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600  # a hung collective fails the test instead of stalling CI


CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def base_recipe(model: str, data: str = "data.jsonl") -> dict[str, object]:
    """A small one-stage recipe: 3 steps of 2 x 2 samples, a checkpoint every step, output_dir run/."""
    return {"output_dir": "run", "model": {"name_or_path": model}, "data": {"max_seq_len": 64},
            "stages": [{"name": "only", "data": [data], "max_steps": 3}],
            "train": {"micro_batch_size": 2, "grad_accum": 2},
            "checkpoint": {"save_steps": 1, "keep_last": 3},
            "logging": {"progress_bar": False, "trackers": []}}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The built-in tiny text and vision-language models, built once."""
    from toolkit.builtin.models import TINY_MODEL, TINY_VL_MODEL, materialize_builtin

    cache = tmp_path_factory.mktemp("models")
    return {"text": materialize_builtin(TINY_MODEL, cache), "vl": materialize_builtin(TINY_VL_MODEL, cache)}


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, models: dict[str, str]) -> Path:
    """A folder holding recipe.yaml, data.jsonl and run/ (a finished 3-step run, checkpoints at steps 1-3), trained
    by `python train_curriculum.py --config recipe.yaml` in it. Paths in the recipe are relative: copy the folder
    for a run of its own."""
    root = tmp_path_factory.mktemp("trained")
    write_jsonl(root / "data.jsonl", [CHAT] * 16)
    (root / "recipe.yaml").write_text(yaml.safe_dump(base_recipe(models["text"])))
    proc = subprocess.run([sys.executable, str(REPO / "train_curriculum.py"), "--config", "recipe.yaml"], cwd=root,
                          env=run_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_in_a_terminal() -> None:
    """A child's `preexec_fn`: SIGINT's default disposition, as a terminal gives a command. A suite started with
    SIGINT ignored (`nohup ... &` from a script) passes that on to its children, which then never see a test's
    Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")
    return env


def launch_cmd(strategy: str | Path, num_processes: int | None, *, mixed_precision: str | None = "no",
               extra: list[str] | None = None) -> list[str]:
    """`accelerate launch` of a shipped config (by name) or any config file (a Path). `mixed_precision=None`
    and `num_processes=None` leave the file's values, as a user's launch line does (only the port is always set:
    tests run side by side)."""
    config = strategy if isinstance(strategy, Path) else REPO / "accelerate_configs" / f"{strategy}.yaml"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            *(["--num_processes", str(num_processes)] if num_processes is not None else []),
            *(["--mixed_precision", mixed_precision] if mixed_precision is not None else []),
            "--main_process_port", str(free_port()), *(extra or [])]


def train(strategy: str | Path, num_processes: int | None, out: Path, *overrides: str,
          recipe: str = "recipes/smoke.yaml", mixed_precision: str | None = "no", dummy_samples: int = 64,
          check: bool = True, env: dict[str, str] | None = None, script: Path | None = None
          ) -> subprocess.CompletedProcess:
    """Run train_curriculum.py (or `script`, a wrapper of it) under `accelerate launch` from the repository root;
    return the finished process."""
    cmd = train_cmd(strategy, num_processes, out, *overrides, recipe=recipe, mixed_precision=mixed_precision,
                    dummy_samples=dummy_samples, script=script)
    proc = run_launch(cmd, env=run_env() | (env or {}))
    if check and proc.returncode != 0:
        pytest.fail(f"{strategy} x{num_processes} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc


def train_cmd(strategy: str | Path, num_processes: int | None, out: Path, *overrides: str,
              recipe: str = "recipes/smoke.yaml", mixed_precision: str | None = "no",
              dummy_samples: int = 64, rank_logs: Path | None = None, script: Path | None = None) -> list[str]:
    """`rank_logs`: the launcher also writes each rank's own stdout/stderr under that folder (see `rank_stderr`).
    `script`: another entry point than train_curriculum.py (a test's wrapper of it)."""
    extra = ["--log_dir", str(rank_logs), "--tee", "3"] if rank_logs is not None else None
    return [*launch_cmd(strategy, num_processes, mixed_precision=mixed_precision, extra=extra),
            str(script or REPO / "train_curriculum.py"),
            *dummy_run_args(f"output_dir={out}", *overrides, recipe=recipe, dummy_samples=dummy_samples)]


def dummy_run_args(*overrides: str, recipe: str = "recipes/smoke.yaml", dummy_samples: int = 64) -> list[str]:
    """train_curriculum.py's arguments for `recipe` on generated data (what `train` launches; `relaunch` takes
    them as they are)."""
    return ["--config", recipe, "--create_dummy_data", "--num_dummy_samples", str(dummy_samples), *overrides]


def rank_stderr(rank_logs: Path, local_rank: int) -> str:
    """What one rank wrote to stderr, of a launch with `train_cmd(..., rank_logs=...)`."""
    found = sorted(rank_logs.glob(f"*/attempt_*/{local_rank}/stderr.log"))
    assert len(found) == 1, found
    return found[0].read_text()


def toolkit_lines(stderr: str) -> list[str]:
    """The lines of a rank's stderr that the toolkit wrote (its log records and its `error:` lines)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ") or
            (len(line) > 9 and line[2] == ":" and line[5] == ":" and line[8] == " ")]


def kill_rank(launcher: subprocess.Popen, rank: int) -> int:
    """SIGKILL one training process of a launch (as the out-of-memory killer would); returns its pid. Its
    DataLoader workers (forked from it: the same environment) are not it."""
    ranks = []
    for p in psutil.Process(launcher.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if p.environ().get("RANK") == str(rank) and p.environ().get("LOCAL_RANK") is not None:
                ranks.append(p)
    for p in ranks:
        if p.ppid() not in {q.pid for q in ranks}:
            p.kill()
            return p.pid
    raise AssertionError(f"no process of rank {rank} under the launcher {launcher.pid}")


def last_logged_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


# The 3-stage smoke curriculum (LoRA, then only model.norm, then both; mixture, paced easy_to_hard, short_to_long)
# with a checkpoint after each of its 11 steps, all kept. The single process trains the same global batches.
CURRICULUM = "recipes/smoke_curriculum.yaml"
CURRICULUM_STEPS = 11
EVERY_CHECKPOINT = ("checkpoint.save_steps=1", f"checkpoint.keep_last={CURRICULUM_STEPS}")
SINGLE_CURRICULUM = ("train.micro_batch_size=4", "stages.2.micro_batch_size=2")
# Answers train without Qwen3's empty think block. The built-in tiny Qwen3 carries Qwen3's template (issue 30), and
# trained with its think blocks the random model collapses onto their newlines within a few steps: every generation
# eval completes to "\n\n\n\n\n\n", and equal completions across strategies would prove nothing. Without them the
# rendering is token for token the ChatML that tests/assets/curriculum_losses.json was recorded with.
NO_THINK = ("data.thinking=none",)
# The curriculum runs of the strategy matrix also run a generation eval (at steps 4, 8 and 11): nine prompts in
# batches of 4, 4 and 1, so two ranks hold 8 and 1 prompts in 2 and 1 batches; the model, trained on arithmetic,
# answers them with varied junk. Launched through tests/helpers/spy_generation.py, which counts each rank's collectives
# inside generation (its counts: SPY_DIR of the run). The resumes of tests/e2e/test_resume.py run without it: their
# bit-exact match with these runs shows that evaluating leaves training untouched.
GENERATION = ("eval.every_steps=4", "eval.generation=[{name: facts, data: [dummy:facts_eval], scorers: [exact], "
              "max_new_tokens: 6, batch_size: 4}]")
SPY = REPO / "tests" / "helpers" / "spy_generation.py"


def cpu_kernel_family() -> str:
    """The key of this machine's record in tests/assets/curriculum_losses.json: torch's CPU capability (the vector
    width of its kernels), with "+AMX" on a CPU that has Intel's AMX tiles. The AVX-512 machines CI ran on changed
    on 2026-11-29 from ones without AMX to ones with it (Sapphire Rapids class), and the fp32 GEMMs of torch's
    BLAS there sum in another order: the last bits of a few losses moved with no change of the code (main ff08385,
    which CI had passed, gave the new values on the new machine)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    with contextlib.suppress(OSError):
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "").split()
        if "amx_tile" in flags:
            return f"{capability}+AMX"
    return capability


def spy_dir(run: Path) -> Path:
    """Where tests/helpers/spy_generation.py wrote the per-rank counts of a curriculum run."""
    return run.parent / f"{run.name}-spy"


def processes_for(strategy: str) -> int:
    return 1 if strategy == "single" else 2


def curriculum_args(strategy: str) -> tuple[str, ...]:
    """The overrides of a curriculum run under `strategy` (fp32, 2 processes, or 1 with the same batches). Under
    Ulysses (`*_sp2`) the 2 processes are one data-parallel replica: they take the single process's batches."""
    one_replica = strategy == "single" or strategy.endswith("_sp2")
    return (*(SINGLE_CURRICULUM if one_replica else ()), *EVERY_CHECKPOINT, *NO_THINK)


@pytest.fixture(scope="session")
def deepspeed_comm_op() -> Path:
    """The folder of DeepSpeed's shared-memory comm op in torch's default extensions folder, built there first if
    missing (about 40 s on 2 cores), as the suite's first DeepSpeed launch would build it. Linux only (DeepSpeed's
    platform here; its one user is skipped elsewhere)."""
    from torch.utils.cpp_extension import get_default_build_root

    env = {k: v for k, v in run_env().items() if k != "TORCH_EXTENSIONS_DIR"}
    proc = subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / \
        "deepspeed_shm_comm"
    assert folder.is_dir(), f"{folder} was not built:\n{proc.stdout[-2000:]}"
    return folder


def launched_once(tmp_path_factory: pytest.TempPathFactory, name: str,
                  launch: Callable[[str, Path], object]) -> Callable[[str], Path]:
    """`get(key)`: the folder of the run `launch(key, folder)` makes, launched the first time a test asks for it
    and shared by every later one (a fixture's memo: one reference run per key, however many tests compare with
    it)."""
    root, done = tmp_path_factory.mktemp(name), set()

    def get(key: str) -> Path:
        if key not in done:
            launch(key, root / key)
            done.add(key)
        return root / key

    return get


@pytest.fixture(scope="session")
def curriculum_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`get(strategy)`: the fp32 curriculum run under `strategy`, launched once per session and shared by the
    strategy matrix (same losses as one process, freezing, golden values, generation evals) and the exact-resume
    test (resumes from each of its checkpoints)."""
    def launch(strategy: str, out: Path) -> None:
        train(strategy, processes_for(strategy), out, *curriculum_args(strategy), *GENERATION,
              recipe=CURRICULUM, script=SPY, env={"SPY_GENERATION_DIR": str(spy_dir(out))})

    return launched_once(tmp_path_factory, "curriculum", launch)


BF16_BASE = "model.dtype=bfloat16"
"""The base model in bf16, as `model.dtype: auto` loads it on a GPU (the adapters and a trained norm stay fp32)."""


@pytest.fixture(scope="session")
def bf16_curriculum_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`get(strategy)`: the curriculum as a user launches it: the shipped config's own precision (bf16; only
    `--num_processes 2` added, nothing for one process), a bf16 base, a checkpoint after every step. Shared by the
    bf16 strategy matrix (tests/e2e/test_strategies.py) and the bf16 exact resume (tests/e2e/test_resume.py); the
    launch's output is kept beside the run, in `<run>.log`."""
    def launch(strategy: str, out: Path) -> None:
        proc = train(strategy, None if strategy == "single" else 2, out, *curriculum_args(strategy), BF16_BASE,
                     recipe=CURRICULUM, mixed_precision=None)
        out.with_suffix(".log").write_text(proc.stdout + proc.stderr)

    return launched_once(tmp_path_factory, "curriculum-bf16", launch)


class _Relauncher:
    """tests/helpers/relaunch.py --serve: one parent that imported everything, for the whole session (started on first
    use,
    ended with the session or after a job that did not answer in time)."""

    proc: subprocess.Popen | None = None
    log: Path | None = None
    unread = b""  # output read past the last line taken

    @classmethod
    def ask(cls, jobs: Path, timeout: float) -> list[int]:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.log = jobs.parent / f"relaunch-{os.getpid()}-{time.monotonic_ns()}.log"
            with cls.log.open("w") as log:
                server = [sys.executable, str(REPO / "tests" / "helpers" / "relaunch.py"), "--serve"]
                cls.proc = subprocess.Popen(server, cwd=REPO, env=run_env(), stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
            cls.unread = b""
        proc = cls.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{jobs}\n".encode())
        proc.stdin.flush()
        deadline, mark = time.monotonic() + timeout, b"relaunch-codes: "
        while True:
            while b"\n" in cls.unread:  # lines as os.read gave them (a buffered reader would hide them from select)
                line, cls.unread = cls.unread.split(b"\n", 1)
                if not line.startswith(mark):
                    continue
                reply = json.loads(line.removeprefix(mark))
                if reply["jobs"] != str(jobs):  # the late answer to an earlier test's jobs (it timed out)
                    continue
                assert "codes" in reply, f"{reply['error']}:\n{cls.log.read_text()[-6000:] if cls.log else ''}"
                return reply["codes"]
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(proc.stdout.fileno(), 1 << 16) if ready else None
            if not chunk:  # no answer in time, or the parent died: the next job gets a new one
                cls.close(kill=True)
                log = cls.log.read_text()[-6000:] if cls.log is not None else ""
                pytest.fail(f"the relauncher {'did not answer in time' if chunk is None else 'died'}:\n{log}")
            cls.unread += chunk

    @classmethod
    def close(cls, kill: bool = False) -> None:
        proc, cls.proc = cls.proc, None
        if proc is None:
            return
        if kill:
            dump_stacks_and_kill(proc.pid)
            proc.wait()
        else:  # it ends at the end of its input; the session need not wait for its interpreter's teardown
            assert proc.stdin is not None
            proc.stdin.close()


@pytest.fixture(scope="session", autouse=True)
def _end_the_relauncher() -> Iterator[None]:
    yield
    _Relauncher.close()


def relaunch(strategy: str | Path, runs: list[tuple[list[str], Path]], *, mixed_precision: str | None = "no",
             num_processes: int | None = None, env: dict[str, str] | None = None, entry: str = "train") -> list[int]:
    """Run `train_curriculum.py ARGV` once per (argv, log) as `accelerate launch` of `strategy`'s config would
    (`num_processes`: processes_for's by default), each run in fresh processes forked from one parent that
    imported everything once, kept for the session (tests/helpers/relaunch.py says why); returns the exit codes. Each
    run's output (all ranks) is in its log. `mixed_precision` None: the config file's. `env`: added to the ranks'
    environment. `entry` "toolkit": `toolkit ARGV` instead (as `accelerate launch -m toolkit ARGV` runs it)."""
    jobs = runs[0][1].parent / f"jobs-{os.getpid()}-{time.monotonic_ns()}.json"
    jobs.write_text(json.dumps({
        "launch": ["--config_file", str(strategy if isinstance(strategy, Path) else
                                        REPO / "accelerate_configs" / f"{strategy}.yaml"),
                   "--num_processes", str(num_processes or processes_for(str(strategy))),
                   *(["--mixed_precision", mixed_precision] if mixed_precision is not None else [])],
        "runs": [{"argv": argv, "log": str(log)} for argv, log in runs], "env": env or {},
        "timeout": LAUNCH_TIMEOUT_S, "entry": entry}))
    return _Relauncher.ask(jobs, timeout=LAUNCH_TIMEOUT_S + 60 * len(runs))


def train_forked(strategy: str | Path, num_processes: int, out: Path, *overrides: str,
                 recipe: str = "recipes/smoke.yaml",
                 mixed_precision: str | None = "no", dummy_samples: int = 64, check: bool = True,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`train`'s run through `relaunch`: the same run, without the ~10 s of imports per process a launch spends
    first. For runs whose test is about what trains, not about the launcher: the result's stderr is the
    run's whole output (every rank's stdout and stderr, in `<out>.log`), its stdout empty."""
    log = out.with_name(f"{out.name}.log")
    argv = dummy_run_args(f"output_dir={out}", *overrides, recipe=recipe, dummy_samples=dummy_samples)
    (code,) = relaunch(strategy, [(argv, log)], mixed_precision=mixed_precision, num_processes=num_processes,
                       env=env)
    output = log.read_text()
    if check and code != 0:
        pytest.fail(f"{strategy} (forked) failed (rc={code}):\n{output[-6000:]}")
    return subprocess.CompletedProcess(argv, code, "", output)


_hung_launches: list[str] = []
MAX_HUNG_LAUNCHES = 2  # then the suite stops: a hang that repeats would spend CI's whole time limit, unreported


def run_launch(cmd: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None,
               timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` for a launch, where a timeout fails the test with each
    process's Python stack (where it hung) and kills the launcher *and its ranks*: subprocess.run would kill the
    launcher alone, and the orphaned ranks would keep their memory, and any lock they hold, for the session."""
    with subprocess.Popen(cmd, cwd=cwd, env=env or run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            dump_stacks_and_kill(proc.pid)
            out, err = proc.communicate()
            _hung_launches.append(" ".join(map(str, cmd)))
            report = f"did not end in {timeout} s: {_hung_launches[-1]}\n{out[-3000:]}\n{err[-12000:]}"
            if len(_hung_launches) >= MAX_HUNG_LAUNCHES:
                pytest.exit(f"{len(_hung_launches)} launches hung; the last one:\n{report}", returncode=1)
            pytest.fail(report)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def dump_stacks_and_kill(pid: int) -> None:
    """SIGABRT to the processes under a launcher (run_env sets PYTHONFAULTHANDLER: each prints its threads' Python
    stacks to the captured stderr), then SIGKILL to all of them."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGABRT)
    time.sleep(3)
    signal_tree(pid, signal.SIGKILL)


def start_and_signal(cmd: list[str], out: Path, at_step: int, sig: int, timeout: float = LAUNCH_TIMEOUT_S,
                     rank: int | None = None) -> subprocess.Popen:
    """Start a run in its own process group; once it logged `at_step`, send `sig` to the whole group (SIGKILL:
    to every process of the launch), or SIGKILL the training process of `rank` alone."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=as_in_a_terminal)
    wait_until(f"step {at_step}", lambda: last_logged_step(out) >= at_step, proc, timeout)
    if rank is not None:
        kill_rank(proc, rank)
    else:
        signal_tree(proc.pid, sig)
    return proc


def wait_until(what: str, condition: Callable[[], object], proc: subprocess.Popen,
               timeout: float = LAUNCH_TIMEOUT_S) -> None:
    """Poll `condition` until it holds; fail (the launch killed, its output shown when piped) if the launch ends or
    `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            output = proc.stdout.read()[-4000:] if proc.stdout is not None else ""
            pytest.fail(f"the run ended (rc={proc.returncode}) before {what}:\n{output}")
        if time.monotonic() > deadline:
            signal_tree(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {what} after {timeout} s")
        time.sleep(0.05)


def signal_tree(pid: int, sig: int) -> None:
    """Signal a launcher and every process under it: torch elastic starts each rank in its own session, so
    a process-group kill would leave the ranks running."""
    root = psutil.Process(pid)
    for p in [*root.children(recursive=True), root] if sig == signal.SIGKILL else [root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch computes on one thread in this process, as launched runs do (run_env): on a small busy machine, more
    threads than free cores make a tiny model many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TEMPLATES = REPO / "toolkit" / "chat_templates"


def stock_template(name: str) -> str:
    """A stock Qwen chat template as the package ships it (toolkit/chat_templates/NAME.jinja; sources in its
    README), read from the file rather than through the toolkit's name lookup that tests check."""
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5/Qwen3 tokenizer, built offline once per session (no chat template set)."""
    from toolkit.builtin.text_model import build_qwen_tokenizer

    return build_qwen_tokenizer()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer) -> Path:
    """A local "Qwen3 checkpoint": tiny random Qwen3 with the real 151,936-row vocabulary, the real tokenizer and
    Qwen3's stock chat template, saved with save_pretrained (load it with from_pretrained)."""
    import copy

    from toolkit.builtin.text_model import write_tiny_qwen3

    tok = copy.deepcopy(qwen_tokenizer)
    tok.chat_template = stock_template("qwen3")
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-real", tokenizer=tok, hidden_size=16,
                            num_heads=2, num_kv_heads=1, intermediate_size=32)


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 64k, 2m) at `path`, unmounted afterwards: a disk that fills up, or
    is remounted read-only (`remount_read_only`). Skips the test, with the reason, where mounting is not allowed
    (not root, no CAP_SYS_ADMIN in a container)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"needs a small tmpfs (mount -t tmpfs as root): {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path: Path) -> None:
    """Make a `mounted_tmpfs` read-only (root can write through permissions, not through a read-only mount)."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
