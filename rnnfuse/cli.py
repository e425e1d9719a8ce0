"""The ``rnnfuse`` command: ``optimize``, ``inspect`` and ``bench``.

Exit codes: 0 success (also when nothing was fused), 2 bad command line, 3 bad input, 4 output not
writable, 5 ``--strict`` and a recurrence was declined or not validated, 1 an internal error (a bug: the
message says so).
"""

from __future__ import annotations

import argparse
import gc
import json

import onnx
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from . import __version__, progress
from .errors import ExitCode, InputError, RnnfuseError, StrictError, UsageError

EPILOG = """exit codes: 0 ok (also when nothing was fused: the output is then a copy of the input; also for a
valid model rnnfuse cannot work on, passed through with a note), 2 usage, 3 input is not a loadable ONNX model,
4 cannot write output (or it exists and --force was not given), 5 --strict check failed, 1 internal error"""
INSPECT_EPILOG = """exit codes: 0 ok (also when nothing would be fused), 2 usage, 3 bad input, 1 internal error"""
BENCH_EPILOG = """exit codes: 0 ok, 2 usage, 3 bad input, 4 cannot write the plot or JSON, 1 internal error"""

# formats matplotlib writes without extra backends; --plot is checked against these before any work
PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "webp", "tif", "tiff")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``rnnfuse: error: ...`` and where to find the synopsis (exit 2)."""

    def error(self, message: str):  # noqa: D401 (argparse's hook)
        sys.stderr.write(f"rnnfuse: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(ExitCode.USAGE)


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, not '{text}'") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {v}")
        return v

    return parse


def _batch_list(text: str) -> list[int]:
    """'1,16' -> [1, 16]; every size a positive integer (onnxruntime crashes on a batch of 0)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        sizes = [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be comma-separated integers, not '{text}'") from None
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, not '{text}'")
    return sizes


def _plot_path(text: str) -> str:
    ext = os.path.splitext(text)[1].lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not an image file name; use one of ." + ", .".join(PLOT_FORMATS[:4]) + " ...")
    return text


def _add_common(p: argparse.ArgumentParser, inspect_only: bool = False) -> None:
    if inspect_only:
        p.add_argument("--post-padded", action="store_true",
                       help="plan for the post-padded mask path (what 'optimize --post-padded' would emit)")
        p.add_argument("--no-validate", action="store_true",
                       help="skip the numeric check of each candidate rewrite (faster; the report then "
                            "says 'not validated')")
    else:
        p.add_argument("--post-padded", action="store_true",
                       help="promise that every mask is post-padded (valid steps first, padding at the end); "
                            "emits only sequence_lens = mask sums. Default: exact for any mask (pre-padded, gappy)")
        p.add_argument("--no-validate", action="store_true",
                       help="skip the numeric check of each rewrite against the original (faster; not recommended)")
    p.add_argument("--portable", action="store_true",
                   help="decline fusions whose native op OpenVINO cannot compile (activations other than "
                        "Sigmoid, Tanh, Relu); by default they are fused and the report warns")
    p.add_argument("--json", metavar="FILE",
                   help="also write the report as JSON to FILE; '-' writes only the JSON to stdout "
                        "(the text report then goes to stderr)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation inputs (default 0)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="also print per-pass timings and notes (through the 'rnnfuse' logger)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="rnnfuse",
        description="Rewrite exported recurrences (Loop, Scan, unrolled chains, masked Keras layers) "
                    "into native ONNX LSTM/GRU/RNN ops, with the model's outputs unchanged.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"rnnfuse {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    o = sub.add_parser("optimize", help="fuse recurrences and write the optimized model",
                       description="Fuse every recurrence rnnfuse can prove equivalent, validate each rewrite "
                                   "numerically against the original, and write the result.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("input", help="the ONNX model to optimize")
    o.add_argument("output", help="where to write the optimized model")
    _add_common(o)
    o.add_argument("-f", "--force", action="store_true",
                   help="replace OUTPUT if it exists (without it an existing file is never overwritten)")
    o.add_argument("--in-place", action="store_true", help="allow OUTPUT to be the INPUT file")
    o.add_argument("--external-data", choices=["auto", "always", "never"], default="auto",
                   help="write tensors to OUTPUT.data beside the model: 'auto' when the input had external "
                        "data or the model exceeds 2 GB (default); 'never' writes one file, external tensors "
                        "copied in (refused over 2 GB)")
    o.add_argument("--prefer-faster", metavar="BATCHES", type=_batch_list,
                   help="time each fused recurrence against the original form in onnxruntime at these batch sizes "
                        "(e.g. 16 or 1,16; --seq-len, --threads apply) and keep whichever is faster: onnxruntime's "
                        "native RNN (Elman) kernel loses to the loop at large batch. Default: always native")
    o.add_argument("--seq-len", type=_int_at_least(1, "--seq-len"), default=100,
                   help="sequence length for --prefer-faster (default 100)")
    o.add_argument("--threads", type=_int_at_least(1, "--threads"), default=1,
                   help="onnxruntime threads for --prefer-faster (default 1)")
    o.add_argument("--strict", action="store_true",
                   help=f"exit {ExitCode.VALIDATION} if any recurrence is declined or a validation is skipped")

    i = sub.add_parser("inspect", help="show every recurrence and what it would become (writes nothing)",
                       description="Find every recurrence, say what it would become or why it cannot be fused. "
                                   "No file is written.", epilog=INSPECT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("input", help="the ONNX model to inspect")
    _add_common(i, inspect_only=True)

    b = sub.add_parser("bench", help="onnxruntime latency before and after fusion",
                       description="Time the model before and after fusion with onnxruntime on random inputs "
                                   "that respect its dims and masks (runs interleaved; medians reported).",
                       epilog=BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("input", help="the original model")
    b.add_argument("output", nargs="?", help="an already optimized model (default: optimize INPUT now)")
    b.add_argument("--batch", type=_batch_list, default=[1, 16],
                   help="comma-separated batch sizes for a dynamic batch dim (default 1,16)")
    b.add_argument("--seq-len", type=_int_at_least(1, "--seq-len"), default=100,
                   help="sequence length for dynamic time dims (default 100)")
    b.add_argument("--threads", type=_int_at_least(1, "--threads"), default=1,
                   help="onnxruntime intra-op threads (default 1)")
    b.add_argument("--runs", type=_int_at_least(1, "--runs"), default=50,
                   help="timed runs per model and batch (default 50)")
    b.add_argument("--warmup", type=_int_at_least(0, "--warmup"), default=5, help="untimed runs first (default 5)")
    b.add_argument("--mask", choices=["post", "pre", "gappy", "none"], default="post",
                   help="padding pattern of generated masked inputs (default post)")
    b.add_argument("--plot", metavar="PNG", type=_plot_path,
                   help="write a chart of the latencies (needs matplotlib: pip install 'rnnfuse[plot]')")
    b.add_argument("--json", metavar="FILE",
                   help="also write the results as JSON to FILE; '-' writes only the JSON to stdout")
    b.add_argument("--post-padded", action="store_true", help="optimize with --post-padded")
    b.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    b.add_argument("-q", "--quiet", action="store_true", help="print only the table")
    return ap


class _Progress:
    """The stages of a command (loading, writing, timing): logged through the 'rnnfuse' logger (``-v``) and shown
    on the progress bar that :func:`main` opens when stderr is a terminal (see rnnfuse.progress)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        progress.step(msg)

    def done(self) -> None:
        progress.finish()


def _text_stream(args):
    """Where the human-readable report goes: stdout, unless stdout carries the JSON (``--json -``)."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


def _json_text(data: dict) -> str:
    """The report as indented JSON, each finding on a line of its own. json's indented encoder is Python (a
    report of 50,000 declined Loops took it 0.8 s); the findings, nearly all of a big report, go through its
    compact one, in C (0.15 s), each put in place of a marker no string of the report can hold."""
    marker = f"rnnfuse-findings-{uuid.uuid4().hex}-"
    passes = data.get("passes") or []
    lists = [p.get("findings") or [] for p in passes]
    shown = {**data, "passes": [{**p, "findings": f"{marker}{k}"} for k, p in enumerate(passes)]} if passes else data
    declined = data.get("declined")  # (the declines listed at the top: as many as the findings, the same way)
    if isinstance(declined, list):
        shown = {**shown, "declined": f"{marker}declined"}
    text = json.dumps(shown, indent=2, sort_keys=False, default=str)
    encode = json.JSONEncoder(default=str).encode  # (one encoder: json.dumps with an option makes one a call)

    def put(key: str, found: list, indent: str) -> None:
        nonlocal text
        rows = ",\n".join(indent + "  " + encode(f) for f in found)
        text = text.replace(f'"{marker}{key}"', f"[\n{rows}\n{indent}]" if found else "[]", 1)

    for k, found in enumerate(lists):
        put(str(k), found, "      ")
    if isinstance(declined, list):
        put("declined", declined, "  ")
    return text


def _write_json(path: str, data: dict) -> None:
    text = _json_text(data)
    if path == "-":
        print(text)
        return
    from .output_checks import check_writable

    check_writable(path)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except OSError as e:
        from .errors import OutputError

        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


@dataclass
class _Run:
    """What a run of the passes leaves for the output to be written from."""

    report: object  # rnnfuse.Report
    model: object = None  # the rewritten rnnfuse.graph.Model, when keep_rewrite
    source_dir: str | None = None  # where the input's external tensors are
    had_external: bool = False  # the input kept its tensors in a data file
    keep_rewrite: bool = False  # write the rewritten model (else the input as it was)


def _run_passes(args, pipe, progress) -> _Run:
    from . import model_io
    from .graph import Model
    from .guard import settle
    from .pipeline import Options

    progress(f"loading {args.input}")
    t0 = time.perf_counter()
    # a big single file lends its weights (they stay in the file, memory-mapped when read, and are copied
    # back inline on save)
    proto, had_external = model_io.load(args.input, borrow=True)
    model = Model(proto, external_dir=model_io.model_dir(proto))
    loaded = time.perf_counter() - t0
    opts = Options(validate=not args.no_validate, post_padded=args.post_padded, seed=args.seed, log=None,
                   portable=args.portable)
    source = None
    if getattr(args, "prefer_faster", None):
        source = onnx.ModelProto()
        source.CopyFrom(proto)
    try:
        report = pipe.run(model, opts, write_unfused=False)  # (settled below)
    except RnnfuseError:
        raise
    except Exception as e:
        _stop_if_invalid(args.input, e)
        raise
    phases = {"load": loaded}  # (the passes: report.seconds)
    if source is not None and report.fused:
        from .bench import prefer_faster

        progress("timing native vs original forms")
        t0 = time.perf_counter()
        # (a form kept as it was runs the passes again: a new report, whose seconds are that run's)
        model, report, decisions = prefer_faster(source, model, report, opts, args, progress)
        report.notes.extend(decisions)
        phases["timing"] = time.perf_counter() - t0
    # what is written: the rewritten model, or (nothing fused, or a rewrite that would harm) the input as it was
    t0 = time.perf_counter()
    keep = settle(report, model.proto, lambda: model_io.load(args.input, borrow=True)[0], model.established_type)
    phases["guard"] = time.perf_counter() - t0
    report.phases.update(phases)
    return _Run(report, model, model_io.model_dir(proto), had_external, keep)


def _stop_if_invalid(path: str, failure: Exception) -> None:
    """The passes failed: if the input itself is no valid ONNX (a name defined twice, a cycle), say that, as
    bad input; else the failure is a bug, reported as one by the caller."""
    try:
        onnx.checker.check_model(path)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{path} is not a valid ONNX model: {first} (the optimizer stopped at "
                         f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''})") from None
    except Exception:  # (the checker itself could not run: the original failure stands)
        return


def _write_output(args, run: _Run, progress) -> None:
    from . import model_io

    report = run.report
    progress(f"writing {args.output}")
    if run.keep_rewrite:
        ext = {"auto": None, "always": True, "never": False}[args.external_data]
        if ext is None and run.had_external:
            ext = True
        written = model_io.save(run.model.proto, args.output, external=ext, source_dir=run.source_dir)
        if len(written) > 1:
            report.notes.append(f"tensors written to {written[1]}")
    elif run.had_external:
        # the input's tensors live in its own data file: write the unchanged model with its tensors
        # streamed to OUTPUT.data, so the output stands on its own wherever it is
        original, _ = model_io.load(args.input, read_small=False)  # (its small tensors where they were too)
        written = model_io.save(original, args.output, external=True, source_dir=model_io.model_dir(original))
        report.notes.append("nothing changed: the model is written as it was"
                            + (f", tensors in {written[1]}" if len(written) > 1 else ", every tensor inline"))
    else:
        model_io.copy_unchanged(args.input, args.output)
        if not report.unsupported:
            report.notes.append("nothing changed: the output is a byte-for-byte copy of the input")
    report.output_path = args.output


def cmd_optimize(args, inspect_only: bool = False) -> int:
    from .output_checks import check_data_writable, check_writable
    from .pipeline import Pipeline
    from .prescreen import report_if_nothing_to_fuse

    if not inspect_only:
        check_writable(args.output, args.input, args.in_place, force=args.force)
        check_data_writable(args.output, args.input, args.in_place, args.force, args.external_data)
    if args.json and args.json != "-":
        check_writable(args.json)
    progress = _Progress(not args.quiet)
    pipe = Pipeline.default()  # each pass reports itself (rnnfuse.progress): log lines and the terminal bar
    progress(f"reading {args.input}")
    # a model without any op a pass needs comes out as it went in: its bytes say so, no need to load it
    quick = report_if_nothing_to_fuse(args.input, pipe.fusion_needs())
    run = _Run(quick) if quick is not None else _run_passes(args, pipe, progress)
    report = run.report
    report.input_path = args.input
    if not inspect_only:
        t0 = time.perf_counter()
        _write_output(args, run, progress)
        if report.phases:  # (a run of the passes; a model passed through is only copied)
            report.phases["write"] = time.perf_counter() - t0
    progress.done()
    if not args.quiet:
        out = _text_stream(args)
        title = "inspect" if inspect_only else f"{args.input} -> {args.output}"
        print(f"rnnfuse {title}", file=out)
        text = report.to_text(verbose=args.verbose)
        if inspect_only:
            text = text.replace("fused ", "would fuse ", ).replace(" fused,", " fusable,")
        print(text, file=out)
        print(f"  done in {report.seconds:.2f} s", file=out)
    if args.json:
        d = report.to_dict()
        d["command"] = "inspect" if inspect_only else "optimize"
        from .bench import versions

        d["versions"] = versions()  # what a bug report needs beside the findings
        _write_json(args.json, d)
    if getattr(args, "strict", False):
        skipped = [f for f in report.fused if f.validation.startswith("skipped")]
        if report.unsupported:
            raise StrictError(f"--strict: the model was not examined ({report.unsupported})")
        if report.declined or skipped:
            raise StrictError(
                f"--strict: {len(report.declined)} recurrence(s) declined, {len(skipped)} fused without validation"
            )
    return ExitCode.OK


def cmd_bench(args) -> int:
    from .bench import run_bench_cli

    return run_bench_cli(args)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if e.code is not None else 0
    if args.command is None:
        ap.print_help()
        return ExitCode.USAGE
    handler = progress.log_to_stderr() if getattr(args, "verbose", False) else None
    # a one-shot process: the model and its index (a million objects for a 100k-node graph) live until it
    # ends, and each full collection of the cyclic GC would scan them all again (~0.2 s of the 108k chain's
    # run, 8-11% of the passes' CPU); the passes make little cyclic garbage, so full collections are kept rare
    gc.set_threshold(700, 10, 1000)
    # a terminated run (a CI job's timeout, a service stopping) exits through the interpreter's clean-up, which
    # removes the temporary files it wrote (validation's check models, spilled weights: up to the model's size)
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() else None
    try:
        with progress.progress_bar(enabled=not getattr(args, "quiet", False)):
            if args.command == "optimize":
                code = cmd_optimize(args)
            elif args.command == "inspect":
                code = cmd_optimize(args, inspect_only=True)
            elif args.command == "bench":
                code = cmd_bench(args)
            else:
                raise UsageError(f"unknown command {args.command}")
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader went away (``rnnfuse inspect m.onnx | head -1``): stop quietly, like other Unix tools.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return ExitCode.OK
    except RnnfuseError as e:
        print(f"rnnfuse: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("rnnfuse: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("rnnfuse: error: out of memory", file=sys.stderr)
        return ExitCode.INTERNAL
    except Exception as e:  # a bug: one line, but say it is one
        if os.environ.get("RNNFUSE_DEBUG"):
            raise
        where = type(e).__name__
        print(f"rnnfuse: internal error ({where}: {str(e).splitlines()[0] if str(e) else ''}); "
              "please report it (set RNNFUSE_DEBUG=1 for a traceback)", file=sys.stderr)
        return ExitCode.INTERNAL
    finally:
        if handler is not None:  # main() may be called again in the same process (tests, scripts)
            progress.logger.removeHandler(handler)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
