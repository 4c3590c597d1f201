"""One run per workdir: a lease that a run holds while it runs, and that a second run respects.

Two trainers on one workdir would both start "fresh" and overwrite each other's checkpoints,
metrics.jsonl and run_info.json. So `hold(workdir)` (in `train_and_evaluate`, after the config,
the workdir and the data are checked, before anything in the workdir is read or written) takes
`workdir/.lease/`:

- free (no lease, or the last holder released it): taken, silently;
- held by a live run: refused with one sentence naming the holder (host, pid, since when) and the
  fix (a ConfigError, exit status 2), before anything is compiled or written;
- stale (the holder is gone): taken over, with one line saying whose it was and why it is stale.

The lease is a sequence of small JSON records, `.lease/<n>.json`; the highest n is the lease's
state. Every change (taking it, each refresh, the release) *creates* the next number, only if it
does not exist yet, and then removes the older files: a file is never rewritten, so a reader never
sees half a record, and of two runs that try to change the same state only one can create n+1.
A change counts only if the number it created is then the highest: a holder paused past the stale
time, whose lease was taken over meanwhile and refreshed by the taker (which removed every record
below its own, this run's n+1 included), can still create n+1, and finds the taker's above it.
Such a holder has lost the lease: it writes nothing more, and its run stops before its next save
(longctx.train.loop reads the lease at each sync step and again right before a save that follows
an evaluation), with one line naming the taker.
Each record names the holder: host, pid (and on Linux the pid's start time and the boot/pid
namespace it lives in), the run's start, its last refresh and a random run id.

While the run runs, a daemon thread refreshes the lease every `REFRESH_S` seconds; the release (at
the end, also on an error, or after SIGTERM/SIGINT, which the training loop turns into a normal
exit) writes a "released" record. A run killed by SIGKILL leaves its last record behind, stale:

- on the same machine (same hostname, boot id and pid namespace) the holder is gone when its pid
  no longer runs (or now runs another program: the start time differs, or is a zombie): the next
  run takes over at once. A holder that is alive but has not refreshed for 3 x its interval
  (a hung process) is stale too;
- on another machine no pid can be checked: a lease not refreshed for 3 x its interval is stale.
  A starter watches the lease for at least 1.5 intervals before it decides (so a clock that is
  off cannot make it take a live run's lease: a live holder refreshes within one interval) and at
  most 3 intervals. Seeing a refresh means the holder lives: refused.

Several processes (jax.distributed): process 0 alone takes, refreshes and releases the lease, and
its decision (taken, or the refusal's sentence) reaches every process through one all-gather, so
they all refuse together and none waits for a process that left.

What the storage must offer (the storage-specific part is `_LocalFiles` and `_FsspecFiles`,
four operations each):
- create a file with its content only if it does not exist, atomically: locally the content is
  written to a private temporary file that is then hard-linked to the record's name (`link(2)`
  fails with EEXIST if the name exists: atomic on local file systems and NFS, where an EEXIST is
  checked against the private file's link count); on gs:// an upload
  with the precondition `ifGenerationMatch=0` (gcsfs >= 2024.12: `pipe_file(mode="create")`,
  which raises FileExistsError on HTTP 412);
- list a directory as it is now (gs:// is strongly consistent for listings; gcsfs's listing cache
  is bypassed), read a file, delete a file.
The gs:// class cannot be tested against GCS here: the tests run the same fsspec calls against
fsspec's in-memory file system (which implements `mode="create"` the same way); everything else
(the rules, the races) is the same code for both and is tested on local disk with real processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
import socket
import threading
import time
from typing import Callable

import numpy as np

from longctx import errors
from longctx.train import workdir as workdir_lib

LEASE_DIR = ".lease"
REFRESH_S = 10.0  # the holder refreshes this often
STALE_INTERVALS = 3  # not refreshed for this many of the holder's intervals: stale
WATCH_MIN_INTERVALS = 1.5  # a holder on another machine is watched at least this long
_POLL_S = 0.5  # how often a watched lease is read again
_RECORD = re.compile(r"^(\d+)\.json$")
_MESSAGE_BYTES = 4096  # the refusal's sentence, sent from process 0 to the others

_held_run_ids: set[str] = set()  # leases this process holds now (not stale to itself)


# ----------------------------------------------------------------------------- records


def _proc_field(pid: int, index: int) -> str | None:
    """Field `index` (0-based, after the command name) of /proc/<pid>/stat, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    return _proc_field(pid, 19)


def _machine() -> str:
    """Where a pid means something: hostname, boot id and pid namespace (the last two on Linux;
    containers on one kernel share the boot id but not the pid namespace)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "|".join(parts)


def _pid_runs(pid: int, start: str | None) -> bool:
    """Whether `pid` runs on this machine and is the process that was recorded (same start time,
    where known); a zombie (killed, not yet reaped) does not run."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if _proc_field(pid, 0) == "Z":
        return False
    return start is None or _pid_start(pid) in (None, start)


@dataclasses.dataclass(frozen=True)
class Record:
    """One state of the lease: who holds it (or held it last) and when it was last refreshed."""

    run_id: str
    host: str
    pid: int
    machine: str
    pid_start: str | None
    started: float  # unix time, the holder's clock
    refreshed: float
    refresh_s: float  # the holder's refresh interval
    released: bool = False

    @classmethod
    def mine(cls, now: float, refresh_s: float) -> "Record":
        return cls(run_id=secrets.token_hex(8), host=socket.gethostname(), pid=os.getpid(),
                   machine=_machine(), pid_start=_pid_start(os.getpid()), started=now, refreshed=now,
                   refresh_s=refresh_s)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Record":
        fields = json.loads(data)
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})

    def holder(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {_utc(self.started)}"


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# ----------------------------------------------------------------------------- the rules


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: str  # "free", "stale", "held" or "watch"
    why: str = ""  # for "stale": why the holder counts as gone


def judge(record: Record, now: float, machine: str, *, watched_s: float = 0.0) -> Verdict:
    """What a starter on `machine` at `now` may do with the lease in `record`, having watched it
    unchanged for `watched_s` seconds (the rules are in the module docstring)."""
    if record.released:
        return Verdict("free")
    age = now - record.refreshed
    stale_after = STALE_INTERVALS * record.refresh_s
    if record.machine == machine:
        if record.run_id in _held_run_ids:
            return Verdict("held")  # this very process holds it (a second run started inside it)
        if not _pid_runs(record.pid, record.pid_start):
            return Verdict("stale", f"its process {record.pid} on {record.host} is gone")
        if age > stale_after:
            return Verdict("stale", f"its process has not refreshed it for {age:.0f} s")
        return Verdict("held")
    # Another machine: the clocks may differ, so the age alone never decides before the lease has
    # been watched for more than one of its intervals (a live holder refreshes within one).
    if age > stale_after and watched_s >= WATCH_MIN_INTERVALS * record.refresh_s:
        return Verdict("stale", f"not refreshed for {age:.0f} s")
    if watched_s >= stale_after:
        return Verdict("stale", f"not refreshed in the {watched_s:.0f} s this run watched it")
    return Verdict("watch")


def watch_deadline_s(record: Record, now: float) -> float:
    """How long a lease on another machine is watched at most before it is judged stale."""
    stale_after = STALE_INTERVALS * record.refresh_s
    return min(stale_after, max(WATCH_MIN_INTERVALS * record.refresh_s, stale_after - (now - record.refreshed)))


def refusal(workdir: str, record: Record, now: float) -> str:
    return (f"workdir {workdir} is in use by another run ({record.holder()}, lease refreshed "
            f"{max(now - record.refreshed, 0.0):.0f} s ago in {workdir}/{LEASE_DIR}): wait for that "
            f"run to finish, stop it, or pass another --workdir.")


# ----------------------------------------------------------------------------- storage


class _LocalFiles:
    """The lease directory on a local (or NFS) file system."""

    def __init__(self, directory: str):
        self.directory = directory

    def create(self, name: str, data: bytes) -> bool:
        """Writes `name` with `data` unless it exists; False if it did. Atomic: link(2) of a
        complete private file. On NFS a LINK whose reply was lost is sent again, and the retry
        answers EEXIST for the name the first call made: the private file's link count (2: the
        name is this file) tells that success from another run's name, as open(2) advises."""
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, name)
        temporary = os.path.join(self.directory, f".tmp-{secrets.token_hex(8)}")
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temporary, path)
            return True
        except FileExistsError:
            return os.stat(temporary).st_nlink == 2
        finally:
            os.unlink(temporary)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.directory)
        except FileNotFoundError:
            return []

    def read(self, name: str) -> bytes:
        with open(os.path.join(self.directory, name), "rb") as f:
            return f.read()

    def delete(self, name: str) -> None:
        os.unlink(os.path.join(self.directory, name))


class _FsspecFiles:
    """The lease directory in a bucket (gs://...), through fsspec (gcsfs); `fs` is the file system.
    `create` relies on `pipe_file(mode="create")`: an upload with ifGenerationMatch=0 on GCS."""

    def __init__(self, directory: str, fs):
        self.directory, self.fs = directory.rstrip("/"), fs

    def create(self, name: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(f"{self.directory}/{name}", data, mode="create")
            return True
        except FileExistsError:  # gcsfs: HTTP 412, the precondition failed
            return False

    def names(self) -> list[str]:
        try:
            paths = self.fs.ls(self.directory, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(f"{self.directory}/{name}")

    def delete(self, name: str) -> None:
        self.fs.rm_file(f"{self.directory}/{name}")


def _files(workdir: str):
    directory = f"{str(workdir_lib.resolve(workdir)).rstrip('/')}/{LEASE_DIR}"
    if not workdir_lib.is_remote(workdir):
        return _LocalFiles(directory)
    import fsspec  # lazily: gs:// only (installed with etils; gs:// needs gcsfs >= 2024.12, the `gcs` extra)

    protocol = str(workdir).split("://", 1)[0]
    try:
        fs = fsspec.filesystem(protocol)
    except (ImportError, ValueError) as e:
        raise errors.ConfigError(f"workdir {workdir}: cannot reach {protocol}:// storage for the run's "
                                 f"lease ({errors.first_line(e)}); for gs:// install gcsfs>=2024.12 "
                                 "(pip install -e .[gcs]).") from None
    return _FsspecFiles(directory, fs)


def _number(name: str) -> int | None:
    m = _RECORD.match(name)
    return int(m.group(1)) if m else None


def _name(number: int) -> str:
    return f"{number}.json"


def _numbers(files) -> list[int]:
    return sorted(n for n in map(_number, files.names()) if n is not None)


def _newest(files, workdir: str) -> tuple[int, Record] | None:
    """The highest record and its number, or None; a record removed while it is read (its holder
    just refreshed) is looked up again."""
    for _ in range(50):
        numbers = _numbers(files)
        if not numbers:
            return None
        try:
            return numbers[-1], Record.from_json(files.read(_name(numbers[-1])))
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, TypeError) as e:
            raise errors.ConfigError(
                f"workdir {workdir}: the lease record {LEASE_DIR}/{_name(numbers[-1])} cannot be read "
                f"({errors.first_line(e)}); if no run uses this workdir, delete {workdir}/{LEASE_DIR}.") from None
    raise errors.ConfigError(f"workdir {workdir}: its lease in {LEASE_DIR} changes too fast to be read.")


def _remove_below(files, number: int) -> None:
    """Removes the records older than `number` (best effort: they no longer decide anything)."""
    for n in _numbers(files):
        if n < number:
            try:
                files.delete(_name(n))
            except OSError:
                pass


# ----------------------------------------------------------------------------- taking it


def acquire(workdir: str, *, files=None, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.time,
            sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] = print,
            start_refreshing: bool = True) -> "Lease":
    """Takes the lease of `workdir` for this process, or raises the ConfigError that names its
    holder. `files`, `clock`, `sleep` and `say` are for tests; `say` gets the take-over note."""
    files = _files(workdir) if files is None else files
    machine = _machine()
    watching: tuple[int, str, float] | None = None  # (number, run id, since) of a watched lease
    for _ in range(1000):  # each pass ends in a decision or follows a change someone else made
        now = clock()
        newest = _newest(files, workdir)
        note = None
        if newest is None:
            number = 1
        else:
            number, record = newest
            if (watching is not None and watching[1] == record.run_id and watching[0] != number
                    and not record.released):
                raise errors.ConfigError(refusal(workdir, record, now))  # it refreshed: alive
            watched = now - watching[2] if watching is not None and watching[0] == number else 0.0
            verdict = judge(record, now, machine, watched_s=watched)
            if verdict.kind == "held":
                raise errors.ConfigError(refusal(workdir, record, now))
            if verdict.kind == "watch":
                if watching is None or watching[0] != number:
                    watching = (number, record.run_id, now)
                    say(f"longctx: workdir {workdir} is leased by {record.holder()}, whose pid cannot be "
                        f"checked from here, last refreshed {max(now - record.refreshed, 0):.0f} s ago; watching it for up "
                        f"to {watch_deadline_s(record, now):.0f} s to see whether that run is alive.")
                sleep(_POLL_S)
                continue
            if verdict.kind == "stale":
                note = (f"longctx: took over the lease of workdir {workdir} from {record.holder()}: "
                        f"{verdict.why}.")
            number += 1
        mine = Record.mine(clock(), refresh_s)
        if not files.create(_name(number), mine.to_json()):
            continue  # another starter changed the lease first: judge its record
        if max(_numbers(files), default=number) != number:
            # A starter that read an older state created a lower number again (the number it
            # took had been removed): the highest one decides, and it is not ours.
            files.delete(_name(number))
            continue
        _remove_below(files, number)
        if note:
            say(note)
        lease = Lease(workdir, files, number, mine, clock=clock, say=say)
        if start_refreshing:
            lease.start()
        return lease
    raise errors.ConfigError(f"workdir {workdir}: its lease in {LEASE_DIR} keeps changing; another "
                             "run is starting there.")


def check_free(workdir: str, *, files=None, clock: Callable[[], float] = time.time) -> None:
    """--validate_only's look at the lease, reading only: the ConfigError `acquire` would raise when
    the holder is a live run on this machine. (One elsewhere is judged only by watching it, which
    `acquire` does; here it passes.)"""
    files = _files(workdir) if files is None else files
    newest = _newest(files, workdir)
    if newest is not None and judge(newest[1], clock(), _machine()).kind == "held":
        raise errors.ConfigError(refusal(workdir, newest[1], clock()))


class Lease:
    """A held lease: refreshed by a daemon thread (`start`), given back by `release` (or `with`).

    It is lost when another run takes it over (this one was paused or starved past the stale
    time): a refresh finds the next number taken or, once the taker has refreshed (and so
    removed every record below its own), a number above the one it created. From then on it
    writes nothing, and `still_held` says so; the training loop asks before every save and
    stops with `lost_reason`, so two runs never write the same checkpoints."""

    def __init__(self, workdir: str, files, number: int, record: Record, *, clock=time.time, say=print):
        self.workdir, self.files, self.number, self.record = workdir, files, number, record
        self.clock, self.say = clock, say
        self.lost = False
        self.lost_reason = ""  # set with `lost`: whose the lease is now, for the one line
        self._reported = False  # whether someone took `lost_reason` to the user (else release says it)
        self._lock = threading.Lock()  # (the refresh thread moves `number`; a check reads it)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        _held_run_ids.add(record.run_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._refresh_loop, name="longctx-lease", daemon=True)
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.record.refresh_s):
            self.refresh()

    def _advance(self, record: Record) -> bool:
        """Creates the next record; False (and `lost`) if another run holds the lease now: it created
        that number first, or (having refreshed since it took over, which removed this run's
        records) a higher one. The number created must be the highest, as in `acquire`."""
        number = self.number + 1
        created = self.files.create(_name(number), record.to_json())
        if created and max(_numbers(self.files), default=number) == number:
            self.number, self.record = number, record
            _remove_below(self.files, self.number)
            return True
        if created:  # below the taker's record: it decides nothing, and is not ours to leave there
            try:
                self.files.delete(_name(number))
            except OSError:
                pass
        self._lose()
        return False

    def _lose(self) -> None:
        try:
            taker = _newest(self.files, self.workdir)
            holder = taker[1].holder() if taker is not None else "another run"
        except Exception:  # noqa: BLE001  (the taker's name is only for the message)
            holder = "another run"
        self.lost = True
        self.lost_reason = (f"the lease of workdir {self.workdir} was taken over by {holder} while this run "
                            f"had not refreshed it for {max(self.clock() - self.record.refreshed, 0):.0f} s "
                            "(paused or starved past the stale time)")

    def refresh(self) -> None:
        with self._lock:
            if self.lost:
                return
            try:
                self._advance(dataclasses.replace(self.record, refreshed=self.clock()))
                self._failing = False
            except Exception as e:  # noqa: BLE001  (a network error: the next refresh tries again)
                if not self._failing:
                    self.say(f"longctx: WARNING: could not refresh the lease of workdir {self.workdir} "
                             f"({errors.first_line(e)}); trying again in {self.record.refresh_s:.0f} s.")
                self._failing = True

    def still_held(self) -> bool:
        """Whether this run holds the lease now (its record is the highest), read from the storage:
        asked before anything is saved. False also when a refresh found it lost. A storage that
        cannot be read answers True (the refresh thread says so; a save there fails on its own)."""
        with self._lock:
            if self.lost:
                return False
            try:
                highest = max(_numbers(self.files), default=None)
            except Exception:  # noqa: BLE001
                return True
            if highest != self.number:
                self._lose()
            return not self.lost

    def lost_error(self) -> str:
        """`lost_reason`, for the caller that stops the run with it (release then says nothing)."""
        self._reported = True
        return self.lost_reason

    def release(self) -> None:
        """Stops the refreshes and marks the lease released (the next run takes it at once). A lease
        lost and never reported is reported here, once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _held_run_ids.discard(self.record.run_id)
        with self._lock:
            if not self.lost and not self.record.released:
                try:
                    self._advance(dataclasses.replace(self.record, refreshed=self.clock(), released=True))
                except Exception as e:  # noqa: BLE001  (the lease then goes stale, and is taken over)
                    self.say(f"longctx: WARNING: could not release the lease of workdir {self.workdir} "
                             f"({errors.first_line(e)}); the next run takes it over when it is stale.")
            if self.lost and not self._reported:
                self._reported = True
                self.say(f"longctx: WARNING: {self.lost_reason}; this run's and that run's files there may "
                         "have mixed.")

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _NotHeld:
    """What processes other than 0 get from `hold`: nothing to refresh or release (process 0's
    answer to `still_held` reaches them through the loop's agreement)."""

    lost = False

    def still_held(self) -> bool:
        return True

    def lost_error(self) -> str:
        return ""

    def release(self) -> None:
        pass

    def __enter__(self) -> "_NotHeld":
        return self

    def __exit__(self, *exc) -> None:
        pass


# ----------------------------------------------------------------------------- several processes


def _from_process_0(message: str) -> str:
    """Process 0's `message` on every process (one all-gather of a fixed-size byte array)."""
    import jax  # lazily (not above: the lease itself needs no jax, and starts without it)
    from longctx.parallel import processes  # lazily, with jax

    if jax.process_count() == 1:
        return message

    data = message.encode()[:_MESSAGE_BYTES]
    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    gathered = processes.allgather(buffer)
    return bytes(gathered.reshape(-1, _MESSAGE_BYTES)[0]).rstrip(b"\0").decode(errors="replace")


def _say(line: str) -> None:
    print(line, flush=True)


def hold(workdir: str) -> Lease | _NotHeld:
    """The run's lease of `workdir` (use it as a context manager). Process 0 takes it; every process
    raises the same ConfigError when it cannot be taken (another run holds it)."""
    import jax  # lazily, as in _from_process_0

    lease, failure = None, None
    if jax.process_index() == 0:
        try:
            lease = acquire(workdir, say=_say)
        except errors.LongctxError as e:
            failure = e
        except Exception as e:  # noqa: BLE001  (storage errors: every process must hear of them)
            failure = errors.ConfigError(f"workdir {workdir}: cannot take the run's lease in "
                                         f"{LEASE_DIR} ({errors.os_reason(e)}).")
    message = _from_process_0("" if failure is None else str(failure) or type(failure).__name__)
    if failure is not None:
        raise failure
    if message:
        raise errors.ConfigError(message)
    return lease if lease is not None else _NotHeld()
