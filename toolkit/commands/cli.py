"""The `toolkit` command: helpers around training runs (`toolkit --help`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from toolkit.atomic import build_dir, not_ours, refuse_not_ours
from toolkit.errors import ToolkitError, as_terminal_text, out_of_space
from toolkit.runtime.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Stopped

TINY_MODEL_MARKER = ".toolkit-tiny-model.json"
DUMMY_DATA_MARKER = ".toolkit-dummy-data.json"
"""Written into every `tiny-model` / `dummy-data` output: a folder holding one may be replaced by the same command."""


def _write_out(out: Path, marker: str, what: str, write: Callable[[Path], object], *, files: str,
               overwrite: bool) -> None:
    """Build the folder at --out as export does (toolkit/atomic.py build_dir), after export's rule: --out is new,
    empty, an earlier output of this command (it holds `marker`), or --overwrite was given; else one line naming
    what is there. The folder swapped out is checked again before it is deleted."""
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"--out {out} is a file; name a folder for the {files}.")

    def check(folder: Path) -> None:
        if not overwrite:
            refuse_not_ours(out, not_ours(folder, marker=marker), label="--out", what=what,
                            then="its files would be replaced", fix="Choose a new folder, or pass --overwrite to "
                            "replace it.")

    check(out)

    def build(tmp: Path) -> None:
        write(tmp)
        (tmp / marker).write_text("{}\n")

    build_dir(out.resolve(), build, check_replaced=check)


def _dummy_data(args: argparse.Namespace) -> None:
    from toolkit.builtin.dummy_data import write_dummy_data, write_dummy_pairs

    if args.num_samples < 1:
        raise ToolkitError(f"--num-samples must be at least 1, got {args.num_samples}.")
    out = Path(args.out)

    def write(tmp: Path) -> None:
        write_dummy_data(tmp, args.num_samples, seed=args.seed)
        write_dummy_pairs(tmp, args.num_samples, seed=args.seed)  # a preference stage's (objective: dpo)

    _write_out(out, DUMMY_DATA_MARKER, "an earlier dummy-data output", write, files="dummy data files",
               overwrite=args.overwrite)
    for name in ("stage1", "stage2", "pairs"):
        print(f"{name}: {out / f'{name}.jsonl'}")


def _tiny_model(args: argparse.Namespace) -> None:
    from toolkit.builtin.text_model import write_tiny_qwen3

    out = Path(args.out)
    _write_out(out, TINY_MODEL_MARKER, "an earlier tiny-model output",
               lambda tmp: write_tiny_qwen3(tmp, num_layers=args.layers, hidden_size=args.hidden, seed=args.seed),
               files="model", overwrite=args.overwrite)
    print(out)


def _export(args: argparse.Namespace) -> None:
    if args.push_to_hub is None and args.private:
        raise ToolkitError("--private is for --push-to-hub: name the repo to create (--push-to-hub USER/NAME).")
    if args.push_to_hub is None and args.push_extra:
        raise ToolkitError("--push-extra is for --push-to-hub: it names a file of final/ to upload too.")
    if args.push_to_hub is None and args.out is None:
        raise ToolkitError("toolkit export needs --out DIR (the folder to write), or --push-to-hub REPO.")
    from toolkit.commands.export import export, push_to_hub

    if args.push_to_hub is not None:
        print(push_to_hub(args.source, args.push_to_hub, out=args.out, merge=args.merge, private=args.private,
                          overwrite=args.overwrite, trust_remote_code=args.trust_remote_code,
                          extra=args.push_extra))
    else:
        print(export(args.source, args.out, merge=args.merge, overwrite=args.overwrite,
                     trust_remote_code=args.trust_remote_code))


def _preflight(args: argparse.Namespace) -> None:
    from toolkit.commands.preflight import preflight
    from toolkit.commands.train import find_config, launch_root
    from toolkit.config.load import load_recipe

    recipe = load_recipe(args.config, args.overrides)
    print(preflight(recipe, find_config(args.accelerate_config, launch_root()), num_gpus=args.num_gpus,
                    gpu_memory_gb=args.gpu_memory_gb, scan_data=not args.no_data))


def _inspect_data(args: argparse.Namespace) -> None:
    from toolkit.commands.inspect_data import inspect_data, inspect_file
    from toolkit.config.load import load_recipe

    words = args.overrides
    if args.config is None and words and "=" not in words[0]:  # `toolkit inspect-data FILE`: no recipe
        print(inspect_file(words[0], words[1:], rows=2 if args.rows is None else args.rows,
                           save_frames=args.save_frames))
        return
    print(inspect_data(load_recipe(args.config, words), stage=args.stage, rows=3 if args.rows is None else args.rows,
                       save_frames=args.save_frames))


def _score(args: argparse.Namespace) -> None:
    import logging

    from toolkit.commands.score import score
    from toolkit.config.load import load_recipe

    # The pass's progress (rows/s, ETA) and what it builds, on stderr as training logs them: rank 0's, under a launch.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.WARNING)
    logging.getLogger("toolkit").setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    report = score(load_recipe(args.config, args.overrides), stage=args.stage,
                   out=None if args.out is None else Path(args.out), dummy_samples=args.num_dummy_samples)
    if report is not None:  # rank 0's, under a launch
        print(report)


def _plot(args: argparse.Namespace) -> None:
    from toolkit.evals.forgetting import plot_forgetting
    from toolkit.metrics.plot import plot_run

    print(plot_run(args.output_dir))
    matrix = plot_forgetting(args.output_dir)  # with eval.all_stages: the forgetting matrix's heatmap beside it
    if matrix is not None:
        print(matrix)


def _report(args: argparse.Namespace) -> None:
    from toolkit.metrics.report import report

    print(report(args.runs, args.out))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolkit", description="Curriculum fine-tuning toolkit.")
    sub = parser.add_subparsers(dest="command", required=True)

    # Parsed by toolkit/commands/train.py (`main` hands it the arguments): listed here for `toolkit --help`.
    sub.add_parser("train", add_help=False, help="Print the canonical `accelerate launch ... train_curriculum.py` "
                   "line of a run and run it: toolkit train --config R [--accelerate-config NAME|PATH] [--dry-run] "
                   "[overrides] [-- accelerate args] (toolkit train --help).")

    p = sub.add_parser("dummy-data", help="Write deterministic dummy chat JSONL files (stage1, stage2).")
    p.add_argument("--out", required=True, help="Output directory: new, empty, or an earlier dummy-data output.")
    p.add_argument("--num-samples", type=int, default=256, help="Rows per file.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="Allow --out to be a non-empty folder that is not an "
                   "earlier dummy-data output (it is replaced).")
    p.set_defaults(func=_dummy_data)

    p = sub.add_parser("tiny-model", help="Write a tiny random Qwen3 with a small trained tokenizer and "
                       "Qwen3's chat template (no network).")
    p.add_argument("--out", required=True, help="Output directory (loadable with from_pretrained): new, empty, or an "
                   "earlier tiny-model output.")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="Allow --out to be a non-empty folder that is not an "
                   "earlier tiny-model output (it is replaced).")
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("export", help="Export a checkpoint or run as a PEFT adapter, or a merged model (--merge).")
    p.add_argument("source", help="<output_dir>, <output_dir>/checkpoints/step-N or <output_dir>/final.")
    p.add_argument("--out", help="Directory to write (required unless --push-to-hub): new, empty, or an earlier "
                   "export. The export "
                   "is built beside it and swapped in when complete: in one atomic step on Linux (renameat2 "
                   "RENAME_EXCHANGE); where that is unsupported the earlier export is moved aside first, and a crash "
                   "between the two renames leaves it beside --out as .<name>.old-*.")
    p.add_argument("--merge", action="store_true", help="Merge LoRA into the base weights (plain safetensors).")
    p.add_argument("--overwrite", action="store_true", help="Allow --out to be a non-empty folder that is not an "
                   "earlier export (never the source or a folder holding it).")
    p.add_argument("--trust-remote-code", action="store_true", help="Allow the model's own Python code to run, "
                   "for runs whose recipe sets model.trust_remote_code.")
    p.add_argument("--push-to-hub", metavar="REPO", help="Upload to this Hugging Face Hub repo (USER/NAME, created "
                   "if missing): final/ as it is, verified first, with its model card; with --merge, a "
                   "checkpoint or --out, the export, written to --out or a temporary folder. Login: `hf auth login` "
                   "or HF_TOKEN.")
    p.add_argument("--private", action="store_true", help="With --push-to-hub: create the repo private.")
    p.add_argument("--push-extra", action="append", default=[], metavar="FILE", help="With --push-to-hub of a "
                   "run's final/: also upload this file of final/ (repeatable). Without it, push uploads exactly "
                   "the files final/checksums.json records and the model card, and refuses anything else there.")
    p.set_defaults(func=_export)

    p = sub.add_parser("preflight", help="Per-GPU memory estimate for every strategy, and a scan of the data.")
    p.add_argument("--config", help="Recipe YAML (default: the embedded demo recipe).")
    p.add_argument("--accelerate-config", default="zero3", help="Launch config to assess: a shipped config by name "
                   "(as toolkit train takes it; default zero3) or an accelerate config file.")
    p.add_argument("--num-gpus", type=int, help="GPUs in the job (default: num_processes of the launch config).")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="Memory per GPU, GiB.")
    p.add_argument("--no-data", action="store_true", help="Skip the data scan.")
    p.add_argument("overrides", nargs="*", help="Recipe overrides, key.sub=value.")
    p.set_defaults(func=_preflight)

    p = sub.add_parser("inspect-data", help="Show rows as training tokenises them (trained tokens marked) and each "
                       "stage's token statistics; `inspect-data FILE` (no recipe) detects the file's shape and "
                       "prints the data entry that trains it.")
    p.add_argument("--config", help="Recipe YAML (default: the embedded demo recipe).")
    p.add_argument("--stage", help="Only this stage (default: every stage).")
    p.add_argument("--rows", type=int, help="Rows to print per stage (default 3; 2 for a FILE).")
    p.add_argument("--save-frames", type=Path, metavar="DIR", help="Write the frames of the video rows shown, as "
                   "the model sees them (sampled and resized), to DIR as PNGs.")
    p.add_argument("overrides", nargs="*", help="A data FILE (without --config), then recipe overrides, "
                   "key.sub=value.")
    p.set_defaults(func=_inspect_data)

    p = sub.add_parser("score", help="Score a stage's rows with the recipe's model before training (loss, "
                       "perplexity or ifd): a histogram, the easiest and hardest rows, every row's score in parquet; "
                       "the scores training takes are kept for it. Under `accelerate launch --config_file C -m "
                       "toolkit score ...` the pass runs under that config's strategy, the rows shared by the ranks.")
    p.add_argument("--config", help="Recipe YAML (default: the embedded demo recipe).")
    p.add_argument("--stage", help="The stage (default: the first one a model orders, else the first).")
    p.add_argument("--out", help="The parquet file to write (default <output_dir>/scores/<stage>.parquet).")
    p.add_argument("--num-dummy-samples", type=int, default=256, help="Rows per generated file of a recipe on "
                   "dummy: data (train_curriculum.py's --num_dummy_samples: the same rows, the scores it reads).")
    p.add_argument("overrides", nargs="*", help="Recipe overrides, key.sub=value.")
    p.set_defaults(func=_score)

    p = sub.add_parser("plot", help="Write <output_dir>/training.png (loss, eval loss, LR, tokens/s by stage) and, "
                       "with eval.all_stages, forgetting.png (the forgetting matrix as a heatmap).")
    p.add_argument("output_dir")
    p.set_defaults(func=_plot)

    p = sub.add_parser("report", help="Write the report page of a run (its own <output_dir>/report.html, which "
                       "training keeps up to date), or of several runs side by side (--out): stages, curves, "
                       "forgetting matrix, completions, recipe, model card. One HTML file, no network.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="Output dirs of training runs (finished or not).")
    p.add_argument("--out", help="HTML file to write (default: RUN/report.html; needed for several runs). An "
                   "existing file is replaced only if it is a report page.")
    p.set_defaults(func=_report)
    return parser


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def _error_line(message: str) -> str | None:
    """The `error:` line of bad input, or None where rank 0 of a launch says the same line (`toolkit score` under
    `accelerate launch`: one line in all, toolkit/runtime/exit_lines.py)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from toolkit.runtime.exit_lines import LastWords

        return LastWords().stopped_on_error(message)
    return f"error: {message}"


def _launched_end(code: int) -> int:
    """A process of a launch (`accelerate launch -m toolkit ...`: LOCAL_RANK set, its process group up) ends here,
    without the interpreter's teardown that DeepSpeed's ZeRO-3 on gloo now and then aborts in
    (toolkit/runtime/process.py `exit_without_teardown`); any other returns `code`."""
    dist = sys.modules.get("torch.distributed")
    if "LOCAL_RANK" in os.environ and dist is not None and dist.is_available() and dist.is_initialized():
        from toolkit.runtime.process import exit_without_teardown

        exit_without_teardown(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """Every command ends with one line on bad input (exit 2), Ctrl-C (130) or SIGTERM (75): what the commands
    write (token stores, exports, plots) is built aside and renamed in, so a stop keeps nothing half-written."""
    return _launched_end(_main(argv))


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its unknown arguments are train_curriculum.py's, those after `--` accelerate's
        from toolkit.commands.train import parse_args, train

        args = parse_args(argv[1:])
        args.func = train
    else:
        args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    try:
        args.func(args)
    except ToolkitError as e:
        if (line := _error_line(as_terminal_text(str(e)))) is not None:  # it may quote a row or a file name
            print(line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): stopped; nothing half-written was kept.", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except Stopped as e:
        print(f"stopped by {e.signal_name}; nothing half-written was kept.", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except Exception as e:
        if (full := out_of_space(e)) is None:  # a full disk that no writer of ours named: one line too
            raise
        print(f"error: {full}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
