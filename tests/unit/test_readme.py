"""README.md's commands and code, checked without starting an engine, so that the README cannot drift
from the code.

- Every ``layertap ...`` command in a ```bash block, including ``$(layertap ...)`` and
  ``torchrun ... -m layertap.cli ...``, is parsed the way ``layertap.cli.main`` parses it. First the real
  parser (``build_parser().parse_known_args``) runs. Leftover flags are accepted only by subcommands
  that pass them on to vLLM, and they must then parse with vLLM's own ``EngineArgs`` parser
  (``layertap.engine.launch.engine_kwargs``). ``train`` commands also resolve their config (``--config`` file,
  ``--set`` keys). So a flag that does not exist fails here.
- Every ```python block compiles. Its ``layertap`` / ``vllm`` imports resolve (module imported, names
  read with getattr). Calls of the imported names, and method calls on an object built from them, bind to
  the real signatures. Keywords that ``Tap`` does not name must be vLLM ``EngineArgs`` fields.
- In the prose: the subcommand of each inline ``layertap X`` is real, each inline ``--flag`` exists, each
  inline ``Tap(...)`` binds (and defaults stated as "the defaults" are the real defaults), and each
  dotted ``layertap.x`` module exists.
- Every ``scripts/``, ``benchmarks/``, ``examples/``, ``tests/`` and ``layertap/`` path exists, and so
  does every bare ``test_*.py`` name. ``bash scripts/X.sh ARG`` arguments appear in the script, and
  ``pip install ".[extras]"`` extras exist in pyproject.toml. The "Two commands" block is kept exactly
  (CI runs it).

``test_checker_catches_faults`` is the control. It feeds the same checks a bogus flag, a bogus config key,
a bogus import name, a bogus keyword and a missing path, and every one must fail.

These checks parse the commands and do not run them. The real runs happen elsewhere:
``scripts/setup.sh`` (the first README command) runs ``layertap train --out runs/main`` and
``layertap demo``. ``tests/engine/test_cli.py`` runs ``layertap capture`` (then again on the same
``--out``, resuming over ``--transport shm``) and ``layertap verify``, including a tampered record.
``tests/engine/test_pipeline.py`` runs ``layertap train --out ... --set ...``, Ctrl-C, ``kill -9`` and
``--resume``. ``tests/engine/test_serve.py`` runs ``layertap serve --model --layers --out`` with an
opted-in request. ``tests/engine/test_analysis.py`` runs ``Tap.generate`` (``n=2``, ``logits_at``,
``post_norm_last``). ``tests/engine/test_export_eval.py`` runs the code behind ``layertap export`` (all
three formats) and ``layertap eval`` through their Python functions. ``train-offline`` runs its
``Trainer`` in ``tests/unit/test_trainer.py`` and ``tests/unit/test_trainer_ddp.py``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CHECKED_IMPORTS = ("layertap", "vllm")
PATH_PREFIXES = ("scripts", "benchmarks", "examples", "tests", "layertap")
# A method that takes **kwargs and hands them to another function: its keywords are bound against that one.
FORWARDED = {("Tap", "generate"): "layertap.analysis:generate"}


class ReadmeError(AssertionError):
    pass


# ------------------------------------------------------------------------------------------ parsing
def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the first body line, body) of every fenced block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        if lang is None and line.startswith("```"):
            lang, start, body = line[3:].strip(), n + 1, []
        elif lang is not None and line.startswith("```"):
            out.append((lang, start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    if lang is not None:
        raise ReadmeError(f"README.md:{start - 1}: fenced block never closed")
    return out


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def inline_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def shell_commands(body: str, first_line: int) -> list[tuple[int, list[str]]]:
    """Simple commands (argv lists) of a shell block: continuation lines joined, comments dropped, split at
    ``;``, ``&&``, ``|`` and ``$( )``, leading ``VAR=value`` assignments removed."""
    out = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        n, line = first_line + i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        cur: list[str] = []
        for tok in [*lex, ";"]:
            if tok and set(tok) <= set("();&|"):
                while cur and re.fullmatch(r"[A-Za-z_]\w*=.*", cur[0]):
                    cur.pop(0)
                if cur:
                    out.append((n, cur))
                cur = []
            else:
                cur.append(tok)
    return out


def layertap_argv(cmd: list[str]) -> list[str] | None:
    """The arguments after ``layertap`` / ``-m layertap[.cli]``; None if the command is not layertap's."""
    if cmd[0] == "layertap":
        return cmd[1:]
    if "-m" in cmd[:-1]:
        i = cmd.index("-m")
        mod = cmd[i + 1]
        if mod == "layertap" or mod.startswith("layertap."):
            spec = importlib.util.find_spec(mod)
            if spec is None or (spec.submodule_search_locations and importlib.util.find_spec(mod + ".__main__") is None):
                raise ReadmeError(f"`python -m {mod}`: no such runnable module")
            return cmd[i + 2 :]
    return None


# ------------------------------------------------------------------------------------------ the CLI
def _parser() -> argparse.ArgumentParser:
    from layertap.cli import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    raise ReadmeError("layertap's parser has no subcommands")


def _quiet(fn: Any, *a: Any) -> Any:
    """Run an argparse-style call; its SystemExit becomes a ReadmeError carrying argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return fn(*a)
    except SystemExit as e:
        msg = err.getvalue().strip().splitlines()
        raise ReadmeError(msg[-1] if msg else str(e)) from None


def _engine_kwargs() -> Any:
    """The function the CLI parses engine flags with (it moved from ``layertap.cli.engine_flags`` to
    ``layertap.engine.launch``)."""
    for mod in ("layertap.engine.launch", "layertap.cli.engine_flags"):
        with contextlib.suppress(ImportError, AttributeError):
            return importlib.import_module(mod).engine_kwargs
    raise ReadmeError("layertap's engine_kwargs (vLLM engine flags) not found")


def check_cli(argv: list[str]) -> None:
    """Parse ``layertap ARGV`` as ``layertap.cli.main`` does, without running it."""
    engine_kwargs = _engine_kwargs()
    args, rest = _quiet(_parser().parse_known_args, argv)
    if getattr(args, "func", None) is None:
        raise ReadmeError("no subcommand")
    if rest:
        if not getattr(args, "accepts_engine_flags", False):
            raise ReadmeError(f"unrecognized arguments: {' '.join(rest)}")
        try:
            _quiet(engine_kwargs, rest)  # vLLM's EngineArgs parser: an unknown engine flag fails here
        except ValueError as e:  # a flag layertap sets itself (EngineFlagError)
            raise ReadmeError(str(e)) from None
    args.engine_argv = rest
    if args.command == "train":
        from layertap.cli.pipeline_cmds import resolve_config

        try:
            resolve_config(args)  # --config file and --set keys
        except (ValueError, FileNotFoundError) as e:
            raise ReadmeError(str(e)) from None


def known_flags() -> set[str]:
    flags = {s for p in _subparsers(_parser()).values() for s in p._option_string_actions}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    flags |= set(EngineArgs.add_cli_args(FlexibleArgumentParser())._option_string_actions)
    for sh in (ROOT / "scripts").glob("*.sh"):
        flags |= set(re.findall(r"(?<![\w-])--[a-z][\w-]*", sh.read_text()))
    return flags


def check_bash_block(body: str, first_line: int) -> int:
    """Check every command of a shell block; returns how many layertap commands were parsed."""
    n_cli = 0
    for n, cmd in shell_commands(body, first_line):
        where = f"README.md:{n}: `{shlex.join(cmd)}`"
        try:
            argv = layertap_argv(cmd)
            if argv is not None:
                check_cli(argv)
                n_cli += 1
            elif cmd[0] == "bash" and len(cmd) > 1:
                check_script_call(cmd[1:])
            elif cmd[:2] == ["pip", "install"]:
                check_pip_extras(cmd[2:])
        except ReadmeError as e:
            raise ReadmeError(f"{where}: {e}") from None
    return n_cli


def check_script_call(argv: list[str]) -> None:
    script = ROOT / argv[0]
    if not script.is_file():
        raise ReadmeError(f"{argv[0]} does not exist")
    text = script.read_text()
    for arg in argv[1:]:
        for alt in arg.split("|"):  # `gpu_check.sh startup|tests|...` names the choices
            if not re.search(rf"(?<![\w-]){re.escape(alt)}(?![\w-])", text):
                raise ReadmeError(f"{argv[0]} knows no argument {alt!r}")


def check_pip_extras(argv: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for a in argv:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", a)
        for name in m.group(1).split(",") if m else []:
            if name not in extras:
                raise ReadmeError(f"pyproject.toml has no extra {name!r} (extras: {', '.join(extras)})")


# ------------------------------------------------------------------------------------------ Python
def _resolve_import(mod: str, name: str | None) -> Any:
    try:
        m = importlib.import_module(mod)
    except ImportError as e:
        raise ReadmeError(f"import {mod}: {e}") from None
    if name is None:
        return m
    try:
        return getattr(m, name)
    except AttributeError:
        try:
            return importlib.import_module(f"{mod}.{name}")
        except ImportError:
            raise ReadmeError(f"from {mod} import {name}: {mod} has no {name!r}") from None


def _engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def check_call(obj: Any, call: ast.Call, label: str, *, skip_first: bool = False) -> None:
    """Bind the call's arguments (placeholders) to ``obj``'s real signature."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return  # *args / **kwargs at the call: nothing to bind
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())[1 if skip_first else 0 :]
    sig = sig.replace(parameters=params)
    kwargs = {k.arg: None for k in call.keywords}
    given = [a for a in call.args if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]
    bind = sig.bind_partial if len(given) < len(call.args) else sig.bind  # `f(..., k=v)`: more arguments elided
    try:
        bind(*[None] * len(given), **kwargs)
    except TypeError as e:
        raise ReadmeError(f"{label}(...): {e}") from None
    from layertap.tap import Tap

    if obj is Tap:  # what Tap does not name goes to vLLM's engine
        named = {p.name for p in params}
        src = inspect.getsource(Tap)
        extra = [k for k in kwargs if k not in named and k not in _engine_arg_names() and f'"{k}"' not in src]
        if extra:
            raise ReadmeError(f"Tap(...): {extra} are neither Tap arguments nor vLLM EngineArgs fields")


def check_python(body: str, where: str) -> None:
    try:
        tree = ast.parse(body, where)
        compile(tree, where, "exec")
    except SyntaxError as e:
        raise ReadmeError(f"{where}: {e}") from None
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in CHECKED_IMPORTS:
                        _resolve_import(a.name, None)
                        top = a.name.split(".")[0]
                        names[a.asname or top] = importlib.import_module(a.asname and a.name or top)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in CHECKED_IMPORTS:
                for a in node.names:
                    names[a.asname or a.name] = _resolve_import(node.module, a.name)
        except ReadmeError as e:
            raise ReadmeError(f"{where}, line {node.lineno}: {e}") from None
    instances: dict[str, type] = {}  # variable -> class, for `with Tap(...) as tap` and `tap = Tap(...)`
    for node in ast.walk(tree):
        ctor = target = None
        if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            ctor, target = node.context_expr, node.optional_vars.id
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            ctor, target = node.value, node.targets[0].id
        if isinstance(ctor, ast.Call) and isinstance(ctor.func, ast.Name) and inspect.isclass(names.get(ctor.func.id)):
            instances[target] = names[ctor.func.id]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        try:
            if isinstance(f, ast.Name) and f.id in names and callable(names[f.id]):
                check_call(names[f.id], node, f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in instances:
                cls = instances[f.value.id]
                if not hasattr(cls, f.attr):
                    raise ReadmeError(f"{cls.__name__} has no attribute {f.attr!r}")
                fwd = FORWARDED.get((cls.__name__, f.attr))
                if fwd:
                    mod, _, fn = fwd.partition(":")
                    check_call(getattr(importlib.import_module(mod), fn), node, f"{cls.__name__}.{f.attr}",
                               skip_first=True)
                else:
                    check_call(getattr(cls, f.attr), node, f"{cls.__name__}.{f.attr}", skip_first=True)
        except ReadmeError as e:
            raise ReadmeError(f"{where}, line {node.lineno}: {e}") from None


# ------------------------------------------------------------------------------------------ prose
def check_paths(text: str) -> int:
    found = set(re.findall(rf"(?<![\w/.$-])((?:{'|'.join(PATH_PREFIXES)})/[\w./-]*[\w/])", text))
    missing = sorted(p for p in found if not (ROOT / p).exists())
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    bare = set(re.findall(r"(?<![\w/])(test_\w+\.py)", text))
    missing += sorted(b for b in bare if b not in tests)
    if missing:
        raise ReadmeError(f"README.md names paths that do not exist: {missing}")
    return len(found) + len(bare)


def check_inline(text: str, flags: set[str]) -> None:
    subs = set(_subparsers(_parser()))
    from layertap.tap import Tap

    body = prose(text)
    for line in body.splitlines():  # a code span broken over two lines is not checked
        if line.count("`") % 2:
            raise ReadmeError(f"an inline code span is broken over a line end: {line.strip()!r}")
    for span in inline_spans(text):
        words = span.split()
        if words[0] == "layertap" and len(words) > 1 and not words[1].isupper() and words[1] not in subs:
            raise ReadmeError(f"`{span}`: no subcommand {words[1]!r}")
        if len(words) > 1 and words[0] == "bash" and words[1].startswith("scripts/"):
            check_script_call(words[1:])
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", span):
            if flag not in flags:
                raise ReadmeError(f"`{span}`: {flag} is not a flag of layertap, vLLM's engine or scripts/")
        if re.fullmatch(r"layertap(\.\w+)+", span) and importlib.util.find_spec(span) is None:
            raise ReadmeError(f"`{span}`: no such module")
        if span.startswith("--set ") and re.fullmatch(r"--set [a-z_.]+=\S+", span):
            from layertap.pipeline.config import apply_overrides

            try:
                apply_overrides({}, [span.split(" ", 1)[1]])
            except ValueError as e:
                raise ReadmeError(f"`{span}`: {e}") from None
        if span.startswith("Tap("):
            call = ast.parse(span, mode="eval").body
            check_call(Tap, call, "Tap")
            after = body[body.index(f"`{span}`") + len(span) + 2 :][:40]
            if "(the defaults" in after:  # values the README states as defaults must be the real ones
                params = inspect.signature(Tap).parameters
                for kw in call.keywords:
                    if params[kw.arg].default != ast.literal_eval(kw.value):
                        raise ReadmeError(f"`{span}`: the default of {kw.arg} is {params[kw.arg].default!r}")


# ------------------------------------------------------------------------------------------ tests
def test_two_commands_block_is_kept():
    blocks = [b for lang, _, b in fenced_blocks(README) if lang == "bash"]
    assert "## Two commands" in README
    assert blocks and blocks[0].splitlines()[:2] == [
        "bash scripts/setup.sh     # set up (.venv, vLLM CPU build, layertap + extras) and run the main job",
        "bash scripts/test.sh      # run the tests (unit + real vLLM CPU engine tests; GPU tests are deselected)",
    ]


def test_bash_blocks_parse_with_the_real_cli(monkeypatch):
    monkeypatch.chdir(ROOT)  # --config examples/run.yaml is relative to the checkout
    blocks = [(n, b) for lang, n, b in fenced_blocks(README) if lang in ("bash", "sh", "shell")]
    assert blocks
    parsed = sum(check_bash_block(b, n) for n, b in blocks)
    assert parsed >= 10, f"only {parsed} layertap commands found in README.md's bash blocks"


def test_python_blocks_compile_and_their_imports_resolve():
    blocks = [(n, b) for lang, n, b in fenced_blocks(README) if lang == "python"]
    assert len(blocks) >= 3
    for n, b in blocks:
        check_python(b, f"README.md:{n}")


def test_named_paths_exist():
    assert check_paths(README) >= 10


def test_inline_commands_flags_and_modules():
    check_inline(README, known_flags())


def test_checker_catches_faults(monkeypatch):
    """The control: each check fails on a README that is wrong in one place."""
    monkeypatch.chdir(ROOT)
    cmd = "layertap capture --model M --data d.jsonl --layers 1,2 --out o"
    check_bash_block(cmd, 1)  # the unmodified command passes
    bad_bash = [
        cmd + " --bogus-flag 3",  # a flag neither layertap nor vLLM knows
        cmd.replace("--layers 1,2 ", ""),  # a required flag left out
        "layertap verify runs/x --max-model-len 9",  # verify passes nothing to vLLM
        "layertap capture-all --model M",  # no such subcommand
        "X=$(layertap build-model --kind gpt2)",  # inside $( ), a choice that does not exist
        "layertap train --set train.lrr=0.001",  # a config key that does not exist
        "layertap train --config examples/nope.yaml",  # a config file that does not exist
        "torchrun --nproc-per-node 2 -m layertap.clix train-offline ds --kind eagle3 --out o",
        "bash scripts/gpu_check.sh bench-tp4",
        'pip install -e ".[hf,gpu]"',
    ]
    for text in bad_bash:
        with pytest.raises(ReadmeError):
            check_bash_block(text, 1)
    for text in ["from layertap import Tapp",
                 "import layertap.nope",
                 "from layertap.drafters.export import speculative_config\nspeculative_config('d', nums=3)",
                 "from layertap import Tap\nTap(model='m', layers=[1], max_model_lenn=8)",
                 "from layertap import Tap\nwith Tap(model='m', layers=[1]) as t:\n    t.generate(['x'], logits_att='all')",
                 "from layertap import Tap\nwith Tap(model='m', layers=[1]) as t:\n    t.generat(['x'])",
                 "def f(:\n    pass"]:
        with pytest.raises(ReadmeError):
            check_python(text, "control")
    with pytest.raises(ReadmeError):
        check_paths("see `benchmarks/NO_SUCH_FILE.md` and `test_nothing_here.py`")
    flags = known_flags()
    for text in ["use `--capture-everything`", "`layertap trian`", "`layertap.nothing`", "`--set train.nope=1`",
                 "`Tap(..., start_timeout=5)` (the defaults)", "`Tap(..., start_timeoutt=900)`",
                 "a span `broken over\na line` end"]:
        with pytest.raises(ReadmeError):
            check_inline(text, flags)
