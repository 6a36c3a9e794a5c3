"""The `toolkit` command: helpers around training runs (`toolkit --help`)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from toolkit.errors import ToolkitError, out_of_space
from toolkit.runtime.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Stopped


def _dummy_data(args: argparse.Namespace) -> None:
    from toolkit.builtin.dummy_data import write_dummy_data

    if args.num_samples < 1:
        raise ToolkitError(f"--num-samples must be at least 1, got {args.num_samples}.")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ToolkitError(f"--out {args.out} is a file; name a folder for the dummy data files.")
    for name, path in write_dummy_data(args.out, args.num_samples, seed=args.seed).items():
        print(f"{name}: {path}")


def _tiny_model(args: argparse.Namespace) -> None:
    from toolkit.builtin.text_model import write_tiny_qwen3

    print(write_tiny_qwen3(args.out, num_layers=args.layers, hidden_size=args.hidden, seed=args.seed))


def _export(args: argparse.Namespace) -> None:
    from toolkit.commands.export import export

    print(export(args.source, args.out, merge=args.merge, overwrite=args.overwrite,
                 trust_remote_code=args.trust_remote_code))


def _preflight(args: argparse.Namespace) -> None:
    from toolkit.commands.preflight import preflight
    from toolkit.config.load import load_recipe

    recipe = load_recipe(args.config, args.overrides)
    print(preflight(recipe, Path(args.accelerate_config), num_gpus=args.num_gpus, gpu_memory_gb=args.gpu_memory_gb,
                    scan_data=not args.no_data))


def _inspect_data(args: argparse.Namespace) -> None:
    from toolkit.commands.inspect_data import inspect_data, inspect_file
    from toolkit.config.load import load_recipe

    words = args.overrides
    if args.config is None and words and "=" not in words[0]:  # `toolkit inspect-data FILE`: no recipe
        print(inspect_file(words[0], words[1:], rows=2 if args.rows is None else args.rows))
        return
    print(inspect_data(load_recipe(args.config, words), stage=args.stage, rows=3 if args.rows is None else args.rows))


def _plot(args: argparse.Namespace) -> None:
    from toolkit.evals.forgetting import plot_forgetting
    from toolkit.metrics.plot import plot_run

    print(plot_run(args.output_dir))
    matrix = plot_forgetting(args.output_dir)  # with eval.all_stages: the forgetting matrix's heatmap beside it
    if matrix is not None:
        print(matrix)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolkit", description="Curriculum fine-tuning toolkit.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dummy-data", help="Write deterministic dummy chat JSONL files (stage1, stage2).")
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--num-samples", type=int, default=256, help="Rows per file.")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_dummy_data)

    p = sub.add_parser("tiny-model", help="Write a tiny random Qwen3 with a small trained tokenizer and "
                       "Qwen3's chat template (no network).")
    p.add_argument("--out", required=True, help="Output directory (loadable with from_pretrained).")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("export", help="Export a checkpoint or run as a PEFT adapter, or a merged model (--merge).")
    p.add_argument("source", help="<output_dir>, <output_dir>/checkpoints/step-N or <output_dir>/final.")
    p.add_argument("--out", required=True, help="Directory to write: new, empty, or an earlier export. The export "
                   "is built beside it and swapped in when complete: in one atomic step on Linux (renameat2 "
                   "RENAME_EXCHANGE); where that is unsupported the earlier export is moved aside first, and a crash "
                   "between the two renames leaves it beside --out as .<name>.old-*.")
    p.add_argument("--merge", action="store_true", help="Merge LoRA into the base weights (plain safetensors).")
    p.add_argument("--overwrite", action="store_true", help="Allow --out to be a non-empty folder that is not an "
                   "earlier export (never the source or a folder holding it).")
    p.add_argument("--trust-remote-code", action="store_true", help="Allow the model's own Python code to run, "
                   "for runs whose recipe sets model.trust_remote_code.")
    p.set_defaults(func=_export)

    p = sub.add_parser("preflight", help="Per-GPU memory estimate for every strategy, and a scan of the data.")
    p.add_argument("--config", help="Recipe YAML (default: the embedded demo recipe).")
    p.add_argument("--accelerate-config", default="accelerate_configs/zero3.yaml", help="Launch config to assess.")
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
    p.add_argument("overrides", nargs="*", help="A data FILE (without --config), then recipe overrides, "
                   "key.sub=value.")
    p.set_defaults(func=_inspect_data)

    p = sub.add_parser("plot", help="Write <output_dir>/training.png (loss, eval loss, LR, tokens/s by stage) and, "
                       "with eval.all_stages, forgetting.png (the forgetting matrix as a heatmap).")
    p.add_argument("output_dir")
    p.set_defaults(func=_plot)
    return parser


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Every command ends with one line on bad input (exit 2), Ctrl-C (130) or SIGTERM (75): what the commands
    write (token stores, exports, plots) is built aside and renamed in, so a stop keeps nothing half-written."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    try:
        args.func(args)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
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
