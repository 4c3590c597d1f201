"""Every value-taking flag of every script, parsed with each of some values: tests/test_script_flags.py's.

  python tests/walk_script_flags.py VALUE [VALUE ...] > results.json

Imports each scripts/*.py as a module (its `main` does not run) and parses, in this process, a
command line holding the script's required flags (a plain value each) and one flag set to VALUE:
through `build_parser()` for the argparse scripts (every subcommand), through
`longctx.cli.parse_absl_flags` for the absl ones (each script's own integer and float flags).
stdout: a JSON object {"scripts": {script: "argparse", "absl" or null (neither parser found)},
"results":
[{"script", "flag", "value", "accepted", "line", "status", "help"}, ...]}, where `line` and
`status` are what `longctx.cli.run` would print and exit with (`cli.describe`).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A value of each required flag that parses (what the flag is for does not matter here).
REQUIRED_VALUE = "8"


def _load(path: str):
    spec = importlib.util.spec_from_file_location("script_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outcome(parse, argv: list[str]) -> tuple[bool, str, int]:
    from longctx import cli

    try:
        parse(argv)
    except Exception as e:  # noqa: BLE001  (what the script would report, as it would)
        line, status = cli.describe(e)
        return False, line, status
    except SystemExit as e:  # a parser that exits by itself (not the house's)
        return False, f"SystemExit({e.code})", e.code if isinstance(e.code, int) else 1
    return True, "", 0


def _commands(parser: argparse.ArgumentParser, name: str):
    """(name, parser, argv prefix) of the parser and of each of its subcommands."""
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands:
        yield name, parser, []
    for action in subcommands:
        for command, sub in action.choices.items():
            for inner, parser_, prefix in _commands(sub, f"{name} {command}"):
                yield inner, parser_, [command, *prefix]


def walk_argparse(script: str, module, values: list[str]) -> list[dict]:
    out = []
    for name, parser, prefix in _commands(module.build_parser(), script):
        typed = [a for a in parser._actions if a.option_strings and a.type is not None]
        required = [a for a in parser._actions if a.option_strings and a.required]
        for action in typed:
            flag = max(action.option_strings, key=len)
            base = prefix + [x for a in required if a is not action
                             for x in (a.option_strings[0], REQUIRED_VALUE)]
            for value in values:
                accepted, line, status = _outcome(module.build_parser().parse_args,
                                                  base + [f"{flag}={value}"])
                out.append({"script": name, "flag": flag, "value": value, "accepted": accepted,
                            "line": line, "status": status, "help": action.help or ""})
    return out


def walk_absl(script: str, own: list, values: list[str]) -> list[dict]:
    """`own`: the absl flags the script defined."""
    from absl import flags

    from longctx import cli

    numbers = [f for f in own if isinstance(f.parser, (flags.IntegerParser, flags.FloatParser))]
    base = [script, "--config=configs/base.py:tiny"] + [
        f"--{f.name}={REQUIRED_VALUE}" for f in own
        if f.default is None and f.name != "config" and f not in numbers]
    out = []
    for f in numbers:
        for value in values:
            accepted, line, status = _outcome(cli.parse_absl_flags, base + [f"--{f.name}={value}"])
            flags.FLAGS.unparse_flags()
            out.append({"script": script, "flag": f"--{f.name}", "value": value, "accepted": accepted,
                        "line": line, "status": status, "help": f.help or ""})
    for f in own:  # the next script defines its own (--config again, for one)
        delattr(flags.FLAGS, f.name)
    return out


def _absl_flag_names() -> set[str]:
    from absl import flags

    return set(flags.FLAGS)


def _defined_by_the_script(name: str, module) -> bool:
    """Not by a library the script imported (grain defines absl flags of its own): absl names the
    module whose code ran DEFINE_*, which for a file loaded here is the script or the import
    machinery running it."""
    from absl import flags

    where = flags.FLAGS.find_module_defining_flag(name) or ""
    return where == module.__name__ or where.startswith("importlib")


def main() -> None:
    values = sys.argv[1:]
    os.chdir(ROOT)
    from absl import flags, logging  # noqa: F401  (absl's own flags, before any script's)

    results, scripts = [], {}
    for path in sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py"))):
        script = os.path.relpath(path, ROOT)
        before = _absl_flag_names()
        module = _load(path)
        defined = [name for name in sorted(_absl_flag_names() - before)
                   if _defined_by_the_script(name, module)]
        if hasattr(module, "build_parser"):
            scripts[script] = "argparse"
            results += walk_argparse(script, module, values)
        elif defined:
            scripts[script] = "absl"
            results += walk_absl(script, [flags.FLAGS[n] for n in defined], values)
        else:
            scripts[script] = None
    json.dump({"scripts": scripts, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
