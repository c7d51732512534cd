"""The ``ggufrope`` command line (click): ``set``, ``show``, ``reset``, ``generate`` and ``chat``
(``eval`` and ``tune`` join it from :mod:`ggufrope.evaluation.cli`).

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


_DYNAMIC_HELP = (
    "Dynamic k (NTK family, without --factor): k = 1 while the context holds positions < L (the "
    "model unmodified), then the smallest power of 2 (of R) with k*L >= n, n = 1 + the largest cached "
    "position; cached keys are re-rotated to each new k. --static: one k for the whole context."
)


def _dynamic_options(left_out: str) -> Any:
    """--dynamic/--static and --dynamic-ratio (set, generate, chat); ``left_out`` says what
    leaving them out means for the command."""
    from .methods import DYNAMIC_DEFAULT

    default = f"(The library's default: {'dynamic' if DYNAMIC_DEFAULT else 'static'}.)"

    def deco(f: Any) -> Any:
        opts = [
            click.option("--dynamic/--static", "dynamic", default=None,
                         help=f"{_DYNAMIC_HELP} {left_out} {default}"),
            click.option("--dynamic-ratio", "dynamic_ratio", type=float, default=None, metavar="R",
                         help="Ratio r > 1 of the dynamic schedule, with --dynamic.  [default: 2]"),
        ]
        for o in reversed(opts):
            f = o(f)
        return f

    return deco


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
    help="Extension factor k >= 1. Left out: auto, dynamic k unless --static (the library's default); with "
    "--static the library takes k = max(1, n_ctx_seq / L) when the context is created (n_ctx_seq: n_ctx per "
    "sequence, rounded up to 256; L = the trained context).",
)
@click.option(
    "--logn/--no-logn",
    default=False,
    show_default=True,
    help="log-n attention scaling: queries beyond L are multiplied by ln(p+1)/ln L.",
)
@_dynamic_options("Left out: the key is not written, and the library's default applies.")
@click.option("-o", "--output", metavar="OUT", default=None, help="Write the result to OUT (atomically; an existing OUT is replaced).")
@click.option("--in-place", is_flag=True, help="Rewrite MODEL itself (header only when it fits).")
@click.option("--stock", is_flag=True,
              help="Write a stock-readable copy instead (ollama, LM Studio, stock llama.cpp): the method with the "
              "fixed k of -k as a rope_freqs table (llama family; any NTK-family method) or as the rope base "
              "(NTK-aware only, other architectures), context_length = k*L; needs -k K and -o OUT. Lost: log-n, "
              "dynamic k.")
def set_cmd(
    model: str,
    method: str,
    exponent: float | None,
    factor: float | None,
    logn: bool,
    dynamic: bool | None,
    dynamic_ratio: float | None,
    output: str | None,
    in_place: bool,
    stock: bool,
) -> None:
    """Write the context-extension method into MODEL's metadata.

    Writes {arch}.rope.ntk.method (STRING), {arch}.rope.ntk.factor (FLOAT32, only with
    --factor), {arch}.rope.ntk.exponent (FLOAT32, ntk-mixed only),
    {arch}.rope.ntk.dynamic (BOOL, only with --dynamic or --static),
    {arch}.rope.ntk.dynamic_ratio (FLOAT32, only with --dynamic-ratio) and
    {arch}.attention.logn_scaling (BOOL); ggufrope keys of an earlier `set` that this
    call does not write are removed. Tensor data is copied byte-identical; a re-set
    --in-place only rewrites header bytes.

    Stock engines ignore these keys. --stock writes a copy they apply instead: for one
    fixed k, rope_freqs.weight (llama, arcee, apertus, deci, exaone, granite, mistral3) or
    {arch}.rope.freq_base (method ntk, other architectures), {arch}.context_length = k*L
    and {arch}.rope.scaling.original_context_length = L; no ggufrope method keys.
    """
    from . import stock as S

    if stock:
        if in_place:
            raise GGUFRopeError("--stock writes a new file: give -o OUT instead of --in-place (the source is never modified)")
        S.check_request(method, factor, exponent, logn=logn, dynamic=dynamic, dynamic_ratio=dynamic_ratio)
        dst = _destination(model, output, in_place)
        r, e = S.export_stock(model, dst, method=method, factor=factor, exponent=exponent)
        _report(r, model, f"stock export: {e.what}")
        click.echo(f"ggufrope: note: lost in a stock file: {S.LOST} (one k = {e.factor:g} at every position, "
                   "within L too)", err=True)
        return
    from .rope_metadata import write_rope_metadata

    dst = _destination(model, output, in_place)
    S.refuse_exported(model, "ggufrope set")
    r = write_rope_metadata(model, dst, method=method, factor=factor, exponent=exponent, logn=logn, dynamic=dynamic,
                            dynamic_ratio=dynamic_ratio)
    for note in r.notes:
        click.echo(f"ggufrope: note: {note}", err=True)
    _report(r, model, r.description or method)
    click.echo("ggufrope: note: stock engines (ollama, LM Studio, stock llama.cpp) ignore these keys and run plain "
               "RoPE beyond L; for them write a copy with: ggufrope set MODEL -m METHOD -k K --stock -o OUT", err=True)


@main.command("reset", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-o", "--output", metavar="OUT", default=None, help="Write the result to OUT (atomically; an existing OUT is replaced).")
@click.option("--in-place", is_flag=True, help="Rewrite MODEL itself.")
def reset_cmd(model: str, output: str | None, in_place: bool) -> None:
    """Remove every ggufrope key from MODEL (the reserved padding key too).

    A file written by `set` from one without ggufrope keys comes back byte-identical.
    """
    from .rope_metadata import reset_rope_metadata

    dst = _destination(model, output, in_place)
    r = reset_rope_metadata(model, dst)
    what = f"removed {', '.join(r.removed)}" if r.removed else "no ggufrope keys to remove"
    _report(r, model, what)


_FLOAT32_FIELDS = ("freq_base", "stock_scaling_factor", "factor", "exponent", "dynamic_ratio")


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    from .gguf_reader import f32_repr

    out = dict(meta)
    for k in _FLOAT32_FIELDS:
        if isinstance(out.get(k), float):
            out[k] = float(f32_repr(out[k]))
    out["ggufrope_keys"] = {
        k: float(f32_repr(v)) if isinstance(v, float) else v for k, v in meta["ggufrope_keys"].items()
    }
    return out


def _show_text(meta: dict[str, Any]) -> str:
    from .gguf_reader import f32_repr

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
        ("architecture", meta["architecture"] + ("" if meta["has_rope"] else "  (no rope keys)")),
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
@click.option("--override-kv", "override_kv", is_flag=True,
              help="Print, on one shell-quoted line, the llama.cpp flags that select MODEL's method on a plain copy "
              "of the model: --override-kv KEY=TYPE:VALUE for exactly the ggufrope keys in MODEL, or for the "
              "method chosen with -m/-k/--b/--logn/--dynamic (chosen as `generate` chooses it at load time).")
@click.option("--override-kv-format", "override_format", type=click.Choice(["llama", "python"]), default=None,
              help="With --override-kv (implies it): llama (llama-server, llama-cli, llama-perplexity: "
              "--override-kv S, repeated) or python (python -m llama_cpp.server: --kv_overrides S1 S2 ..., one "
              "flag).  [default: llama]")
@click.option("-m", "--method", default=None, metavar="METHOD",
              help="With --override-kv: the method to select (none, ntk, ntk-fixed, ntk-mixed/mixed) instead of "
              "MODEL's own keys.")
@click.option("-k", "--factor", type=float, default=None, metavar="K",
              help="With --override-kv --method: factor k >= 1 (left out: auto, dynamic k unless --static).")
@click.option("--b", "--exponent", "exponent", type=float, default=None, metavar="B",
              help="With --override-kv --method ntk-mixed: exponent b, 0 < b <= 1.  [default: 0.625]")
@click.option("--logn/--no-logn", default=None,
              help="With --override-kv: log-n query scaling beyond L (alone, it keeps MODEL's method, k and b).")
@_dynamic_options("With --override-kv; left out: as --method's default (MODEL's keys without --method).")
def show_cmd(model: str, as_json: bool, override_kv: bool, override_format: str | None, method: str | None,
             factor: float | None, exponent: float | None, logn: bool | None, dynamic: bool | None,
             dynamic_ratio: float | None) -> None:
    """Print MODEL's rope metadata and the active method.

    Shows the architecture, the trained context L ({arch}.rope.scaling.original_context_length,
    else {arch}.context_length), freq_base, the rope dimensions, stock llama.cpp scaling keys,
    the ggufrope keys and the method they select.

    With --override-kv, prints instead the flags that run MODEL's method on a plain copy of the
    model, e.g. `llama-server -m plain.gguf $(ggufrope show --override-kv set.gguf)`, or
    `python -m llama_cpp.server --model plain.gguf $(ggufrope show --override-kv-format python
    set.gguf)` (the patched library reads the overridden keys as if the file had them).
    """
    from .rope_metadata import read_rope_metadata

    chosen = any(x is not None for x in (method, factor, exponent, logn, dynamic, dynamic_ratio))
    override_kv = override_kv or override_format is not None
    if chosen and not override_kv:
        raise GGUFRopeError("-m/-k/--b/--logn/--dynamic choose the method for --override-kv; "
                            "`show` alone prints MODEL's own metadata")
    if override_kv and as_json:
        raise GGUFRopeError("--override-kv prints command-line flags, --json the metadata: choose one")
    meta = read_rope_metadata(model)
    if override_kv:
        from . import override_kv as O

        got = O.choice_overrides(meta, method, factor, exponent, logn, dynamic, dynamic_ratio) if chosen else None
        kv, params = got if got is not None else (O.file_overrides(meta), {})
        click.echo(O.command_line(O.flags(kv, meta["architecture"], override_format or "llama", params)))
    elif as_json:
        click.echo(json.dumps(_jsonable(meta), indent=2))
    else:
        click.echo(_show_text(meta))


# Further commands (generate, chat, eval) are added below or from other modules with
# ``@main.command()``; GGUFRopeError raised by them is reported like the ones above.


# --- running models: generate, chat -------------------------------------------------------

_RUN_METHOD_HELP = (
    "Method chosen at load time, without rewriting MODEL: none, linear, yarn, ntk, ntk-fixed, "
    "ntk-mixed (alias mixed). Left out: MODEL's own metadata decides."
)


#: device options of every command that loads a model (run and eval)
_DEVICE_OPTIONS = [
    click.option("-ngl", "--gpu-layers", "gpu_layers", type=int, default=0, show_default=True,
                 help="Layers to offload to the GPU (-1: all)."),
    click.option("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)."),
    click.option("--verbose", is_flag=True, help="Show llama.cpp's log (it names the active rope method)."),
]


def _run_options(n_ctx_default: str) -> Any:
    """Options shared by the commands that load a model (method, context, device);
    ``n_ctx_default`` says what leaving -c out gives."""
    return lambda f: _add_run_options(f, n_ctx_default)


def _add_run_options(f: Any, n_ctx_default: str) -> Any:
    opts = [
        click.option("-c", "--n-ctx", type=click.IntRange(min=16), default=None,
                     help=f"Context size n_ctx in tokens.  [default: {n_ctx_default}]"),
        click.option("-m", "--method", default=None, metavar="METHOD", help=_RUN_METHOD_HELP),
        click.option("-k", "--factor", type=float, default=None, metavar="K",
                     help="Factor k >= 1 for --method. Left out: auto (the NTK family: dynamic k unless "
                     "--static, with which llama.cpp takes max(1, n_ctx_seq / L) when the context is created; "
                     "linear, yarn: max(1, n_ctx / L))."),
        click.option("--b", "--exponent", "exponent", type=float, default=None, metavar="B",
                     help="Exponent b of ntk-mixed, 0 < b <= 1.  [default: 0.625]"),
        click.option("--logn/--no-logn", default=None,
                     help="log-n query scaling beyond L (default: MODEL's metadata; alone, it keeps MODEL's method, k and b)."),
    ] + _DEVICE_OPTIONS
    for o in reversed(opts):
        f = o(f)
    return _dynamic_options(
        "Left out: MODEL's metadata when --method is left out (alone, --dynamic keeps MODEL's method and b), "
        "else the library's default."
    )(f)


def _load(model: str, n_ctx: int, method: str | None, factor: float | None, exponent: float | None,
          logn: bool | None, gpu_layers: int, threads: int | None, verbose: bool, dynamic: bool | None = None,
          dynamic_ratio: float | None = None) -> Any:
    from .runtime import describe, load

    kw: dict[str, Any] = {}
    if threads:
        kw["n_threads"] = kw["n_threads_batch"] = threads
    llm = load(model, method=method, factor=factor, exponent=exponent, logn=logn, dynamic=dynamic,
               dynamic_ratio=dynamic_ratio, n_ctx=n_ctx, n_gpu_layers=gpu_layers, verbose=verbose, **kw)
    click.echo(f"[ggufrope] {describe(llm)}", err=True)  # the k in use, read back from the context
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
@_run_options("the prompt's tokens + -n, rounded up to a multiple of 256, at least 512")
def generate_cmd(model: str, prompt: str | None, prompt_file: str | None, n_predict: int, temp: float,
                 seed: int, n_ctx: int | None, **run: Any) -> None:
    """Generate a continuation of a (long) prompt with MODEL.

    The prompt is evaluated in n_batch chunks with a progress bar (prompts longer than one
    batch); the continuation is streamed to stdout, timings go to stderr. Greedy by default,
    so the output is deterministic. Without -c the context fits the prompt and -n.
    """
    from .generate import count_tokens, fit_n_ctx, generate, read_prompt

    text = read_prompt(prompt, prompt_file)
    sized = None
    if n_ctx is None:
        n_prompt = count_tokens(model, text, verbose=run["verbose"])
        n_ctx = fit_n_ctx(n_prompt, n_predict)
        sized = f"the prompt's {n_prompt} tokens + -n {n_predict}, rounded up (-c N to choose)"
    llm = _load(model, n_ctx, **run)
    if sized:
        click.echo(f"[ggufrope] n_ctx {n_ctx}: {sized}", err=True)
    for piece in generate(llm, text, n_predict=n_predict, temp=temp, seed=seed, progress=True):
        click.echo(piece, nl=False)
    click.echo()
    if llm.ggufrope.dynamic:  # the k reached, read back from the context
        from .runtime import describe

        click.echo(f"[ggufrope] after generation: {describe(llm)}", err=True)


_CHAT_COMMANDS = "/reset clears the conversation (the system prompt and the document stay), /exit or Ctrl-D ends it"


@main.command("chat", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-f", "--file", "doc_file", type=click.Path(dir_okay=False), default=None,
              help="A document to put in the conversation first (a long context to ask about); it is prefilled "
              "before the first question.")
@click.option("-s", "--system", default=None, help="System prompt.")
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=256, show_default=True,
              help="Maximum tokens per answer.")
@click.option("--temp", type=float, default=0.0, show_default=True, help="Temperature; 0 is greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (temp > 0).")
@click.option("--progress/--no-progress", default=None,
              help="A prefill progress bar (with ETA) on stderr when more than one batch is evaluated.  "
              "[default: when stderr is a terminal]")
@_run_options("with -f, the document's tokens + 4096 for the conversation, rounded up to a multiple of 256; "
              "else 4096")
def chat_cmd(model: str, doc_file: str | None, system: str | None, n_predict: int, temp: float, seed: int,
             progress: bool | None, n_ctx: int | None, **run: Any) -> None:
    """Chat with MODEL in the terminal, in its chat template (the GGUF's, else ChatML; the
    one in use is named on start).

    Each turn evaluates only what the KV cache lacks (a document is prefilled once). A turn
    that would overflow the context (conversation + -n > n_ctx) is refused with a message and
    the chat goes on. /reset clears the conversation (the system prompt and the document
    stay); /exit, /quit or Ctrl-D ends it.
    """
    from .generate import CHAT_BUDGET, N_CTX_DEFAULT, Chat, ContextFull, count_tokens, fit_n_ctx, read_prompt

    try:
        import readline  # noqa: F401  (line editing and history for the prompt)
    except ImportError:  # pragma: no cover - platforms without readline
        pass
    doc = read_prompt(None, doc_file) if doc_file else None
    sized = "as given by -c"
    if n_ctx is None:
        if doc is None:
            n_ctx = N_CTX_DEFAULT
            sized = "the default without a document (-c N to choose)"
        else:
            n_doc = count_tokens(model, doc, verbose=run["verbose"])
            n_ctx = fit_n_ctx(n_doc, CHAT_BUDGET)
            sized = f"the document's {n_doc} tokens + {CHAT_BUDGET} for the conversation, rounded up (-c N to choose)"
    if progress is None:
        progress = sys.stderr.isatty()
    llm = _load(model, n_ctx, **run)
    chat = Chat(llm, system=system, document=doc, n_predict=n_predict, temp=temp, seed=seed, progress=progress)
    click.echo(f"[ggufrope] n_ctx {chat.n_ctx}: {sized}", err=True)
    click.echo(f"[ggufrope] {chat.template.line()}", err=True)
    if doc is not None:
        click.echo(f"[ggufrope] prefilling the document ({chat.document_tokens} tokens with the template)", err=True)
        chat.prefill_document()
    click.echo(f"[ggufrope] {_CHAT_COMMANDS}", err=True)
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
        except (EOFError, click.Abort):
            click.echo()
            return
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            chat.reset()
            click.echo("[ggufrope] conversation cleared" + (" (the document stays)" if doc is not None else ""),
                       err=True)
            continue
        if cmd in ("/help", "/?") or (cmd.startswith("/") and " " not in cmd and len(cmd) > 1 and cmd[1].isalpha()):
            click.echo(f"[ggufrope] {_CHAT_COMMANDS}", err=True)
            continue
        if not cmd:
            continue
        try:
            stream = chat.ask(line)  # refused (ContextFull) or prefilled here, before any output
            click.echo("model> ", nl=False)
            for piece in stream:
                click.echo(piece, nl=False)
            click.echo()
        except ContextFull as e:
            click.echo(f"ggufrope: {e}", err=True)
        except GGUFRopeError as e:  # a conversation the template cannot render: this turn only
            click.echo(f"ggufrope: error: {e}", err=True)
        except KeyboardInterrupt:
            click.echo("\n[ggufrope] interrupted", err=True)


# --- evaluation: perplexity, passkey retrieval, the comparison grid (ggufrope/evaluation/cli.py) ---

# the `eval` group adds itself to `main` when ggufrope.evaluation.cli is imported (it imports
# this module for `main`; imported last here, so either module may be imported first)
from .evaluation import cli as _evaluation_cli  # noqa: E402

if __name__ == "__main__":  # python -m ggufrope.cli
    # run as a script this module is __main__, a second copy whose `main` the group did not join
    main.add_command(_evaluation_cli.eval_group)
    main(prog_name="ggufrope")
