"""One run per workdir (longctx/train/lease.py): a second trainer is refused before it compiles or
writes anything, a stale lease is taken over with a note, racing starters cannot both win, and a
multi-process run refuses on every process at once.

The rules are tested with a fake clock; the races, the SIGKILL and the two trainers with real
processes on local disk. The gs:// storage class is run against fsspec's in-memory file system,
which implements the same `pipe_file(mode="create")` call (GCS itself cannot be reached here).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from longctx import errors
from longctx.train import lease
from tests import ROOT, child_env, child_output
from tests.validate_commands import ScriptServer

TRAIN = os.path.join(ROOT, "scripts", "train.py")
LOCAL = os.path.join(ROOT, "launch", "local.py")

SMALL_RUN = [  # the tiny preset, smaller: a few seconds per step on 8 CPU devices
    "--config=configs/base.py:tiny",
    "--config.model.d_model=64",
    "--config.model.mlp_dim=128",
    "--config.model.head_dim=16",
    "--config.data.seq_len=512",
    "--config.data.global_batch_size=2",
    "--config.attention.block_size=128",
    "--config.train.loss_chunk_size=128",
    "--config.train.eval_every=0",
    "--config.train.log_every=1",
    "--config.checkpoint.every_steps=0",
]


_env = child_env.script_env


def _records(workdir) -> dict[int, dict]:
    directory = os.path.join(workdir, lease.LEASE_DIR)
    out = {}
    for name in os.listdir(directory):
        m = re.fullmatch(r"(\d+)\.json", name)
        if m:
            with open(os.path.join(directory, name)) as f:
                out[int(m.group(1))] = json.load(f)
    return out


def _newest(workdir) -> dict:
    records = _records(workdir)
    return records[max(records)]


def _write_record(workdir, number: int, **fields) -> lease.Record:
    now = time.time()
    record = lease.Record(**{**dict(run_id="0123456789abcdef", host="elsewhere", pid=4242, machine="elsewhere",
                                    pid_start=None, started=now - 100, refreshed=now, refresh_s=10.0),
                             **fields})
    directory = os.path.join(workdir, lease.LEASE_DIR)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{number}.json"), "wb") as f:
        f.write(record.to_json())
    return record


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class FakeClock:
    def __init__(self, now: float):
        self.now = now
        self.on_sleep = []  # callables run at each sleep (the watched holder's actions)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for action in list(self.on_sleep):
            action(self.now)


# ----------------------------------------------------------------------------- the rules


def test_judge_on_this_machine_is_decided_by_the_pid():
    me, now = lease._machine(), 1000.0
    base = dict(run_id="feedfacefeedface", host="here", machine=me, started=now - 50, refresh_s=10.0)
    running = lease.Record(pid=os.getpid(), pid_start=lease._pid_start(os.getpid()), refreshed=now - 5, **base)
    assert lease.judge(running, now, me).kind == "held"
    # Alive but silent for more than 3 intervals (a hung run): stale.
    hung = lease.Record(pid=os.getpid(), pid_start=None, refreshed=now - 31, **base)
    verdict = lease.judge(hung, now, me)
    assert verdict.kind == "stale" and "has not refreshed it for 31 s" in verdict.why
    gone = _gone_pid()
    dead = lease.Record(pid=gone, pid_start=None, refreshed=now, **base)
    verdict = lease.judge(dead, now, me)
    assert verdict == lease.Verdict("stale", f"its process {gone} on here is gone")
    if lease._pid_start(os.getpid()) is not None:  # Linux: a reused pid is another process
        reused = lease.Record(pid=os.getpid(), pid_start="1", refreshed=now, **base)
        assert lease.judge(reused, now, me).kind == "stale"
    released = lease.Record(pid=os.getpid(), pid_start=None, refreshed=now, released=True, **base)
    assert lease.judge(released, now, me).kind == "free"


def test_judge_on_another_machine_watches_before_it_trusts_the_clock():
    now = 1000.0
    fresh = lease.Record(run_id="feedfacefeedface", host="h", pid=1, machine="other", pid_start=None,
                         started=0.0, refreshed=now - 2, refresh_s=10.0)
    assert lease.judge(fresh, now, "mine").kind == "watch"
    # By the clocks it is an hour old, but this machine's clock may be ahead: watched for less than
    # 1.5 intervals it is not taken; after that it is.
    old = dataclasses.replace(fresh, refreshed=now - 3600)
    assert lease.judge(old, now, "mine", watched_s=14.9).kind == "watch"
    assert lease.judge(old, now, "mine", watched_s=15.0).kind == "stale"
    # The holder's clock may be ahead instead (its stamp in our future): 3 intervals watched decide.
    future = dataclasses.replace(fresh, refreshed=now + 3600)
    assert lease.judge(future, now, "mine", watched_s=29.9).kind == "watch"
    assert lease.judge(future, now, "mine", watched_s=30.0).kind == "stale"
    assert lease.watch_deadline_s(fresh, now) == 28.0  # until 3 intervals after its last refresh
    assert lease.watch_deadline_s(old, now) == 15.0  # at least 1.5 intervals
    assert lease.watch_deadline_s(future, now) == 30.0  # at most 3


def test_a_holder_elsewhere_that_refreshes_while_watched_is_refused(tmp_path):
    workdir = str(tmp_path)
    clock = FakeClock(time.time())
    start = clock.now
    holder = _write_record(workdir, 7, refreshed=start - 1)

    def holder_refreshes(now):  # 9 s after its last refresh, as a live holder would
        if now >= start + 8 and not os.path.exists(os.path.join(workdir, lease.LEASE_DIR, "8.json")):
            _write_record(workdir, 8, **{**dataclasses.asdict(holder), "refreshed": now})

    clock.on_sleep.append(holder_refreshes)
    said = []
    with pytest.raises(errors.ConfigError) as error:
        lease.acquire(workdir, clock=clock, sleep=clock.sleep, say=said.append, start_refreshing=False)
    assert clock.now - start <= 8 + lease._POLL_S  # refused at the first refresh it saw, not later
    assert len(said) == 1 and "is leased by host elsewhere, pid 4242" in said[0]
    assert "whose pid cannot be checked from here" in said[0] and "watching it" in said[0]
    message = str(error.value)
    assert message.startswith(f"workdir {workdir} is in use by another run (host elsewhere, pid 4242, since ")
    assert message.endswith("wait for that run to finish, stop it, or pass another --workdir.")
    assert sorted(_records(workdir)) == [7, 8]  # nothing written by the refused run


def test_a_silent_holder_elsewhere_is_taken_over_after_three_intervals(tmp_path):
    workdir = str(tmp_path)
    clock = FakeClock(time.time())
    start = clock.now
    _write_record(workdir, 7, refreshed=clock.now - 1)
    said = []
    taken = lease.acquire(workdir, clock=clock, sleep=clock.sleep, say=said.append, start_refreshing=False)
    assert 29.0 <= clock.now - start <= 29.0 + 2 * lease._POLL_S  # 3 intervals after its last refresh
    assert said[-1].startswith(f"longctx: took over the lease of workdir {workdir} from host elsewhere, "
                               "pid 4242, since ")
    assert said[-1].endswith(": not refreshed for 30 s.")
    assert sorted(_records(workdir)) == [8] and _newest(workdir)["run_id"] == taken.record.run_id
    taken.release()


def test_refresh_release_and_a_lost_lease(tmp_path):
    workdir = str(tmp_path)
    clock = FakeClock(time.time())
    said = []
    held = lease.acquire(workdir, clock=clock, say=said.append, start_refreshing=False)
    assert said == [] and sorted(_records(workdir)) == [1] and held.still_held()
    clock.now += 10
    held.refresh()
    assert sorted(_records(workdir)) == [2] and _newest(workdir)["refreshed"] == clock.now
    # Another run takes it over (this one looked dead), creating number 3: this run notices at its
    # next refresh and from then on writes nothing, not even at its release, which says so once
    # (no one else reported it: the training loop stops with `lost_error` instead).
    other = _write_record(workdir, 3, host="thief", pid=77)
    held.refresh()
    assert held.lost and not held.still_held() and said == []
    assert held.lost_reason.startswith(f"the lease of workdir {workdir} was taken over by host thief, pid 77")
    held.refresh()
    held.release()
    assert len(said) == 1 and said[0].startswith(f"longctx: WARNING: the lease of workdir {workdir} was taken "
                                                 "over by host thief, pid 77"), said
    assert _newest(workdir)["run_id"] == other.run_id and sorted(_records(workdir)) == [2, 3]


def test_a_lease_checked_before_a_save_sees_a_taker_the_refresh_has_not_met_yet(tmp_path):
    """`still_held` reads the storage: a record above this run's is a takeover, found before the
    refresh thread's next turn; a lost lease reported by the loop is not said again at release."""
    workdir = str(tmp_path)
    said = []
    held = lease.acquire(workdir, say=said.append, start_refreshing=False)
    assert held.still_held()
    _write_record(workdir, 5, host="thief", pid=77)
    assert not held.still_held() and held.lost
    assert held.lost_error().startswith(f"the lease of workdir {workdir} was taken over by host thief, pid 77")
    held.release()
    assert said == [] and sorted(_records(workdir)) == [1, 5]


def test_a_released_lease_is_free_and_the_next_run_says_nothing(tmp_path):
    workdir = str(tmp_path)
    with lease.acquire(workdir, refresh_s=0.05) as first:
        time.sleep(0.3)  # a few refreshes by the daemon thread
        assert max(_records(workdir)) > first.number - 1 >= 1
    assert _newest(workdir)["released"] is True and len(_records(workdir)) == 1
    said = []
    with lease.acquire(workdir, say=said.append) as second:
        assert said == [] and _newest(workdir)["run_id"] == second.record.run_id


def test_a_run_inside_a_run_is_refused(tmp_path):
    with lease.acquire(str(tmp_path)):
        with pytest.raises(errors.ConfigError, match=rf"pid {os.getpid()}, since "):
            lease.acquire(str(tmp_path))


def _retried_link(monkeypatch):
    """os.link as NFS may answer it: the first LINK call made the name, its reply was lost, and
    the client's retry of the same call found the name there (EEXIST)."""
    real = os.link

    def link(source, target):
        real(source, target)
        raise FileExistsError(17, "File exists", target)

    monkeypatch.setattr(os, "link", link)


def test_a_link_that_answered_eexist_after_making_the_name_is_a_create(tmp_path, monkeypatch):
    """The private file's link count tells a retried success (2: the name is this file) from
    another run's record (1), as open(2) advises for O_EXCL on NFS; taking EEXIST alone for
    "someone else made it" made a starter refuse its own record as another run's."""
    workdir = str(tmp_path)
    _retried_link(monkeypatch)
    said = []
    held = lease.acquire(workdir, say=said.append, start_refreshing=False)
    assert held.number == 1 and said == [] and sorted(_records(workdir)) == [1]
    held.refresh()  # (a refresh creates through the same call)
    assert not held.lost and held.number == 2 and sorted(_records(workdir)) == [2]
    held.release()
    assert _newest(workdir)["released"] is True
    assert not [name for name in os.listdir(os.path.join(workdir, lease.LEASE_DIR)) if name.startswith(".tmp-")]


def test_a_name_another_run_made_is_not_a_create(tmp_path):
    files = lease._LocalFiles(str(tmp_path / lease.LEASE_DIR))
    assert files.create("1.json", b"first")
    assert not files.create("1.json", b"second")
    assert files.read("1.json") == b"first" and files.names() == ["1.json"]


def test_the_bucket_storage_through_fsspec(tmp_path):
    """_FsspecFiles (what gs:// uses) on fsspec's memory file system: create-if-absent, listing,
    and a whole take / refuse / release / take cycle through it."""
    import fsspec

    fs = fsspec.filesystem("memory")
    directory = f"/lease-test-{os.getpid()}/run/{lease.LEASE_DIR}"
    files = lease._FsspecFiles(directory, fs)
    try:
        assert files.names() == []
        assert files.create("1.json", b"a") is True
        assert files.create("1.json", b"b") is False and files.read("1.json") == b"a"
        files.delete("1.json")
        held = lease.acquire("gs://bucket/run", files=files, start_refreshing=False)
        with pytest.raises(errors.ConfigError, match=r"^workdir gs://bucket/run is in use by another run"):
            lease.acquire("gs://bucket/run", files=files)
        held.refresh()
        assert files.names() == ["2.json"]
        held.release()
        again = lease.acquire("gs://bucket/run", files=files, start_refreshing=False)
        assert again.number == 4 and files.names() == ["4.json"]
    finally:
        fs.rm(f"/lease-test-{os.getpid()}", recursive=True)


# ----------------------------------------------------------------------------- real processes


HOLDER = """
import sys, time
from longctx.train import lease
lease.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""

RACER = """
import os, sys, time
from longctx import errors
from longctx.train import lease
go, hold_s = sys.argv[2], float(sys.argv[3])
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
try:
    taken = lease.acquire(sys.argv[1], say=lambda line: print(line, flush=True), start_refreshing=False)
    print("WON", os.getpid(), flush=True)
    time.sleep(hold_s)  # hold it (alive) until every racer has decided
except errors.ConfigError as e:
    print("REFUSED", e, flush=True)
"""


def _start_holder(workdir) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, workdir], env=_env(), stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_killed_holder_is_taken_over_at_once(tmp_path):
    workdir = str(tmp_path)
    holder = _start_holder(workdir)
    holder.kill()  # SIGKILL: no release
    holder.wait()
    assert _newest(workdir)["released"] is False and _newest(workdir)["pid"] == holder.pid
    said = []
    with lease.acquire(workdir, say=said.append):
        pass
    assert len(said) == 1 and said[0].endswith(f"its process {holder.pid} on {_newest(workdir)['host']} is gone.")


STEPPED = """
import json, sys
from longctx.train import lease
workdir, clock_file = sys.argv[1], sys.argv[2]

def clock():  # the test's fake clock, shared by both processes
    with open(clock_file) as f:
        return float(f.read())

said, held = [], None
for command in sys.stdin:
    command = command.strip()
    if command == "acquire":
        held = lease.acquire(workdir, clock=clock, sleep=lambda s: None, say=said.append, start_refreshing=False)
    elif command == "refresh":
        held.refresh()
    elif command == "release":
        held.release()
    state = {"number": held.number, "lost": held.lost, "still_held": not held.lost and held.still_held(),
             "reason": held.lost_reason, "said": said}
    print(json.dumps(state), flush=True)
    said.clear()
"""


class _Stepped:
    """A real process holding (or taking) a lease, one step per command, on the test's fake clock:
    a holder paused past the stale time is one that is not told to refresh while the clock moves."""

    def __init__(self, workdir: str, clock_file: str):
        self.proc = subprocess.Popen([sys.executable, "-c", STEPPED, workdir, clock_file], env=_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the process exited at {command!r}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


@pytest.mark.parametrize("taker_refreshed", [False, True])
def test_a_paused_holder_loses_a_taken_over_lease_whichever_refreshes_first(tmp_path, taker_refreshed):
    """Holder A (a real process) is paused past the stale time; B (another) takes over. When A wakes
    it finds the lease lost, whether B has refreshed since (which removes every record below B's,
    so that A's create of its next number succeeds, which A must not take for proof: both would
    refresh forever) or not (A's next number exists). From then on A writes nothing and B holds."""
    workdir, clock_file = str(tmp_path / "run"), tmp_path / "clock"
    clock_file.write_text(str(time.time()))

    def advance(seconds: float) -> None:
        clock_file.write_text(str(float(clock_file.read_text()) + seconds))

    a, b = _Stepped(workdir, str(clock_file)), _Stepped(workdir, str(clock_file))
    try:
        assert a("acquire")["number"] == 1
        advance(lease.STALE_INTERVALS * lease.REFRESH_S + 1)  # A, paused, has not refreshed
        taken = b("acquire")
        assert taken["number"] == 2 and len(taken["said"]) == 1
        assert f"from host {socket.gethostname()}, pid {a.proc.pid}" in taken["said"][0], taken
        assert taken["said"][0].endswith("its process has not refreshed it for 31 s."), taken
        if taker_refreshed:
            advance(lease.REFRESH_S)
            assert b("refresh")["number"] == 3 and sorted(_records(workdir)) == [3]
        woken = a("refresh")  # A wakes: its refresh is due
        assert woken["lost"] and not woken["still_held"], woken
        assert woken["reason"].startswith(f"the lease of workdir {workdir} was taken over by host "
                                          f"{socket.gethostname()}, pid {b.proc.pid}, since "), woken
        assert woken["said"] == []  # (the loop stops the run with the reason: one line)
        taker_number = 3 if taker_refreshed else 2
        assert sorted(_records(workdir)) == [taker_number]  # nothing of A's left behind
        for _ in range(3):  # B goes on holding it; A writes nothing, refresh or release
            advance(lease.REFRESH_S)
            held = b("refresh")
            assert not held["lost"] and held["still_held"] and held["number"] == taker_number + 1, held
            taker_number += 1
            assert a("refresh")["lost"]
            assert sorted(_records(workdir)) == [taker_number] and _newest(workdir)["pid"] == b.proc.pid
        released = a("release")
        assert len(released["said"]) == 1 and released["said"][0].startswith("longctx: WARNING: the lease")
        assert sorted(_records(workdir)) == [taker_number] and not _newest(workdir)["released"]
        b("release")
        assert _newest(workdir)["released"] and _newest(workdir)["pid"] == b.proc.pid
        a.close()
        b.close()
    finally:
        for stepped in (a, b):
            if stepped.proc.poll() is None:
                stepped.proc.kill()
                stepped.proc.wait()


@pytest.mark.parametrize("previous", ["none", "stale", "released"])
def test_racing_starters_one_wins(tmp_path, previous):
    """Six processes start at the same instant on a workdir with no lease, a stale one (its holder
    gone) or a released one: exactly one takes it, the others are refused naming the winner."""
    workdir, go = str(tmp_path / "run"), str(tmp_path / "go")
    if previous == "stale":
        _write_record(workdir, 5, machine=lease._machine(), pid=_gone_pid())
    elif previous == "released":
        _write_record(workdir, 5, machine=lease._machine(), pid=os.getpid(), released=True)
    racers = [subprocess.Popen([sys.executable, "-c", RACER, workdir, go, "3"], env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(6)]
    for racer in racers:  # every racer has imported and waits for `go`
        assert racer.stdout.readline() == "ready\n"
    with open(go, "w"):
        pass
    outs = [r.communicate(timeout=120)[0] for r in racers]
    winners = [out for out in outs if "\nWON " in "\n" + out]
    assert len(winners) == 1, outs
    winner_pid = int(re.search(r"^WON (\d+)$", winners[0], re.M).group(1))
    refused = [out for out in outs if out.startswith("REFUSED ")]
    assert len(refused) == 5, outs
    for out in refused:
        assert f"is in use by another run (host {_newest(workdir)['host']}, pid {winner_pid}, since " in out, out
    notes = [out for out in outs if "took over the lease" in out]
    assert len(notes) == (1 if previous == "stale" else 0), outs
    assert _newest(workdir)["pid"] == winner_pid


@pytest.mark.slow
def test_a_second_trainer_on_a_workdir_is_refused(tmp_path):
    """Trainer A runs; trainer B on the same workdir exits 2 with one sentence naming A, before it
    compiles or writes anything (its different seed would show in run_info.json); A, stopped by
    SIGTERM, exits 0 and releases the lease."""
    workdir, log = str(tmp_path / "run"), tmp_path / "a.log"

    def a_says(text: str) -> bool:
        return text in log.read_text()

    with open(log, "w") as a_output:
        a = subprocess.Popen([sys.executable, TRAIN, f"--workdir={workdir}", *SMALL_RUN,
                              "--config.train.num_steps=1000"], cwd=ROOT, env=_env(), stdout=a_output,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not a_says("process(es)") and a.poll() is None:  # A has started (and is compiling)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        b = ScriptServer.run([sys.executable, TRAIN, f"--workdir={workdir}", *SMALL_RUN, "--config.seed=7",
                              "--config.train.num_steps=3"], cwd=ROOT, env=_env(), timeout=300)
        assert b.returncode == 2, b.stdout + b.stderr
        lines = b.stderr.strip().splitlines()
        assert len(lines) == 1, b.stderr
        assert re.fullmatch(rf"longctx: workdir {re.escape(workdir)} is in use by another run \(host \S+, pid "
                            rf"{a.pid}, since [-0-9: ]+ UTC, lease refreshed \d+ s ago in \S+\): wait for that run "
                            r"to finish, stop it, or pass another --workdir\.", lines[0]), lines[0]
        assert "process(es)" not in b.stdout and "fresh start" not in b.stdout, b.stdout  # refused first
        # A is training (its first step logged), then stopped as a preemption would.
        while not a_says("step 1: loss=") and a.poll() is None:  # inside the loop, which handles SIGTERM
            assert time.monotonic() < deadline
            time.sleep(0.1)
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    out = log.read_text()
    assert a.returncode == 0, out[-3000:]
    assert re.search(r"longctx: stopped at step \d+ \(saved to ", out), out[-3000:]
    with open(os.path.join(workdir, "run_info.json")) as f:
        assert json.load(f)["config"]["seed"] == 0  # A's, untouched by B
    assert _newest(workdir)["released"] is True and _newest(workdir)["pid"] == a.pid


@pytest.mark.slow
def test_every_process_of_a_multiprocess_run_refuses_together(tmp_path):
    """A 2-process run (launch/local.py) on a held workdir: process 0 finds the holder and both
    processes print the same sentence and exit 2; neither waits for the other."""
    workdir = str(tmp_path / "run")
    holder = _start_holder(workdir)
    try:
        r = ScriptServer.run([sys.executable, LOCAL, "--num-processes", "2", "--devices-per-process", "4", "--",
                              sys.executable, TRAIN, f"--workdir={workdir}", *SMALL_RUN, "--config.train.num_steps=2"],
                             cwd=ROOT, env=_env(), timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    sentence = (rf"longctx: workdir {re.escape(workdir)} is in use by another run \(host \S+, pid {holder.pid}, "
                r"since .*or pass another --workdir\.")
    for process in (0, 1):
        assert child_output.find(r.stderr, process, sentence), r.stderr[-3000:]
    assert not child_output.find(r.stdout, 0, "fresh start"), r.stdout[-3000:]


def test_an_empty_workdir_flag_is_refused_not_taken_as_the_current_directory(tmp_path):
    config = f"--config={os.path.join(ROOT, 'configs', 'base.py')}:tiny"
    r = ScriptServer.run([sys.executable, TRAIN, "--workdir=", config, *SMALL_RUN[1:], "--config.train.num_steps=1"],
                         cwd=tmp_path, env=_env(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == "longctx: --workdir is empty: name a directory, e.g. --workdir=runs/demo."
    assert os.listdir(tmp_path) == []


def test_validate_only_refuses_a_workdir_a_live_run_holds(tmp_path):
    """--validate_only said "fine" where the run would be refused: it reads the lease (and writes
    none) and refuses with the run's sentence; a lease whose holder is gone passes."""
    workdir = str(tmp_path / "run")
    holder = _start_holder(workdir)
    try:
        r = ScriptServer.run([sys.executable, TRAIN, f"--workdir={workdir}", *SMALL_RUN, "--validate_only"],
                             cwd=ROOT, env=_env(), timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.fullmatch(rf"longctx: workdir {re.escape(workdir)} is in use by another run \(host \S+, pid "
                        rf"{holder.pid}, since .* or pass another --workdir\.\n", r.stderr), r.stderr
    records = _records(workdir)
    lease.check_free(workdir)  # the holder is gone: a run would take it over
    assert _records(workdir) == records  # nothing written
