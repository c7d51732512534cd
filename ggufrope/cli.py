"""The ``ggufrope`` command line (click): ``set``, ``show``, ``reset``.

Every :class:`~ggufrope.errors.GGUFRopeError` raised by a command, this module's or one
added later with ``@main.command()``, is printed as ``ggufrope: error: <message>`` on
stderr with exit status 2 and no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import click

from .errors import GGUFRopeError

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class CliError(click.ClickException):
    """A :class:`GGUFRopeError` on its way to the terminal."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"ggufrope: error: {self.format_message()}", err=True)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GGUFRopeError as e:
            raise CliError(str(e)) from None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ggufrope")
    except Exception:  # pragma: no cover - not installed
        return "unknown"


def _on_sigterm(signum: int, frame: Any) -> None:
    # unwind through the writers' cleanup (temporary files) instead of dying in place
    raise SystemExit(128 + signum)


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    # a callback, so that importlib.metadata is imported only for --version (~20 ms)
    if value and not ctx.resilient_parsing:
        click.echo(f"ggufrope, version {_version()}")
        ctx.exit()


@click.group(cls=_Group, context_settings=_CONTEXT)
@click.option("-V", "--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Training-free context extension for llama.cpp, chosen by GGUF metadata.

    \b
    ggufrope set model.gguf --method mixed --b 0.625 --logn -o long.gguf
    ggufrope show long.gguf
    ggufrope reset long.gguf --in-place

    `set` writes the method (ntk, ntk-fixed, ntk-mixed, or none) into keys that the
    patched llama.cpp reads and stock llama.cpp ignores; tensor data is copied
    byte-identical (or not at all, for an in-place re-set).
    """
    if sys.platform != "win32" and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        try:
            signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread
            return
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def _destination(model: str, output: str | None, in_place: bool) -> str:
    if output is not None and in_place:
        raise GGUFRopeError("give either -o OUT or --in-place, not both")
    if output is None and not in_place:
        raise GGUFRopeError("give -o OUT to write a new file, or --in-place to rewrite MODEL")
    if in_place:
        return model
    if os.path.exists(output):
        try:
            same = os.path.samefile(model, output)
        except OSError:
            same = False
        if same:
            raise GGUFRopeError(f"output {output} is the input file; use --in-place to rewrite it")
    return output


def _fmt_bytes(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _report(r: Any, model: str, what: str) -> None:
    if r.header_only:
        how = f"header rewritten in place ({r.header_bytes} bytes), no tensor data copied"
        click.echo(f"updated {r.path} in place: {what}")
    else:
        how = f"header {_fmt_bytes(r.header_bytes)}, tensor data {_fmt_bytes(r.data_bytes)} copied"
        click.echo(f"wrote {r.path}: {what}")
    click.echo(f"  ({how})")


_METHOD_HELP = (
    "none, ntk (NTK-aware), ntk-fixed, ntk-mixed (alias: mixed; NTK-RoPE-mixed). "
    "linear and yarn are stock llama.cpp's own: use its --rope-scaling."
)


@main.command("set", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-m", "--method", required=True, metavar="METHOD", help=_METHOD_HELP)
@click.option(
    "--b",
    "--exponent",
    "exponent",
    type=float,
    default=None,
    metavar="B",
    help="Exponent b of ntk-mixed, 0 < b <= 1 (1 gives ntk-fixed).  [default: 0.625]",
)
@click.option(
    "-k",
    "--factor",
    type=float,
    default=None,
    metavar="K",
    help="Extension factor k >= 1. Left out: the library takes k = max(1, n_ctx / L) when "
    "the context is created (L = the trained context).",
)
@click.option(
    "--logn/--no-logn",
    default=False,
    show_default=True,
    help="log-n attention scaling: queries beyond L are multiplied by ln(p+1)/ln L.",
)
@click.option("-o", "--output", metavar="OUT", default=None, help="Write the result to OUT (atomically; an existing OUT is replaced).")
@click.option("--in-place", is_flag=True, help="Rewrite MODEL itself (header only when it fits).")
def set_cmd(
    model: str,
    method: str,
    exponent: float | None,
    factor: float | None,
    logn: bool,
    output: str | None,
    in_place: bool,
) -> None:
    """Write the context-extension method into MODEL's metadata.

    Writes {arch}.rope.ntk.method (STRING), {arch}.rope.ntk.factor (FLOAT32, only with
    --factor), {arch}.rope.ntk.exponent (FLOAT32, ntk-mixed only) and
    {arch}.attention.logn_scaling (BOOL); ggufrope keys of an earlier `set` that this
    call does not write are removed. Tensor data is copied byte-identical; a re-set
    --in-place only rewrites header bytes.
    """
    from .gguf_file import write_rope_metadata

    dst = _destination(model, output, in_place)
    r = write_rope_metadata(model, dst, method=method, factor=factor, exponent=exponent, logn=logn)
    for note in r.notes:
        click.echo(f"ggufrope: note: {note}", err=True)
    _report(r, model, r.description or method)


@main.command("reset", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-o", "--output", metavar="OUT", default=None, help="Write the result to OUT (atomically; an existing OUT is replaced).")
@click.option("--in-place", is_flag=True, help="Rewrite MODEL itself.")
def reset_cmd(model: str, output: str | None, in_place: bool) -> None:
    """Remove every ggufrope key from MODEL (the reserved padding key too).

    A file written by `set` from one without ggufrope keys comes back byte-identical.
    """
    from .gguf_file import reset_rope_metadata

    dst = _destination(model, output, in_place)
    r = reset_rope_metadata(model, dst)
    what = f"removed {', '.join(r.removed)}" if r.removed else "no ggufrope keys to remove"
    _report(r, model, what)


_FLOAT32_FIELDS = ("freq_base", "stock_scaling_factor", "factor", "exponent")


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    from .gguf_file import f32_repr

    out = dict(meta)
    for k in _FLOAT32_FIELDS:
        if isinstance(out.get(k), float):
            out[k] = float(f32_repr(out[k]))
    out["ggufrope_keys"] = {
        k: float(f32_repr(v)) if isinstance(v, float) else v for k, v in meta["ggufrope_keys"].items()
    }
    return out


def _show_text(meta: dict[str, Any]) -> str:
    from .gguf_file import f32_repr

    def opt(v: Any, src: str | None = None, fmt: Any = str) -> str:
        if v is None:
            return "-"
        return f"{fmt(v)}" + (f"  ({src})" if src else "")

    rows = [
        ("file", meta["path"]),
        (
            "GGUF",
            f"version {meta['gguf_version']}, {meta['endian']}-endian, {meta['tensor_count']} tensors, "
            f"{meta['kv_count']} keys, data at offset {meta['data_offset']}",
        ),
        ("architecture", meta["architecture"] + ("" if meta["has_rope"] else "  (no RoPE)")),
        ("n_ctx_orig L", opt(meta["n_ctx_orig"], meta["n_ctx_orig_key"])),
        ("freq_base", opt(meta["freq_base"], None, f32_repr)),
        ("rope dims", opt(meta["rope_dims"], meta["rope_dims_source"])),
    ]
    if meta["stock_scaling_type"] is not None or meta["stock_scaling_factor"] is not None:
        st = meta["stock_scaling_type"] or "-"
        sf = meta["stock_scaling_factor"]
        rows.append(("stock scaling", st + (f", factor {f32_repr(sf)}" if sf is not None else "")))
    else:
        rows.append(("stock scaling", "none"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{k + ':':<{width}}{v}" for k, v in rows]
    keys = meta["ggufrope_keys"]
    if keys:
        lines.append("ggufrope keys:")
        kw = max(len(k) for k in keys)
        for k, v in keys.items():
            if isinstance(v, bool):
                s = "true" if v else "false"
            elif isinstance(v, float):
                s = f32_repr(v)
            else:
                s = repr(v)
            lines.append(f"  {k:<{kw}}  {s}")
    else:
        lines.append("ggufrope keys: none")
    if meta["reserved"] is not None:
        lines.append(f"{'reserved:':<{width}}{meta['reserved']} bytes of room (ggufrope.reserved)")
    lines.append(f"{'method:':<{width}}{meta['description']}")
    return "\n".join(lines)


@main.command("show", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def show_cmd(model: str, as_json: bool) -> None:
    """Print MODEL's rope metadata and the active method.

    Shows the architecture, the trained context L ({arch}.rope.scaling.original_context_length,
    else {arch}.context_length), freq_base, the rope dimensions, stock llama.cpp scaling keys,
    the ggufrope keys and the method they select.
    """
    from .gguf_file import read_rope_metadata

    meta = read_rope_metadata(model)
    if as_json:
        click.echo(json.dumps(_jsonable(meta), indent=2))
    else:
        click.echo(_show_text(meta))


# Further commands (generate, chat, eval) are added below or from other modules with
# ``@main.command()``; GGUFRopeError raised by them is reported like the ones above.


if __name__ == "__main__":  # python -m ggufrope.cli
    main(prog_name="ggufrope")


# --- running models: generate, chat -------------------------------------------------------

_RUN_METHOD_HELP = (
    "Method chosen at load time, without rewriting MODEL: none, linear, yarn, ntk, ntk-fixed, "
    "ntk-mixed (alias mixed). Left out: MODEL's own metadata decides."
)


def _run_options(f: Any) -> Any:
    """Options shared by the commands that load a model (method, context, device)."""
    opts = [
        click.option("-c", "--n-ctx", type=click.IntRange(min=16), default=4096, show_default=True,
                     help="Context size n_ctx in tokens."),
        click.option("-m", "--method", default=None, metavar="METHOD", help=_RUN_METHOD_HELP),
        click.option("-k", "--factor", type=float, default=None, metavar="K",
                     help="Factor k >= 1 for --method. Left out: max(1, n_ctx / L)."),
        click.option("--b", "--exponent", "exponent", type=float, default=0.625, show_default=True, metavar="B",
                     help="Exponent b of ntk-mixed."),
        click.option("--logn/--no-logn", default=None, help="log-n query scaling beyond L (default: MODEL's metadata)."),
        click.option("-ngl", "--gpu-layers", "gpu_layers", type=int, default=0, show_default=True,
                     help="Layers to offload to the GPU (-1: all)."),
        click.option("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's log (it names the active rope method)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _load(model: str, n_ctx: int, method: str | None, factor: float | None, exponent: float,
          logn: bool | None, gpu_layers: int, threads: int | None, verbose: bool) -> Any:
    from .runtime import describe, load

    kw: dict[str, Any] = {}
    if threads:
        kw["n_threads"] = kw["n_threads_batch"] = threads
    llm = load(model, method=method, factor=factor, exponent=exponent, logn=logn, n_ctx=n_ctx,
               n_gpu_layers=gpu_layers, verbose=verbose, **kw)
    click.echo(f"[ggufrope] {describe(model, method=method, factor=factor, exponent=exponent, logn=logn, n_ctx=n_ctx)}",
               err=True)
    return llm


@main.command("generate", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False), default=None,
              help="Read the prompt from a file (appended after --prompt if both are given).")
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens to generate.")
@click.option("--temp", type=float, default=0.0, show_default=True, help="Temperature; 0 is greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (temp > 0).")
@_run_options
def generate_cmd(model: str, prompt: str | None, prompt_file: str | None, n_predict: int, temp: float,
                 seed: int, **run: Any) -> None:
    """Generate a continuation of a (long) prompt with MODEL.

    The prompt is evaluated in n_batch chunks with a progress bar; the continuation is
    streamed to stdout, timings go to stderr. Greedy by default, so the output is
    deterministic.
    """
    from .generate import generate, read_prompt

    text = read_prompt(prompt, prompt_file)
    llm = _load(model, **run)
    for piece in generate(llm, text, n_predict=n_predict, temp=temp, seed=seed, progress=True):
        click.echo(piece, nl=False)
    click.echo()


@main.command("chat", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-f", "--file", "doc_file", type=click.Path(dir_okay=False), default=None,
              help="A document to put in the conversation first (a long context to ask about).")
@click.option("-s", "--system", default=None, help="System prompt.")
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=256, show_default=True,
              help="Maximum tokens per answer.")
@click.option("--temp", type=float, default=0.0, show_default=True, help="Temperature; 0 is greedy.")
@_run_options
def chat_cmd(model: str, doc_file: str | None, system: str | None, n_predict: int, temp: float, **run: Any) -> None:
    """Chat with MODEL in the terminal, with its chat template. Ctrl-D or /exit ends it."""
    from .generate import chat_turn, read_prompt

    llm = _load(model, **run)
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    doc = read_prompt(None, doc_file) if doc_file else None
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
        except (EOFError, click.Abort):
            click.echo()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if not line.strip():
            continue
        content = f"{doc}\n\n{line}" if doc is not None and not any(m["role"] == "user" for m in messages) else line
        messages.append({"role": "user", "content": content})
        click.echo("model> ", nl=False)
        answer = []
        for piece in chat_turn(llm, messages, n_predict=n_predict, temp=temp):
            answer.append(piece)
            click.echo(piece, nl=False)
        click.echo()
        messages.append({"role": "assistant", "content": "".join(answer)})
