#!/usr/bin/env python3
"""Run one multi-process JAX job on this machine: P processes x D virtual CPU devices, on loopback.

  python launch/local.py --num-processes 2 --devices-per-process 4 -- \\
      .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/mp

Every child gets the environment that `longctx.parallel.mesh.maybe_initialize_distributed` and
`longctx.parallel.devices.configure_cpu_devices` read:

  LONGCTX_COORDINATOR=127.0.0.1:<port>   (a free port, or --port)
  LONGCTX_NUM_PROCESSES=P   LONGCTX_PROCESS_ID=i   LONGCTX_CPU_DEVICES=D
  JAX_NUM_CPU_DEVICES=D   JAX_PLATFORMS=cpu   PYTHONUNBUFFERED=1

(JAX_NUM_CPU_DEVICES takes precedence over a device count in the parent's XLA_FLAGS, which is
passed on with XLA:CPU's collective timeouts raised and every flag the user set kept, as
`configure_cpu_devices` does: so even a child that imports jax without longctx gets D devices,
and none aborts when a starved device thread reaches a collective late.)

so the P processes form one `jax.distributed` job (gloo collectives) with P*D devices.

Behaviour:
- Every output line of child i is prefixed with `[p<i>] ` (stdout to stdout, stderr to stderr;
  carriage-return progress-bar updates are prefixed too). gloo's "[Gloo] Rank N is connected to
  M peer ranks" lines are dropped unless the command has --verbose or LONGCTX_DEBUG is set.
- --validate_only (before `--`, or in the command): the command runs once, alone, with
  --validate_only on P*D CPU devices (no job is formed), and its status is the launcher's.
- If any child exits non-zero (or dies by a signal), the others get SIGTERM, then SIGKILL after
  --grace-period seconds, and the launcher exits non-zero (the first failing child's status).
- SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every child (SIGHUP as
  SIGTERM), so the training loop's preemption handler saves a checkpoint on all processes; the
  launcher then waits up to --stop-timeout seconds before killing what is left. A second signal
  kills at once.
- Exit status: 0 iff every child exited 0.
- No orphans: each child leads its own process group (the whole group is killed on the way out),
  and on Linux each child gets PR_SET_PDEATHSIG=SIGKILL, so even a launcher killed by SIGKILL
  takes its children with it.

This file imports nothing from jax, and from longctx only `longctx.parallel.devices` (which
imports no jax); it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

# This checkout's longctx, whichever Python runs the launcher.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx.parallel.devices import with_cpu_collective_timeouts  # noqa: E402

# Sanity limits for virtual CPU devices: beyond these a loopback job is a typo, not a plan.
MAX_PROCESSES = 64
MAX_DEVICES_PER_PROCESS = 256
MAX_TOTAL_DEVICES = 1024

PROG = "launch/local.py"

# longctx.cli's --validate_only (longctx.cli imports absl, so the names are repeated).
VALIDATE_FLAGS = ("--validate_only", "--validate-only")
VALIDATE_ENV = "LONGCTX_VALIDATE_ONLY"


class LaunchError(Exception):
    """Bad input: printed as one sentence, exit status 2."""


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start P local processes that form one JAX job over loopback.",
        usage=f"{PROG} --num-processes P --devices-per-process D [--port PORT] -- COMMAND [ARGS...]",
    )
    parser.add_argument("--num-processes", "-n", type=int, required=True, metavar="P")
    parser.add_argument("--devices-per-process", "-d", type=int, required=True, metavar="D")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--grace-period", type=float, default=5.0, metavar="SECONDS",
                        help="after a child fails, how long the others get between SIGTERM and SIGKILL")
    parser.add_argument("--stop-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="after a forwarded SIGINT/SIGTERM, how long children get to save and exit")
    parser.add_argument(*VALIDATE_FLAGS, dest="validate_only", action="store_true",
                        help="check these flags, then run COMMAND once with --validate_only on P*D "
                             "devices (no job is formed; also when COMMAND carries the flag)")
    args = parser.parse_args(own)
    args.command = command
    args.validate_only = (args.validate_only or any(a in VALIDATE_FLAGS for a in command)
                          or os.environ.get(VALIDATE_ENV, "").strip().lower() not in ("", "0", "false", "no"))
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    p, d = args.num_processes, args.devices_per_process
    if not args.command:
        raise LaunchError("no command given: put the command to run after `--`, e.g. "
                          f"`{PROG} -n 2 -d 4 -- python scripts/train.py ...`.")
    if p < 1:
        raise LaunchError(f"--num-processes must be at least 1, got {p}.")
    if d < 1:
        raise LaunchError(f"--devices-per-process must be at least 1, got {d}.")
    if p > MAX_PROCESSES:
        raise LaunchError(f"--num-processes {p} is more than the {MAX_PROCESSES} processes a loopback "
                          "job on one machine supports.")
    if d > MAX_DEVICES_PER_PROCESS:
        raise LaunchError(f"--devices-per-process {d} is more than the {MAX_DEVICES_PER_PROCESS} "
                          "virtual CPU devices a process supports.")
    if p * d > MAX_TOTAL_DEVICES:
        raise LaunchError(f"{p} processes x {d} devices = {p * d} devices, more than the "
                          f"{MAX_TOTAL_DEVICES} virtual CPU devices a loopback job supports.")
    if args.port and not 0 < args.port < 65536:
        raise LaunchError(f"--port {args.port} is not a TCP port (1-65535).")
    if args.grace_period < 0 or args.stop_timeout < 0:
        raise LaunchError("--grace-period and --stop-timeout must not be negative.")


# ----------------------------------------------------------------------------- the port


def port_in_use(port: int) -> bool:
    """True if a server could not bind `port` (the coordinator binds all interfaces)."""
    families = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")] if socket.has_ipv6 else []
    families = families or [(socket.AF_INET, "0.0.0.0")]
    for family, host in families:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # this address family is not available here
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is fine
            s.bind((host, port))
            return False
        except OSError as e:
            if e.errno == errno.EADDRINUSE or e.errno == errno.EACCES:
                return True
            continue  # e.g. IPv6 disabled: try IPv4
        finally:
            s.close()
    return False


def free_port() -> int:
    try:
        import portpicker

        return portpicker.pick_unused_port()
    except Exception:  # portpicker missing or its port server unreachable
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def choose_port(requested: int) -> int:
    if requested:
        if port_in_use(requested):
            raise LaunchError(f"coordinator port {requested} is already in use on this machine; "
                              "choose another --port or omit --port to get a free one.")
        return requested
    return free_port()


# ----------------------------------------------------------------------------- children


def child_env(base: dict[str, str], port: int, num_processes: int, process_id: int,
              devices: int) -> dict[str, str]:
    env = dict(base)
    env.update(
        LONGCTX_COORDINATOR=f"127.0.0.1:{port}",
        LONGCTX_NUM_PROCESSES=str(num_processes),
        LONGCTX_PROCESS_ID=str(process_id),
        LONGCTX_CPU_DEVICES=str(devices),
        JAX_NUM_CPU_DEVICES=str(devices),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS=with_cpu_collective_timeouts(base.get("XLA_FLAGS", "")),
    )
    return env


def validate_command(args: argparse.Namespace) -> int:
    """--validate_only: the command checks itself once, alone, on the job's P*D devices (what its
    config must fit); forming a job would only add the start-up of P processes. Its status."""
    devices = args.num_processes * args.devices_per_process
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCTX_") or k == "LONGCTX_DEBUG"}
    env.update(LONGCTX_CPU_DEVICES=str(devices), JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu",
               XLA_FLAGS=with_cpu_collective_timeouts(os.environ.get("XLA_FLAGS", "")))
    env[VALIDATE_ENV] = "1"
    try:
        return subprocess.run(args.command, env=env, stdin=subprocess.DEVNULL).returncode
    except OSError as e:
        raise LaunchError(f"cannot start {args.command[0]!r}: {e.strerror or e}.") from None


def _pdeathsig_preexec(parent_pid: int):
    """In the child before exec: die with the launcher, even if the launcher is SIGKILLed."""
    libc = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            libc = None

    def preexec():
        if libc is not None:
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent_pid:  # the launcher died before prctl took effect
                os._exit(1)

    return preexec


# gloo (the CPU collectives) writes this from C++ to stdout for every communicator it connects,
# a dozen lines per job and run, from its own threads (so possibly inside a line of the child's:
# removed from the stream, not as whole lines). Kept with --verbose / LONGCTX_DEBUG=1.
GLOO_NOISE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                        rb"Expected number of connected peer ranks is : \d+\r?\n")
# Two of gloo's threads writing at once interleave their messages piece by piece ("[Gloo] Rank
# [Gloo] Rank 00 is connected to  is connected to 11 peer ranks.  peer ranks. ...: 11" and a
# second newline; seen about once in 10 two-process start-ups under load): a line made only of
# those pieces and their numbers, with the blank lines the other messages' newlines leave.
GLOO_INTERLEAVED = re.compile(
    rb"(?m)^(?=[^\n]*(?:\[Gloo\] Rank | is connected to |Expected number of connected peer ranks is : ))"
    rb"(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. |Expected number of connected peer ranks is : )+"
    rb"(?:\r?\n)+")


def drop_gloo_noise(data: bytes) -> bytes:
    """`data` without gloo's connection messages, whole or interleaved."""
    return GLOO_INTERLEAVED.sub(b"", GLOO_NOISE.sub(b"", data))


def verbose(command: list[str]) -> bool:
    """--verbose in the child's command (longctx.cli takes it) or LONGCTX_DEBUG in the environment."""
    return "--verbose" in command or os.environ.get("LONGCTX_DEBUG", "").strip().lower() not in (
        "", "0", "false", "no")


class _Pump(threading.Thread):
    """Copies one child stream to ours, prefixing every line (and every \\r-terminated update)."""

    def __init__(self, stream, out, prefix: bytes, lock: threading.Lock, quiet: bool = True):
        super().__init__(daemon=True)
        self.stream, self.out, self.prefix, self.lock = stream, out, prefix, lock
        self.quiet = quiet  # drop gloo's connection lines (drop_gloo_noise)

    def _emit(self, piece: bytes) -> None:
        with self.lock:
            try:
                self.out.write(self.prefix + piece)
                self.out.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # our own stdout went away; keep draining so the child never blocks

    def run(self) -> None:
        fd = self.stream.fileno()
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            if self.quiet:
                pending = drop_gloo_noise(pending)
            # Emit every complete piece; a trailing "\r" waits in case "\n" follows it.
            cut = max(pending.rfind(b"\n"), pending.rstrip(b"\r").rfind(b"\r"))
            if cut >= 0:
                head, pending = pending[:cut + 1], pending[cut + 1:]
                for piece in re.findall(rb"[^\r\n]*(?:\r\n|\n|\r)", head):
                    if piece.endswith(b"\r") and not piece.strip():
                        continue  # a progress bar clearing its line: nothing worth a prefix
                    self._emit(piece)
        if pending:
            # The last line may lack its newline: a child that exits while gloo's thread is between
            # its message and the newline (seen once in 7 runs under load) leaves the bare message.
            pending += b"\n"
            if self.quiet:
                pending = drop_gloo_noise(pending)
            if pending.strip():
                self._emit(pending)
        self.stream.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signals the child's whole process group (it leads one), or the child if that fails."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def _exit_status(returncode: int) -> int:
    """A child's returncode as a shell would report it (a signal n -> 128 + n)."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


class Job:
    def __init__(self, args: argparse.Namespace, port: int):
        self.args = args
        self.port = port
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[_Pump] = []
        self.signals: list[int] = []  # signals received, handled in the main loop
        self.lock = threading.Lock()

    def say(self, message: str) -> None:
        with self.lock:
            sys.stderr.write(f"[{PROG}] {message}\n")
            sys.stderr.flush()

    def start(self) -> None:
        a = self.args
        self.say(f"{a.num_processes} process(es) x {a.devices_per_process} CPU device(s), "
                 f"coordinator 127.0.0.1:{self.port}: {shlex.join(a.command)}")
        for i in range(a.num_processes):
            env = child_env(os.environ, self.port, a.num_processes, i, a.devices_per_process)
            try:
                proc = subprocess.Popen(
                    a.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=_pdeathsig_preexec(os.getpid()))
            except OSError as e:
                raise LaunchError(f"cannot start {a.command[0]!r}: {e.strerror or e}.") from None
            self.procs.append(proc)
            for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                pump = _Pump(stream, out, f"[p{i}] ".encode(), self.lock, quiet=not verbose(a.command))
                pump.start()
                self.pumps.append(pump)

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, sig)

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def kill_everything(self) -> None:
        """SIGKILL every child's process group, including grandchildren left behind by a child."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                try:
                    proc.kill()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def run(self) -> int:
        """Waits for the children; returns the launcher's exit status."""
        stop_deadline = None
        failed = None
        while True:
            if self.signals:
                sig, self.signals = self.signals[0], []
                if stop_deadline is None:
                    forward = signal.SIGTERM if sig == signal.SIGHUP else sig
                    self.say(f"got {signal.Signals(sig).name}; forwarding {signal.Signals(forward).name} "
                             f"to all processes (waiting up to {self.args.stop_timeout:g}s; "
                             "signal again to kill at once).")
                    self.signal_all(forward)
                    stop_deadline = time.monotonic() + self.args.stop_timeout
                else:
                    self.say("second signal; killing all processes.")
                    self.kill_everything()
                    return 128 + sig
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code is not None and code != 0:
                    failed = (i, code)
                    break
            if failed is not None:
                break
            if all(c is not None for c in codes):
                return 0
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                self.say(f"processes still running {self.args.stop_timeout:g}s after the stop signal; "
                         "killing them.")
                self.kill_everything()
                return 1
            time.sleep(0.05)

        i, code = failed
        others = [p for j, p in enumerate(self.procs) if j != i and p.poll() is None]
        if others:
            self.say(f"process {i} {_describe(code)}; stopping the other {len(others)} process(es).")
            self.signal_all(signal.SIGTERM)
            if not self.wait_all(self.args.grace_period):
                self.say(f"killing process(es) still running after {self.args.grace_period:g}s.")
        else:
            self.say(f"process {i} {_describe(code)}.")
        return _exit_status(code) or 1

    def finish(self) -> None:
        self.kill_everything()  # no-op for exited children; reaps any stray grandchildren
        for pump in self.pumps:
            pump.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.validate_only:
            return _exit_status(validate_command(args))
        port = choose_port(args.port)
    except LaunchError as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 2

    job = Job(args, port)

    def on_signal(signum, frame):
        job.signals.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        job.start()
        status = job.run()
    except LaunchError as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        status = 2
    finally:
        # Whatever happened (including an exception in the launcher), leave nothing behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        job.finish()
    return status


if __name__ == "__main__":
    sys.exit(main())
