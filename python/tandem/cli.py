"""The `tandem` command line.

    tandem run [--model DIR --config FILE]  generate with a model (default: the built-in demo)
    tandem train [--model DIR --data FILE --config FILE]
                                             LoRA fine-tuning (default: the demo model on the bundled dataset)
    tandem doctor [--config FILE] [--json]   what tandem can use here; validate a config
    tandem trace-merge TANDEM.json TORCH.json -o OUT.json
                                             put tandem's spans on a torch.profiler timeline
"""
from __future__ import annotations

import argparse
import json
import sys


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


def _train(args: argparse.Namespace) -> int:
    from tandem.train import train

    return train(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")
    from tandem.run import add_arguments

    r = sub.add_parser("run", help="load a model through tandem and generate (default: the built-in demo model)")
    add_arguments(r)
    r.set_defaults(func=_run)
    from tandem.train import add_arguments as add_train_arguments

    t = sub.add_parser("train", help="LoRA fine-tuning through tandem (default: the demo model on a bundled dataset)")
    add_train_arguments(t)
    t.set_defaults(func=_train)
    d = sub.add_parser("doctor", help="report ISA features, NUMA nodes, memory, GPUs; validate a config")
    d.add_argument("--config", help="placement YAML file to validate against this machine")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-gpu-kernel", action="store_true", help="skip the test kernel launch on each GPU")
    d.set_defaults(func=_doctor)
    m = sub.add_parser("trace-merge", help="merge a tandem trace into a torch.profiler Chrome trace")
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
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # tandem's input errors: say what is wrong, no traceback
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
