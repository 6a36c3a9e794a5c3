"""Many relaunches of train_curriculum.py for the price of one import: fresh processes forked from a loaded parent.

    python tests/helpers/relaunch.py JOBS.json      # one jobs file
    python tests/helpers/relaunch.py --serve        # a jobs file's path per line on stdin, for the whole test session

JOBS.json: {"launch": [accelerate launch options, e.g. "--config_file", F, "--num_processes", "2"],
            "runs": [{"argv": [train_curriculum.py arguments], "log": "path/for/output"}, ...],
            "env": {extra environment of the ranks (optional)}, "timeout": seconds per run,
            "entry": "train" (default) or "toolkit": the `toolkit` command's main, as `accelerate launch -m toolkit`}
Prints one JSON line per jobs file, after REPLY_MARK: the exit code of each run (the first non-zero rank's, else 0),
and when serving the jobs file's path (a test stopped by its timeout leaves its reply to come, for no one).

Why: the exact-resume test resumes every checkpoint of a curriculum under every strategy, dozens of launches. A
real launch spends ~10 s importing torch, transformers and DeepSpeed per process before training for a second.
Here the parent imports them once, and for each run forks one child per rank, as `accelerate launch` would start
them: each child is a new process that has run nothing but those imports, with the environment accelerate gives
its ranks (accelerate's own launch code computes it: `torch.distributed.run` is stopped at its door and handed
over), its own rank variables and a fresh rendezvous port. Each child then runs `train_curriculum.main(argv)`
and exits as the script does. Nothing of one run survives into the next: every run's accelerator, model,
optimizer, engine and process group are built by a process that did not exist before it.

`--serve` (tests/conftest.py's `relaunch`) keeps one such parent for the whole test session: the suite's many
relaunching tests (every strategy's resumes, short single-process runs) pay the imports once, not once per test.
Between jobs the parent only computes the next launch's environment (accelerate's code, its changes to this
process's environment undone) and forks.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class _Captured(Exception):  # a control-flow signal, not an error
    def __init__(self, env: dict[str, str], processes: int) -> None:
        super().__init__("captured")
        self.env, self.processes = env, processes


def rank_environment(launch: list[str]) -> tuple[dict[str, str], int]:
    """The environment `accelerate launch LAUNCH train_curriculum.py` gives its ranks (before the per-rank
    variables), and the number of processes: accelerate's own `launch_command` runs until it would start them."""
    import subprocess

    import torch.distributed.run as distrib_run
    from accelerate.commands import launch as accelerate_launch

    def stop_run(args: Any) -> None:  # multi-process launchers: torchrun's entry, inside accelerate's env patch
        raise _Captured(dict(os.environ), int(args.nproc_per_node))

    def stop_popen(cmd: list[str], env: dict[str, str] | None = None, **_: Any) -> None:  # the simple launcher
        raise _Captured(dict(env or os.environ), 1)

    args = accelerate_launch.launch_command_parser().parse_args([*launch, str(REPO / "train_curriculum.py")])
    saved, environ = (distrib_run.run, subprocess.Popen), dict(os.environ)
    distrib_run.run, subprocess.Popen = stop_run, stop_popen  # type: ignore[assignment]
    try:
        accelerate_launch.launch_command(args)
    except _Captured as c:
        return c.env, c.processes
    finally:
        distrib_run.run, subprocess.Popen = saved  # type: ignore[assignment]
        os.environ.clear()  # a served parent computes the next launch's environment from the same start
        os.environ.update(environ)
    raise RuntimeError(f"accelerate launch {launch} started no process")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(env: dict[str, str], rank: int, world: int, port: int, argv: list[str], log: Path,
          entry: str = "train") -> None:
    """One rank: the launched environment, output to `log`, then the script's own main (`entry` "toolkit": the
    `toolkit` command's, as `python -m toolkit` runs it) and exit."""
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A launched rank's torch reads OMP_NUM_THREADS (accelerate sets 1) when it is imported; this child's torch was
    # imported by the parent, with its own thread count. Sums split over other thread counts round differently (the
    # tiny Qwen-VL's resumed losses differed in the last bit from the launched run's), so set the launched one.
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    fd = os.open(log.with_name(f"{log.name}.rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [str(REPO / "train_curriculum.py"), *argv]
    code = 1
    try:
        import train_curriculum
        from toolkit.commands import cli
        from toolkit.runtime import process as distributed

        distributed.exit_without_teardown((cli.main if entry == "toolkit" else train_curriculum.main)(argv))
    except BaseException:  # a child must never return into the parent's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def run_one(env: dict[str, str], world: int, argv: list[str], log: Path, timeout: float, entry: str = "train") -> int:
    """Fork the ranks of one run, wait for all of them; a rank that fails ends the others (as torchrun does)."""
    port, pids = free_port(), []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            child(env, rank, world, port, argv, log, entry)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(c != 0 for c in codes.values())
        if failed or time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if not failed:
                return 124
        time.sleep(0.05)
    with log.open("w") as out:
        for rank in range(world):
            part = log.with_name(f"{log.name}.rank{rank}")
            out.write(f"--- rank {rank} ---\n{part.read_text(errors='replace')}")
            part.unlink()
    return next((codes[pid] for pid in pids if codes[pid] != 0), 0)


def warm_deepspeed() -> None:
    """What every DeepSpeed launch repeats and no run's result depends on, done once here for all the children: the
    CPU's description (py-cpuinfo starts a Python subprocess for it, about 1.3 s, three times in a launch with CPU
    Adam) and the import of DeepSpeed's Muon optimizer module (its optimizer check imports torch's inductor, about
    2 s). A resume under ZeRO-3 offload took about 11 s, 6 of them these."""
    import cpuinfo

    info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: info  # DeepSpeed imports it at each call
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


# What every run imports lazily, after `import train_curriculum` (measured 2026-11-27: a forked ZeRO-3 resume imported
# 790 modules, about 5 s of its 7): pyarrow's numpy conversions import pandas, the trackers TensorBoard, DeepSpeed's
# comm op torch's extension builder (and setuptools), the model its transformers modeling module; `datasets` comes in
# through accelerate and pyarrow. Imported once here, each child starts with them, as it starts with torch.
PRELOAD = ("pandas", "pyarrow", "datasets", "tensorboard", "torch.utils.tensorboard", "torch.utils.cpp_extension",
           "deepspeed.ops.op_builder.all_ops", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.qwen3_vl.modeling_qwen3_vl")


def preload() -> None:
    import importlib
    import importlib.util

    for name in PRELOAD:  # those installed: DeepSpeed is an extra
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)


REPLY_MARK = "relaunch-codes: "
_warmed: list[bool] = []
_preloaded: list[bool] = []


def run_jobs(path: Path) -> list[int]:
    """Every run of one jobs file, one after another; their exit codes."""
    jobs = json.loads(path.read_text())
    env, world = rank_environment(jobs["launch"])
    env.update(jobs.get("env") or {})
    import train_curriculum  # noqa: F401 - loaded once here; every child starts with it imported

    if not _preloaded:
        preload()
        _preloaded.append(True)
    if env.get("ACCELERATE_USE_DEEPSPEED") == "true" and not _warmed:
        warm_deepspeed()
        _warmed.append(True)
    if threading.active_count() != 1:  # forking a process with threads would copy locks held by them
        raise RuntimeError(f"{threading.active_count()} threads before fork: {threading.enumerate()}")
    # The parent's objects (everything imported) out of the children's garbage collections: DeepSpeed's ZeRO-3
    # calls gc.collect() while it builds its partitions, which walked all of them (2.6 s a resume), and a walk
    # writes to each object's page, copying it from the parent. Only what the parent holds is frozen; a child's
    # own objects are collected as in any process.
    gc.freeze()
    return [run_one(env, world, run["argv"], Path(run["log"]), jobs.get("timeout", 600), jobs.get("entry", "train"))
            for run in jobs["runs"]]


def main() -> None:
    if sys.argv[1] != "--serve":
        print(REPLY_MARK + json.dumps({"codes": run_jobs(Path(sys.argv[1]))}))
        return
    for line in sys.stdin:  # until the session closes the pipe
        try:
            reply = {"codes": run_jobs(Path(line.strip()))}
        except Exception as e:  # the session's test fails with it; the parent serves the next one
            import traceback

            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(REPLY_MARK + json.dumps({"jobs": line.strip(), **reply}), flush=True)


if __name__ == "__main__":
    main()
