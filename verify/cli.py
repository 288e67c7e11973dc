"""mok-verify: the command line over verify's library functions (kept thin: parse, call, print, exit).

Exit codes for every command: 0 identical, 1 diverged, 2 error (bad input: one line on stderr, no
traceback; set MOK_VERIFY_DEBUG=1 to see the traceback of an unexpected error), 130 interrupted (Ctrl-C:
`mok-verify: interrupted` on stderr; never a verdict's code). New subcommands are plain
`@main.command()` functions and inherit this handling.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from verify.errors import VerifyError

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
_NO_ARGS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2: `mok-verify` alone shows help


class _Main(click.Group):
    """Turns errors raised by any subcommand into one line on stderr and exit code 2, and Ctrl-C into 130."""

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _NO_ARGS_HELP:
            raise
        except click.UsageError as e:  # an option of the group itself: one line too, not click's usage block
            click.echo(f"mok-verify: error: {e.format_message()}", err=True)
            sys.exit(EXIT_ERROR)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (KeyboardInterrupt, click.Abort):
            click.echo("mok-verify: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except _NO_ARGS_HELP:
            raise
        except click.UsageError as e:  # an unknown command or option, a bad value, a missing argument
            _fail(ctx, e.format_message())
        except (click.exceptions.Exit, click.ClickException):
            raise
        except VerifyError as e:
            _fail(ctx, str(e))
        except Exception as e:  # noqa: BLE001 — the contract is: never a bare traceback
            if os.environ.get("MOK_VERIFY_DEBUG"):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            _fail(ctx, f"unexpected {type(e).__name__}: {first} (MOK_VERIFY_DEBUG=1 shows the traceback)")


def _fail(ctx: click.Context, message: str) -> None:
    click.echo(f"mok-verify: error: {message}", err=True)
    ctx.exit(EXIT_ERROR)


def _warn_unclosed(*paths: Path | str | None) -> None:
    """One warning line on stderr per trace whose writer never reached close() (crashed, still running)."""
    from verify.store import Trace

    for path in dict.fromkeys(p for p in paths if p is not None):
        with Trace(path) as trace:
            warning = trace.unclosed_warning()
        if warning:
            click.echo(f"mok-verify: warning: {warning}", err=True)


def _emit(result, as_json: bool) -> None:
    if as_json:
        from verify.compare import json_safe

        # strict JSON: a NaN or an infinity (in a contract, a difference) is written as a string
        click.echo(json.dumps(json_safe(result.to_json()), indent=2, sort_keys=False, allow_nan=False))
    else:
        click.echo(result.describe())


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Prove that two runs or two checkpoints are bitwise identical, and find where they are not.

    Exit codes: 0 identical, 1 diverged, 2 error, 130 interrupted.
    """


@main.command()
@click.argument("trace_a", type=click.Path(path_type=Path))
@click.argument("trace_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--align", type=click.Choice(["order", "content"]), default="order", show_default=True,
              help="order: first divergence in execution order. content: match rows of per-row ops by "
                   "input-row digest and compare their output rows.")
@click.option("--name", "names", multiple=True, metavar="GLOB",
              help="With --align content: only ops whose name matches (repeatable).")
def diff(trace_a: Path, trace_b: Path, as_json: bool, align: str, names: tuple[str, ...]) -> None:
    """Compare two traces: the first divergence (step, phase, name, kind, rows)."""
    from verify.compare import align_by_content, diff_traces

    if names and align != "content":
        raise click.UsageError("--name selects ops to align by content: it needs --align content")
    result = diff_traces(trace_a, trace_b) if align == "order" else align_by_content(trace_a, trace_b, names or None)
    _warn_unclosed(trace_a, trace_b)
    _emit(result, as_json)
    sys.exit(EXIT_IDENTICAL if result.identical else EXIT_DIVERGED)


@main.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when it is a terminal).")
def checkpoint(a: Path, b: Path, as_json: bool, progress: bool | None) -> None:
    """Compare two checkpoints tensor by tensor (safetensors, sharded, .pt/.bin, directories, manifests)."""
    from verify.checkpoint import compare_checkpoints

    result = compare_checkpoints(a, b, progress=progress)
    _emit(result, as_json)
    sys.exit(EXIT_IDENTICAL if result.identical else EXIT_DIVERGED)


@main.command("hash")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the manifest here (default: stdout).")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when it is a terminal).")
def hash_(path: Path, output: Path | None, progress: bool | None) -> None:
    """Write a manifest (JSON: tensor -> dtype, shape, digest) of a checkpoint."""
    from verify.args import write_atomically
    from verify.checkpoint import check_not_an_input, hash_checkpoint

    if output is not None:
        check_not_an_input(path, output)  # before hashing: a manifest never replaces its own input
    manifest = hash_checkpoint(path, progress=progress)
    text = json.dumps(manifest, indent=1)
    if output is None:
        click.echo(text)
    else:
        write_atomically(output, text + "\n")
        click.echo(f"{len(manifest['tensors'])} tensors -> {output}", err=True)


@main.command("bisect")
@click.option("--repo", type=click.Path(path_type=Path), default=Path("."), show_default=True, help="Git repository.")
@click.option("--good", required=True, help="A revision whose output is the reference.")
@click.option("--bad", required=True, help="A later revision whose output diverges.")
@click.option("--cmd", required=True,
              help="Shell command run in a worktree of each revision; writes a trace or checkpoint to {output} "
                   "(or $MOK_VERIFY_OUTPUT). Exit 125 skips a revision.")
@click.option("--output", default=None, help="Path, relative to the worktree, that the command writes instead.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Kill a run of the command (its whole process group) after this long; the revision then "
                   "counts as skipped.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def bisect_(repo: Path, good: str, bad: str, cmd: str, output: str | None, timeout: float | None,
            as_json: bool) -> None:
    """Find the first revision whose output diverges from the good revision's.

    Ctrl-C or SIGTERM kills the running command and removes the throwaway worktree.
    """
    from verify.bisect import bisect

    result = bisect(repo, good, bad, cmd, output=output, timeout=timeout)
    _emit(result, as_json)
    sys.exit(EXIT_IDENTICAL if result.first_bad is None else EXIT_DIVERGED)


@main.command("report")
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for report.html, report.json and the PNG plots (default: <trace stem>_report beside it).")
@click.option("--against", type=click.Path(path_type=Path), default=None,
              help="A second trace to compare with (default: the trace's 'partner' metadata, if any).")
@click.option("--name", "names", multiple=True, metavar="GLOB",
              help="Per-row ops to align by content (repeatable; default: the trace's 'aligned_ops' metadata, "
                   "else every op recorded with input and output rows), listed in the order first recorded.")
def report(trace: Path, out: Path | None, against: Path | None, names: tuple[str, ...]) -> None:
    """Write an HTML report (metrics and agreement plots, first divergence) of a trace.

    Exit 1 when the comparison with the second trace diverged (or compared nothing), else 0.
    """
    from verify.report import build_report

    page, result = build_report(trace, out, other=against, names=names or None)
    _warn_unclosed(trace, result.other)
    click.echo(str(page))
    sys.exit(EXIT_DIVERGED if result.identical is False else EXIT_IDENTICAL)


if __name__ == "__main__":
    main(prog_name="mok-verify")
