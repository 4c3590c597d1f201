"""The one way every script starts and ends: devices before jax, and one line per failure.

  from longctx import cli

  cli.start()                      # first thing: virtual CPU devices before jax is imported
                                   # (cli.start(cpu_devices=None) in scripts that run no jax)
  import jax ...

  def main(): ...                  # argparse scripts: returns an exit status or None

  if __name__ == "__main__":
      cli.run(main)                # or cli.run_absl(main) for absl/ml_collections flags

`start` also makes an exception that escapes while the script imports its modules one line (as
an unexpected error; Python then exits with status 1).

What the user sees when something goes wrong is one line on stderr, no traceback:

  longctx: <message>                    a LongctxError (errors.py): the message names the
                                        file, key or step and what to do
  longctx: unexpected <Type>: <first line of the message> (pass --verbose or set
           LONGCTX_DEBUG=1 for the traceback)       anything else (one line, wrapped here)
  longctx: interrupted.                 Ctrl-C (KeyboardInterrupt)

Exit status:
  0    success (or whatever `main` returns)
  1    a run that failed: RunError (non-finite loss, a save that could not be written) or an
       unexpected exception
  2    input that cannot run: ConfigError (config key, data file, workdir, checkpoint directory, a
       train step the compiler refuses for lack of device memory), bad command-line flags
  130  interrupted

`--verbose` anywhere on a script's command line (removed before the script parses its flags) or
`LONGCTX_DEBUG=1` in the environment also prints the traceback; `--verbose` sets LONGCTX_DEBUG=1
so that child processes (ablate.py's training runs) do the same. Without it, third-party log
lines (libraries' Python/absl log records below ERROR, Python warnings, XLA's C++ INFO lines) are
kept out of the output (`quiet_third_party_logs`, from `start`; launch/local.py drops gloo's).

`--validate_only` on any script's command line (also removed before the script parses its flags;
`--validate-only` works too) checks the flags, the config and the files the command needs, as
cheaply as it can, and stops before anything is trained, compiled, prepared or written: the script
calls `validated(what)` at that point, which under the flag ends it with exit status 0 and one
line, `longctx: --validate_only: <what>; nothing was run.` (and is a no-op otherwise). Bad input
is reported exactly as in a real run (exit 2). The flag sets LONGCTX_VALIDATE_ONLY=1 for child
processes (launch/local.py's, ablate.py's).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import keyword
import logging
import os
import re
import signal
import sys
import traceback
import warnings
from typing import Callable

from longctx.errors import ConfigError, LongctxError, MissingFileError, RunError
from longctx.parallel import devices

PREFIX = "longctx: "
DEBUG_ENV = "LONGCTX_DEBUG"
VERBOSE_FLAG = "--verbose"
VALIDATE_ENV = "LONGCTX_VALIDATE_ONLY"
VALIDATE_FLAGS = ("--validate_only", "--validate-only")
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
_HINT = f"(pass {VERBOSE_FLAG} or set {DEBUG_ENV}=1 for the traceback)"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    """`text` on one line: lines joined with spaces, surrounding blanks dropped."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def validate_only() -> bool:
    """True under `--validate_only` (this process's flag, or a parent's through the environment)."""
    return os.environ.get(VALIDATE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class _Validated(BaseException):
    """Raised by `validated` to end a validate-only run; `run` prints it and exits 0. Not an
    Exception, so that no `except Exception` between the check and `run` can swallow it."""


def validated(what: str) -> None:
    """The point where a script has checked everything it can without running: under
    `--validate_only` the script ends here (exit 0, one line naming `what` was checked)."""
    if validate_only():
        raise _Validated(what)


def take_verbose_flag(argv: list[str]) -> bool:
    """Removes every `--verbose` before a `--` from `argv` (in place); True if there was one."""
    return _take_flags(argv, (VERBOSE_FLAG,))


def take_validate_flag(argv: list[str]) -> bool:
    """Removes every `--validate_only` before a `--` from `argv` (in place); True if there was one."""
    return _take_flags(argv, VALIDATE_FLAGS)


def _take_flags(argv: list[str], names: tuple[str, ...]) -> bool:
    end = argv.index("--") if "--" in argv else len(argv)
    found = [i for i in range(1, end) if argv[i] in names]
    for i in reversed(found):
        del argv[i]
    return bool(found)


def _take_start_flags(argv: list[str]) -> None:
    if take_verbose_flag(argv):
        os.environ[DEBUG_ENV] = "1"
    if take_validate_flag(argv):
        os.environ[VALIDATE_ENV] = "1"


def describe(error: BaseException) -> tuple[str, int]:
    """The line to print for `error` (without the prefix) and the exit status."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted.", EXIT_INTERRUPTED
    if isinstance(error, LongctxError):
        status = EXIT_BAD_INPUT if isinstance(error, ConfigError) else EXIT_FAILED
        return one_line(error) or type(error).__name__, status
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    hint = "" if debug_enabled() else " " + _HINT
    return f"unexpected {type(error).__name__}{': ' + first if first else ''}{hint}", EXIT_FAILED


def start(cpu_devices: int | None = 8) -> None:
    """The bootstrap, first thing in every script: says in one line when this Python lacks the
    packages (not .venv's), puts the repository on the path (a config file anywhere may `from
    configs import base`), takes `--verbose` off the command line, makes an exception escaping
    from the script's imports one line, and with `cpu_devices` sets the virtual CPU device count
    (the default when LONGCTX_CPU_DEVICES is unset) before jax starts."""
    require_packages()
    if _REPO not in sys.path:
        sys.path.append(_REPO)  # appended: an installed `configs` or longctx comes first
    _take_start_flags(sys.argv)
    sys.excepthook = _excepthook
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    quiet_third_party_logs()
    if cpu_devices is not None:
        try:
            devices.configure_cpu_devices(cpu_devices)
        except LongctxError as e:  # e.g. LONGCTX_CPU_DEVICES=abc
            sys.exit(report(e))


# The status `run` exits with, once the script's outcome is said (None before).
_exit_status: int | None = None


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM before a script handles it itself (train_and_evaluate does from its first line: one
    line, then a stop that saves once it trains): one line and status 143 through every `finally`,
    where Python's default ended the process silently (in the seconds its imports take).

    After the outcome is said, the process is only exiting: it ends at once, with the outcome's
    status and nothing more said. Raised there, SystemExit lands in an atexit callback (jax's
    shutdown, which with a dead peer waits until the coordination service aborts the process):
    a traceback, then the abort's, after the run's last line."""
    if _exit_status is not None:
        os._exit(_exit_status)
    os.write(2, f"{PREFIX}SIGTERM: stopped.\n".encode())  # (a handler that writes to sys.stderr
    raise SystemExit(128 + signum)                       # while it is being written fails)


# What every script imports that a Python without .venv lacks (setup.cfg's install_requires).
REQUIRED_PACKAGES = ("jax", "numpy", "absl", "ml_collections")


def require_packages(python: str | None = None) -> None:
    """Exits with one line (status 2) when this interpreter lacks the packages, before any is
    imported: `python scripts/train.py` with a system Python, not `.venv/bin/python`. (The
    scripts put the repository on the path before importing this module, so it is found.)"""
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(f"{PREFIX}{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         f"installed for {python or sys.executable}: run the scripts with "
                         ".venv/bin/python (`make demo` or `make test` creates .venv first).\n")
        sys.exit(EXIT_BAD_INPUT)


# Code whose log records are longctx's own: the package and the repository's scripts and configs
# (not the repository as a whole: `make` puts the libraries in its .venv/); anything else is a
# library.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_CODE = tuple(os.path.join(_REPO, d) + os.sep for d in ("longctx", "scripts", "configs", "benchmarks"))


class _ThirdPartyLogs(logging.Filter):
    """Drops the log records below ERROR that libraries log through Python or absl logging
    (Orbax's notes on read-only directories, tensorboardX's "NaN or Inf found in input tensor",
    ...): what a run shows is longctx's own lines. `--verbose` (LONGCTX_DEBUG=1) keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = os.path.abspath(record.pathname).startswith(_OWN_CODE)
        return own or record.levelno >= logging.ERROR or debug_enabled()


_THIRD_PARTY_LOGS = _ThirdPartyLogs()


def quiet_third_party_logs() -> None:
    """Keeps library log lines out of a script's output unless --verbose (from `start`): Python and
    absl log records (`_ThirdPartyLogs`, on absl's handler and on the handler Python uses when
    there is none), Python warnings, and XLA/TSL's C++ INFO lines (TF_CPP_MIN_LOG_LEVEL=1, read
    when jax loads). What the user set in the environment wins. gloo's "[Gloo] Rank N is connected"
    lines are C++ writes to stdout: launch/local.py drops them from its children's output."""
    if debug_enabled():
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if not sys.warnoptions and not os.environ.get("PYTHONWARNINGS"):
        warnings.simplefilter("ignore")
    from absl import logging as absl_logging  # lazily, with the logs quieted (light: no jax)

    # absl's records (Orbax logs through absl) on their logger, whatever handler prints them;
    # other libraries' records on the handlers: absl's (absl apps) or, until then, a filtered
    # stand-in for the one Python's logging.warning() would install (absl's replaces it).
    absl_logger = logging.getLogger("absl")
    if _THIRD_PARTY_LOGS not in absl_logger.filters:
        absl_logger.addFilter(_THIRD_PARTY_LOGS)
    if not logging.root.handlers:
        stand_in = logging.StreamHandler(sys.stderr)
        stand_in.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        logging.root.addHandler(stand_in)
    for handler in (absl_logging.get_absl_handler(), *logging.root.handlers):
        if _THIRD_PARTY_LOGS not in handler.filters:
            handler.addFilter(_THIRD_PARTY_LOGS)


def run(main: Callable[[], int | None], argv: list[str] | None = None) -> None:
    """Runs `main()` and exits: its return value is the status, a failure is one line on stderr."""
    argv = sys.argv if argv is None else argv
    _take_start_flags(argv)
    try:
        status = main()
    except SystemExit as e:
        _said(e.code)
        raise
    except _Validated as done:
        print(f"{PREFIX}{VALIDATE_FLAGS[0]}: {done}; nothing was run.", flush=True)
        status = 0
    except BaseException as e:  # noqa: BLE001  (KeyboardInterrupt included: one line too)
        status = report(e)
    _said(status)
    sys.exit(status)


def _said(code) -> None:
    """Records the status the process exits with, its outcome said (`_stop_on_sigterm`)."""
    global _exit_status
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # (os._exit does not)
        except Exception:  # noqa: BLE001  (a stream already gone)
            pass
    _exit_status = code if isinstance(code, int) else 0 if code is None else 1


# The longest error message one process hands the others (bytes of UTF-8; longer ones are cut).
_AGREED_MESSAGE_BYTES = 2048


def agreed(check: Callable[[], object]):
    """`check()` on every process of a multi-process job, then agreement before anyone goes on.

    Start-up checks that read this host's own files (the data directory, the workdir) can fail on
    one process and pass on the others, which would then wait forever in their next collective
    for a process that has exited. Here every process runs `check`, then all exchange the outcome
    (one collective); if any failed, every process raises: the failing one its own error, the
    others the same kind of error with its message, naming the process. Returns `check()`'s value.
    `check` must not run collectives itself. (Imports jax: only after `start`.)
    """
    import jax  # lazily: cli is imported before jax may be (cli.start sets its devices first)

    if jax.process_count() == 1:
        return check()
    import numpy as np

    from longctx.parallel import processes  # lazily, with jax

    value, error = None, None
    try:
        value = check()
    except Exception as e:  # noqa: BLE001  (every failure is agreed on, then raised)
        error = e
    status = 0 if error is None else EXIT_BAD_INPUT if isinstance(error, ConfigError) else EXIT_FAILED
    text = b"" if error is None else describe(error)[0].encode()[:_AGREED_MESSAGE_BYTES]
    mine = np.zeros(_AGREED_MESSAGE_BYTES + 1, np.int32)
    mine[0] = status
    mine[1:1 + len(text)] = np.frombuffer(text, np.uint8)
    everyone = processes.allgather(mine)
    if error is not None:
        raise error
    failed = [i for i in range(len(everyone)) if everyone[i, 0]]
    if not failed:
        return value
    first = failed[0]
    message = bytes(everyone[first, 1:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
    kind = ConfigError if everyone[first, 0] == EXIT_BAD_INPUT else RunError
    raise kind(f"process {first} of {len(everyone)} stopped at start-up: {message}")


def report(error: BaseException) -> int:
    """Prints `error` as one line on stderr (after its traceback in debug mode); the exit status."""
    message, status = describe(error)
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001  (stdout already gone: the line on stderr still matters)
        pass
    if debug_enabled():
        traceback.print_exception(type(error), error, error.__traceback__)
    sys.stderr.write(PREFIX + message + "\n")
    sys.stderr.flush()
    return status


def _excepthook(kind, error, tb) -> None:
    """sys.excepthook after `start`: what escapes outside `run` (a failing import) is one line."""
    if not isinstance(error, BaseException) or isinstance(error, SystemExit):
        sys.__excepthook__(kind, error, tb)
        return
    report(error)


def run_absl(main: Callable[[list[str]], int | None]) -> None:
    """`run` for absl scripts: `app.run(main)` with flag errors (unknown config keys included)
    turned into one-line ConfigErrors."""
    from absl import app  # lazily, as all of absl here: scripts without absl flags never load it

    run(lambda: app.run(main, flags_parser=parse_absl_flags))


# ----------------------------------------------------------------------------- argparse flags


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the scripts: a bad flag (a value out of its range, a missing or unknown flag)
    is one ConfigError line naming it, which `run` prints with exit status 2, not a usage block.
    Subcommands' parsers (`add_subparsers`) are of this class too."""

    def error(self, message: str):
        raise ConfigError(f"{message} ({self.prog} -h lists the flags).")


def int_at_least(minimum: int):
    """argparse `type=` of an integer flag whose value must be >= `minimum`: the flag's range is
    declared where the flag is, and a value below it, or not a whole number, is refused while the
    command line is parsed (under --validate_only too), naming the flag."""
    return _bounded(int, "a whole number", minimum, inclusive=True)


def float_at_least(minimum: float):
    """`int_at_least` for a number that may have a fraction."""
    return _bounded(float, "a number", minimum, inclusive=True)


def float_above(minimum: float):
    """argparse `type=` of a number that must be more than `minimum` (a size, a tolerance > 0)."""
    return _bounded(float, "a number", minimum, inclusive=False)


def _bounded(kind: type, what: str, minimum, inclusive: bool):
    least = f"at least {minimum}" if inclusive else f"more than {minimum}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; it must be {least}") from None
        if value < minimum or (value == minimum and not inclusive) or value != value:  # (NaN)
            raise argparse.ArgumentTypeError(f"{text} is out of range; it must be {least}")
        return value

    parse.__name__ = kind.__name__  # (argparse names the type by it in its own messages)
    parse.minimum, parse.inclusive = minimum, inclusive  # the declared range, for the tests
    return parse


# ----------------------------------------------------------------------------- absl flags


def parse_absl_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, where every error is a ConfigError naming the flag."""
    from absl import flags  # lazily: only absl scripts parse absl flags

    # ml_collections reads the overrides from sys.argv itself, not from the argv it is given.
    names = [name for name, _ in _config_flags()]
    argv = list(argv)
    new_type_keys = take_new_type_keys(argv)
    sys.argv[:] = quote_keyword_keys([arg for arg in sys.argv if arg not in new_type_keys], names)
    try:
        rest = flags.FLAGS(quote_keyword_keys(argv, names))
    except flags.Error as e:
        error = config_load_error(argv)  # the config file raised TypeError/ValueError
        if error is not None:
            raise error from None
        raise ConfigError(f"{_flag_error_text(e)} (--helpshort lists the flags).") from None
    except (KeyError, AttributeError, OSError) as e:  # ml_collections: unknown --config.x.y key
        error = config_file_error(argv) or config_load_error(argv) or unknown_override(argv)
        if error is not None:
            raise error from None
        raise ConfigError(f"cannot parse the command line: {one_line(e)}.") from e
    except Exception:  # noqa: BLE001  (the config file raised: SyntaxError, NameError, ...)
        error = config_load_error(argv)
        if error is None:
            raise
        raise error from None
    error = config_file_error(argv)  # ml_collections defers a missing file's error to first use
    if error is not None:
        raise error
    set_type_keys(new_type_keys)
    return rest


def _new_type_key(arg: str) -> re.Match | None:
    """`--<config flag>.attention.layer_types.<type>.<key>=VALUE`, parsed (or None)."""
    return re.match(r"^--?(?P<flag>[^.=]+)\.attention\.layer_types\.(?P<type>[^.=]+)\.(?P<key>[^.=]+)=(?P<value>.*)$",
                    arg, re.S)


def take_new_type_keys(argv: list[str]) -> dict[str, re.Match]:
    """Removes from `argv` (in place) and returns, by argument, each override of a layer type's key
    (layer_types.TYPE_KEYS: docs/attention.md lists them) that the config file's type does not set,
    or of a type it does not define. ml_collections overrides only keys a config already has, and a
    type sets only what sets it apart, so to ml_collections `--config.attention.layer_types.local.
    chunk_size=64` on a type without a chunk is an unknown key; `set_type_keys` sets these once the
    flags are parsed."""
    from longctx.model import layer_types  # lazily: it imports jax, which start() must precede

    taken = {}
    for name, flag in _config_flags():
        spec = _flag_value(argv, name)
        matches = [(arg, m) for arg in argv[1:] if (m := _new_type_key(arg)) and m["flag"] == name
                   and m["key"] in layer_types.TYPE_KEYS]
        if spec is None or not matches:
            continue
        try:
            config = flag.parser.parse(spec)
            types = config.attention.get("layer_types") or {}
        except Exception:  # noqa: BLE001  (the config file itself fails: parsing says so)
            continue
        for arg, m in matches:
            if m["type"] not in types or m["key"] not in types[m["type"]]:
                taken[arg] = m
    argv[:] = [arg for arg in argv if arg not in taken]
    return taken


def set_type_keys(taken: dict[str, re.Match]) -> None:
    """Sets the layer-type keys `take_new_type_keys` took, in the parsed configs, each value read
    as ml_collections reads a literal (true/false, a number, None, else the string)."""
    from absl import flags  # lazily: only absl scripts parse absl flags

    from longctx.model import layer_types  # lazily: it imports jax, which start() must precede

    for m in taken.values():
        text = m["value"].capitalize() if m["value"] in ("true", "false") else m["value"]
        try:
            value = ast.literal_eval(text)
        except (SyntaxError, ValueError):
            value = m["value"]
        layer_types.set_type_key(flags.FLAGS[m["flag"]].value, m["type"], m["key"], value)


def quote_keyword_keys(argv: list[str], config_flag_names: list[str]) -> list[str]:
    """`--config.attention.layer_types.global.rope_theta=...` as ml_collections can read it.

    ml_collections parses an override's path as a Python expression, where a key that is a
    keyword (`global`: the name of a hybrid's full-attention layers, as Gemma calls them) is a
    syntax error; written as a subscript (`layer_types["global"]`) it is the same key. Other
    arguments are returned as they are."""
    if not config_flag_names:
        return list(argv)
    flag = "|".join(map(re.escape, config_flag_names))
    out = []
    for arg in argv:
        m = re.match(rf"^(--?(?:no)?(?:{flag}))\.([^=]+)(.*)$", arg)
        parts = m.group(2).split(".") if m else []
        if not any(keyword.iskeyword(part) for part in parts):
            out.append(arg)
            continue
        path = "".join(f'["{part}"]' if keyword.iskeyword(part) else f".{part}" for part in parts)
        out.append(m.group(1) + path + m.group(3))
    return out


def _flag_error_text(error: Exception) -> str:
    """absl's message, without the traceback ml_collections puts inside it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return f"{lines[0]} {lines[-1]}"
    return " ".join(lines)


def _config_flags():
    """(name, flag) of every ml_collections config-file flag defined."""
    from absl import flags  # lazily: only absl scripts define config-file flags
    from ml_collections.config_flags import config_flags

    for name in list(flags.FLAGS):
        flag = flags.FLAGS[name]
        if config_flags.is_config_flag(flag) and isinstance(flag.parser,
                                                            config_flags.ConfigFileFlagParser):
            yield name, flag


def config_file_error(argv: list[str]) -> ConfigError | None:
    """A ConfigError naming a `--config=FILE[:ARG]` whose file does not exist or does not load."""
    for name, _ in _config_flags():
        spec = _flag_value(argv, name)
        if spec is None:
            continue
        path = spec.split(":", 1)[0]
        if not os.path.isfile(path):
            return ConfigError(f"--{name}={spec}: config file {path} does not exist.")
    return None


def config_load_error(argv: list[str]) -> ConfigError | None:
    """The ConfigError of the first `--<config flag>=FILE[:ARG]` whose file does not load."""
    for name, _ in _config_flags():
        spec = _flag_value(argv, name)
        if spec is not None and os.path.isfile(spec.split(":", 1)[0]):
            try:
                load_config_file(spec, flag=f"--{name}")
            except ConfigError as e:
                return e
    return None


def load_config_file(spec: str, flag: str = "--config"):
    """`FILE[:ARG]` -> FILE's `get_config(ARG)` (what `--config=FILE:ARG` gives an absl script),
    for scripts that take a config file by argparse. A missing file, or one that does not load
    (a syntax error, a name error, any exception in `get_config`), is a ConfigError of one line
    that names the flag and FILE:LINE; a ValueError from `get_config` is the config's own sentence
    (configs/base.py: an unknown preset) and is kept as it is."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise MissingFileError(f"{flag}={spec}: config file {path} does not exist.")
    try:
        module_spec = importlib.util.spec_from_file_location("_longctx_config_file", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module.get_config(arg) if ":" in spec else module.get_config()
    except ValueError as e:
        raise ConfigError(one_line(e)) from None
    except Exception as e:  # noqa: BLE001  (the user's file: whatever it raises is bad input)
        where = _location_in(e, path)
        locked = _locked_key(e)
        if locked:
            raise ConfigError(f"{flag}={spec}: the config file does not load: {where}{locked}.") from None
        text = e.msg if isinstance(e, SyntaxError) else next(iter(str(e).splitlines()), "")
        raise ConfigError(f"{flag}={spec}: the config file does not load: {where}"
                          f"{type(e).__name__}{': ' + text.strip() if text.strip() else ''}.") from None


def _locked_key(error: BaseException) -> str | None:
    """For a key a config file sets that its (locked) config does not have, where ml_collections'
    message dumps the whole section: the key and the section's keys, closest first; else None."""
    m = re.search(r'Key "([^"]+)" does not exist and cannot be added since the config is locked', str(error))
    tb, section = error.__traceback__, None
    while tb is not None:  # the innermost ConfigDict method's `self`: the section it was set on
        owner = tb.tb_frame.f_locals.get("self")
        if type(owner).__name__ == "ConfigDict":
            section = owner
        tb = tb.tb_next
    if not m or section is None:
        return None
    keys = [str(k) for k in section.keys()]
    ranked = difflib.get_close_matches(m.group(1), keys, n=len(keys), cutoff=0.0)
    return (f"{m.group(1)!r} is not a key of the section it is set on (the config is locked against new "
            f"keys); its keys, closest first: {', '.join(ranked)}")


def _location_in(error: BaseException, path: str) -> str:
    """"FILE:LINE: " where `error` arose in the config file `path` (the innermost of its lines in
    the traceback; for a syntax error, the line it names), else ""."""
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        name = path if _same_file(error.filename, path) else error.filename
        return f"{name}:{error.lineno}: "
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if _same_file(frame.filename, path)]
    return f"{path}:{lines[-1]}: " if lines else ""


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def unknown_override(argv: list[str]) -> ConfigError | None:
    """A ConfigError naming the first `--<config flag>.a.b=...` whose key the config lacks."""
    for name, flag in _config_flags():
        spec = _flag_value(argv, name)
        if spec is None:
            continue
        try:
            config = flag.parser.parse(spec)
        except Exception:  # noqa: BLE001  (the config file itself fails: not this question)
            continue
        for arg in argv[1:]:
            m = re.match(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)", arg)
            if m:
                error = check_key(config, m.group(1), arg)
                if error is not None:
                    return error
    return None


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv[1:], 1):
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
            return argv[i + 1]
        m = re.match(rf"^--?{re.escape(name)}=(.*)$", arg)
        if m:
            return m.group(1)
    return None


def check_key(config, path: str, arg: str) -> ConfigError | None:
    """None if `path` ("model.num_layers") names a field of `config`, else the error for `arg`."""
    node, seen = config, []
    for part in path.split("."):
        if not hasattr(node, "keys"):
            return ConfigError(f"unknown config key {path} in {arg}: {'.'.join(seen)} is a value, "
                               "not a section.")
        keys = [str(k) for k in node.keys()]
        if part not in keys and not keys:
            return ConfigError(f"unknown config key {path} in {arg}: {'.'.join(seen) or 'the config'} "
                               "has no keys.")
        if seen[:2] == ["attention", "layer_types"] and len(seen) == 3:  # (a type sets any of its keys)
            from longctx.model import layer_types  # lazily: it imports jax, which start() must precede

            keys = list(layer_types.TYPE_KEYS)
        if part not in keys:
            where = (f"the keys of {'.'.join(seen)}" if len(seen) != 3 or seen[1] != "layer_types"
                     else "the keys a layer type sets") if seen else "the config's top-level keys"
            ranked = difflib.get_close_matches(part, keys, n=len(keys), cutoff=0.0)
            return ConfigError(f"unknown config key {'.'.join(seen + [part])} in {arg}; {where}, "
                               f"closest first: {', '.join(ranked)}.")
        node = node[part]
        seen.append(part)
    return None
