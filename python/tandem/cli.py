"""The `tandem` command line.

    tandem run [--model DIR] [--config FILE] [--trace OUT.json] [--record-routing STATS.json]
                                             generate with a model (default: the config's model.path,
                                             else the built-in demo)
    tandem train [--model DIR] [--data FILE] [--config FILE] [--out DIR] [--resume | --overwrite]
                 [--trace OUT.json]          LoRA fine-tuning (default: the demo model on the bundled dataset)
    tandem chat [--model DIR] [--config FILE] [--adapter DIR]
                                             talk to a model (the built-in demo by default)
    tandem bench [--model DIR] [--config FILE] [-p 512] [-n 128] [-r 3] [--json OUT]
                                             tokens/s of prompt processing and generation
    tandem serve [--model DIR] [--config FILE] [--adapter DIR] [--host H] [--port 8000] [--api-key KEY]
                                             an OpenAI-compatible HTTP server (streaming)
    tandem convert [--model DIR] [--config FILE] [--format F] [--out DIR] [--verify]
                                             pack the routed experts once into a store that later
                                             starts load (--store DIR, or cpu.store) instead
    tandem merge --model DIR --adapter DIR --out DIR
                                             write a checkpoint with a LoRA adapter merged in
    tandem doctor [--config FILE] [--json]   what tandem can use here; validate a config
    tandem trace-merge TANDEM.json TORCH.json -o OUT.json
                                             put tandem's spans on a torch.profiler timeline

Errors are one line on stderr, "tandem: error: ...", with exit code 2 for bad input
(arguments, files, configs, a machine that lacks what they ask for) and 1 for other
failures (a missing Python package, an error while running); --verbose (before or after
the command) adds the traceback and tandem's internal source locations.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback


def _doctor(args: argparse.Namespace) -> int:
    import tandem

    report = tandem.doctor(args.config, gpu_kernel_check=not args.no_gpu_kernel)
    if args.json:
        print(json.dumps(report.data, indent=2))
    else:
        print(report.text, end="")
    return 0 if report.ok else 1


def _trace_merge(args: argparse.Namespace) -> int:
    from tandem.trace_merge import merge

    shift = merge(args.tandem, args.torch, args.output)
    print(f"wrote {args.output} (tandem events shifted by {shift / 1e6:+.6f} s)")
    return 0


def _run(args: argparse.Namespace) -> int:
    from tandem.run import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    from tandem.bench_cli import run

    return run(args)


def _chat(args: argparse.Namespace) -> int:
    from tandem.chat import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    from tandem.serve import run

    return run(args)


def _convert(args: argparse.Namespace) -> int:
    from tandem.store import run

    return run(args)


def _merge(args: argparse.Namespace) -> int:
    from tandem.merge import run

    return run(args)


def _train(args: argparse.Namespace) -> int:
    from tandem.train import train

    return train(args)


VERBOSE_HELP = "on errors, print the traceback and tandem's internal source locations"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    # Also accepted after the command; SUPPRESS keeps a subcommand from resetting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="command")
    from tandem.run import add_arguments

    r = sub.add_parser("run", parents=[common],
                       help="load a model through tandem and generate (default: the built-in demo model)")
    add_arguments(r)
    r.set_defaults(func=_run)
    from tandem.train import add_arguments as add_train_arguments

    t = sub.add_parser("train", parents=[common],
                       help="LoRA fine-tuning through tandem (default: the demo model on a bundled dataset)")
    add_train_arguments(t)
    t.set_defaults(func=_train)
    from tandem.chat import add_arguments as add_chat_arguments

    ch = sub.add_parser("chat", parents=[common], help="talk to a model in the terminal (streamed replies, the "
                        "conversation's KV cache kept between turns)")
    add_chat_arguments(ch)
    ch.set_defaults(func=_chat)
    from tandem.bench_cli import add_arguments as add_bench_arguments

    bn = sub.add_parser("bench", parents=[common], help="prompt-processing and generation tokens/s on a model "
                        "(llama-bench style), with the decode ceiling")
    add_bench_arguments(bn)
    bn.set_defaults(func=_bench)
    from tandem.serve import add_arguments as add_serve_arguments

    sv = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP server (chat and text "
                        "completions, streaming) for a model loaded through tandem")
    add_serve_arguments(sv)
    sv.set_defaults(func=_serve)
    from tandem.store import add_arguments as add_convert_arguments

    cv = sub.add_parser("convert", parents=[common], help="pack a model's routed experts once into a store "
                        "(resumable) that later starts load instead of packing the checkpoint")
    add_convert_arguments(cv)
    cv.set_defaults(func=_convert)
    mg = sub.add_parser("merge", parents=[common], help="write a checkpoint with a LoRA adapter merged in "
                        "(shard by shard, atomically)")
    mg.add_argument("--model", required=True, help="checkpoint directory of the base model")
    mg.add_argument("--adapter", required=True, help="PEFT LoRA adapter directory (save_pretrained's output)")
    mg.add_argument("--out", required=True, help="directory to write (must not exist)")
    mg.add_argument("--no-progress", action="store_true", help="no progress bar")
    mg.set_defaults(func=_merge)
    d = sub.add_parser("doctor", parents=[common],
                       help="report ISA features, NUMA nodes, memory, GPUs; validate a config")
    d.add_argument("--config", help="placement YAML file to validate against this machine")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-gpu-kernel", action="store_true", help="skip the test kernel launch on each GPU")
    d.set_defaults(func=_doctor)
    m = sub.add_parser("trace-merge", parents=[common], help="merge a tandem trace into a torch.profiler Chrome trace")
    m.add_argument("tandem", help="tandem trace (TANDEM_TRACE=... or tandem::trace::write)")
    m.add_argument("torch", help="torch.profiler trace (prof.export_chrome_trace)")
    m.add_argument("-o", "--output", required=True, help="merged trace to write")
    m.set_defaults(func=_trace_merge)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        import tandem
        print(tandem.__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    verbose = getattr(args, "verbose", False)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        print("tandem: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (every failure: one line; the traceback with --verbose)
        code, text = _describe_error(args, e)
        if verbose:
            traceback.print_exc()
            text = str(e).strip() if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
        print(f"tandem: error: {text}", file=sys.stderr)
        return code


def _describe_error(args: argparse.Namespace, e: Exception) -> tuple[int, str]:
    """(exit code, one-line message) for an exception escaping a command."""
    from tandem.cli_checks import user_message

    if isinstance(e, ImportError):  # ModuleNotFoundError included
        what = f"the Python module {e.name!r}" if e.name else "a Python module"
        return 1, (f"tandem {args.command} needs {what}, which cannot be imported ({user_message(e)}); "
                   "install the project's requirements (pip install -r requirements.txt)")
    if isinstance(e, (ValueError, OSError)):  # bad input: arguments, files, configs, this machine
        return 2, user_message(e)
    return 1, f"{type(e).__name__}: {user_message(e)} (--verbose shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
