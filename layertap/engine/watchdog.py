"""Bounded waits on the engine: start-up and every engine step get a limit, and a limit that passes
becomes a named error that says where the engine's processes stand, instead of a silent hang.

What a report holds, for every process this one started since the watch began (the engine core, its
workers, compile workers): pid, command, state (``R`` running, ``S`` sleeping, ``D`` in the kernel,
``T`` stopped...), the kernel function it waits in (``wchan``), CPU seconds, threads; the Python stacks
of every thread of the processes that registered for them (``register_stack_dumps``, done by layertap's
worker class at import: ``SIGUSR2`` then makes ``faulthandler`` write them to a file in the diagnostics
folder) and the last lines vLLM logged there. After the report is taken the engine's processes are
killed, so the blocked call in this process returns (vLLM sees its engine die) and nothing is left
running.

No vLLM import here: the Tap wires the limits to its engine (``compat.fail_blocked_step``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("layertap")

DIAG_ENV = "LAYERTAP_DIAG_DIR"
"""Where engine processes write their stack dumps and log lines (set by the Tap while its engine starts)."""
STACK_SIGNAL = signal.SIGUSR2
LOG_TAIL = 25


class EngineTimeout(RuntimeError):
    """The engine did not finish start-up, or one step, within its limit; the message is the report."""


class EngineStartTimeout(EngineTimeout):
    """``LLM(...)`` did not return within ``start_timeout`` seconds."""


class EngineStepTimeout(EngineTimeout):
    """One engine step did not return within ``step_timeout`` seconds."""


# ----------------------------------------------------------------------------------------------
# Inside the engine's processes
# ----------------------------------------------------------------------------------------------

_REGISTERED: list = []


def register_stack_dumps() -> Path | None:
    """In an engine process: on ``SIGUSR2`` write every thread's Python stack to
    ``$LAYERTAP_DIAG_DIR/stacks-<pid>.txt``, and copy vLLM's log lines to ``engine-<pid>.log`` there.
    Does nothing outside a watched engine (no ``LAYERTAP_DIAG_DIR``). Idempotent."""
    d = os.environ.get(DIAG_ENV)
    if not d or _REGISTERED:
        return None
    folder = Path(d)
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / f"stacks-{os.getpid()}.txt", "w")  # kept open: faulthandler writes to its fd
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    handler = logging.FileHandler(folder / f"engine-{os.getpid()}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("vllm", "layertap"):
        logging.getLogger(name).addHandler(handler)
    _REGISTERED.extend([f, handler])
    return folder


# ----------------------------------------------------------------------------------------------
# In the process that owns the engine
# ----------------------------------------------------------------------------------------------

def _stat(pid: int) -> dict | None:
    st = _stat_path(Path(f"/proc/{pid}/stat"))
    if st is not None:
        st["pid"] = pid
    return st


def _stat_path(path: Path) -> dict | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    head, tail = raw.rsplit(b")", 1)
    f = tail.split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"comm": head.split(b"(", 1)[1].decode(errors="replace"), "state": f[0].decode(),
            "ppid": int(f[1]), "cpu_s": (int(f[11]) + int(f[12])) / tick, "threads": int(f[17]),
            "start": int(f[19])}


def descendants(root: int | None = None) -> list[dict]:
    """Every living process below ``root`` (default: this one), parents first."""
    root = os.getpid() if root is None else root
    procs = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                procs.append(st)
    children: dict[int, list[dict]] = {}
    for p in procs:
        children.setdefault(p["ppid"], []).append(p)
    out, todo = [], [root]
    while todo:
        for c in sorted(children.get(todo.pop(0), []), key=lambda p: p["pid"]):
            out.append(c)
            todo.append(c["pid"])
    return out


def _read(path: Path, limit: int = 20000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return ""


def report(procs: list[dict], diag: Path | None, wait_dumps: float = 2.0) -> str:
    """Where ``procs`` stand: state, kernel wait, CPU time, Python stacks (when they answer ``SIGUSR2``)
    and the tail of their engine log."""
    if diag is not None:
        asked = 0
        for p in procs:
            if (diag / f"stacks-{p['pid']}.txt").exists():
                try:
                    os.kill(p["pid"], STACK_SIGNAL)
                    asked += 1
                except ProcessLookupError:
                    pass
        if asked:
            time.sleep(wait_dumps)  # faulthandler writes from the signalled process
    lines = [f"{len(procs)} engine process(es) of pid {os.getpid()}:"]
    for p in procs:
        now = _stat(p["pid"]) or p
        wchan = _read(Path(f"/proc/{p['pid']}/wchan"), 80) or "?"
        lines.append(f"  pid {p['pid']} {now['comm']!r} state {now['state']} wchan {wchan} cpu {now['cpu_s']:.1f}s "
                     f"threads {now['threads']}: {_cmdline(p['pid'])}")
        lines.append("    threads (name state wchan cpu): " + _threads(p["pid"]))
    if diag is not None:
        for p in procs:
            stacks = _read(diag / f"stacks-{p['pid']}.txt").strip()
            if stacks:
                lines.append(f"--- Python stacks of pid {p['pid']} (most recent call first) ---\n{stacks}")
            if not stacks and shutil.which("py-spy"):  # an engine process that did not register (plain vLLM)
                stacks = _py_spy(p["pid"])
                if stacks:
                    lines.append(f"--- py-spy dump --native of pid {p['pid']} ---\n{stacks}")
            tail = _read(diag / f"engine-{p['pid']}.log").strip().splitlines()[-LOG_TAIL:]
            if tail:
                lines.append(f"--- last {len(tail)} log lines of pid {p['pid']} ---\n" + "\n".join(tail))
    return "\n".join(lines)


def _py_spy(pid: int, timeout: float = 30.0) -> str:
    try:
        r = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(py-spy failed: {e})"
    return (r.stdout or r.stderr).strip()[-20000:]


def _threads(pid: int, limit: int = 40) -> str:
    """Each thread's name, state, kernel wait and CPU seconds: where a process blocked in native code
    (a CUDA call, a lock, a socket) waits, which its Python stacks alone do not show."""
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return "?"
    for tid in tids[:limit]:
        st = _stat_path(Path(f"/proc/{pid}/task/{tid}/stat"))
        if st is not None:
            wchan = _read(Path(f"/proc/{pid}/task/{tid}/wchan"), 60) or "?"
            out.append(f"{st['comm']}:{st['state']}:{wchan}:{st['cpu_s']:.1f}")
    return ", ".join(out) + (f" (+{len(tids) - limit} more)" if len(tids) > limit else "")


SHM_PREFIX = "/dev/shm/psm_"
"""vLLM's engine processes talk through Python ``SharedMemory`` segments (its message queues: 160-250 MiB
each on the CPU build) that they take off Python's resource tracker; killed, they leave them behind."""


def mapped_segments(pids: list[int]) -> set[str]:
    """The ``SharedMemory`` segments (``/dev/shm/psm_*``) these processes map."""
    out: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                out.update(line.split()[-1] for line in f if SHM_PREFIX in line)
        except OSError:
            continue
    return {s.removesuffix(" (deleted)") for s in out}


def unlink_orphans(segments: set[str]) -> list[str]:
    """Unlink those of ``segments`` that no living process maps any more; returns the names removed."""
    if not segments:
        return []
    live = mapped_segments([int(d) for d in os.listdir("/proc") if d.isdigit()])
    gone = []
    for seg in sorted(segments - live):
        try:
            os.unlink(seg)
            gone.append(seg)
        except FileNotFoundError:
            pass
    return gone


def _running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st["state"] not in ("Z", "X")  # a zombie holds no memory any more


def kill(procs: list[dict]) -> None:
    """SIGKILL ``procs`` (children last seen alive; a pid reused since is left alone), then unlink the
    shared-memory segments they mapped and nobody maps now (``SHM_PREFIX``)."""
    segments = mapped_segments([p["pid"] for p in procs])
    killed = []
    for p in reversed(procs):
        now = _stat(p["pid"])
        if now is not None and now["start"] == p["start"]:
            try:
                os.kill(p["pid"], signal.SIGKILL)
                killed.append(p["pid"])
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0  # SIGKILL is not instant: wait (bounded) until they unmapped
    while killed and time.monotonic() < deadline and any(_running(pid) for pid in killed):
        time.sleep(0.02)
    gone = unlink_orphans(segments)
    if gone:
        log.info("layertap: removed %d shared-memory segment(s) the killed engine processes left: %s", len(gone),
                 ", ".join(gone))


def new_diag_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="layertap-diag-"))


def _is_tracker(p: dict) -> bool:
    return "resource_tracker" in _cmdline(p["pid"])  # unlinks our shm if we die: never ours to kill


def interrupt_thread(ident: int, exc_type: type[BaseException]) -> str:
    """Make thread ``ident`` of this process stop what it is doing; returns how, for the log.

    The main thread, where Python handles SIGINT, gets a KeyboardInterrupt through ``interrupt_main``: a
    signal also breaks a blocking system call. Elsewhere (another thread, or a process that ignores SIGINT,
    as one started in the background by a non-interactive shell or under ``nohup`` does, where
    ``interrupt_main`` does nothing) the thread gets ``exc_type`` raised asynchronously, at its next Python
    instruction. Either way the phase then raises the watchdog's named error."""
    import _thread

    if ident == threading.main_thread().ident and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _thread.interrupt_main()
        return "interrupted the main thread (KeyboardInterrupt)"
    import ctypes

    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))
    if n != 1:
        if n > 1:  # never leave more than the one thread with a pending exception
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return f"could not interrupt thread {ident} (no such thread)"
    return f"raised {exc_type.__name__} in thread {ident}"


class Watchdog:
    """One thread that bounds start-up and each engine step.

    ``with wd.starting(): LLM(...)`` and ``with wd.stepping(): engine.step()``: when a phase outlives its
    limit the thread takes the report, calls ``on_timeout(error)`` (the Tap makes the blocked ``step()``
    raise it) and kills the engine's processes; the phase then raises that error. The engine's processes
    are the children this process gained during start-up, and everything below them. Start-up also logs
    a line with their states every ``heartbeat`` seconds, so a slow start is visible as it happens.
    """

    def __init__(self, start_timeout: float, step_timeout: float, diag: Path | None = None,
                 heartbeat: float = 60.0, poll: float = 0.5, grace: float = 30.0):
        for name, v in (("start_timeout", start_timeout), ("step_timeout", step_timeout)):
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        self.start_timeout, self.step_timeout = float(start_timeout), float(step_timeout)
        self.heartbeat, self.poll, self.grace = heartbeat, poll, grace
        self.diag = diag
        self.on_timeout: Callable[[EngineTimeout], None] | None = None
        self.error: EngineTimeout | None = None
        self._phase: tuple[str, float, float] | None = None  # (name, began, limit)
        self._thread_id = 0  # the thread in the phase: the one to interrupt if killing its engine frees nothing
        self._before: set[int] = set()
        self._roots: list[dict] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="layertap-watchdog", daemon=True)
        self._thread.start()

    def engine_procs(self) -> list[dict]:
        """The engine's processes now: the children gained during start-up and all below them."""
        if self._phase is not None and self._phase[0] == "start-up":
            roots = [p for p in descendants() if p["ppid"] == os.getpid() and p["pid"] not in self._before]
        else:
            roots = self._roots
        out: list[dict] = []
        for r in roots:
            now = _stat(r["pid"])
            if now is None or now["start"] != r["start"] or _is_tracker(r):
                continue
            out += [now, *descendants(r["pid"])]
        return out

    class _Phase:
        """A bounded phase. Steps are the engine-driving thread's hot path: entering and leaving one is
        two attribute stores and a clock read (no lock, no wake-up); the watchdog thread looks every
        ``poll`` seconds."""

        def __init__(self, wd: "Watchdog", name: str, limit: float):
            self.wd, self.name, self.limit = wd, name, limit

        def __enter__(self) -> None:
            wd = self.wd
            if wd.error is not None:
                raise wd.error
            if self.name == "start-up":
                wd._before = {p["pid"] for p in descendants()}
            wd._thread_id = threading.get_ident()
            wd._phase = (self.name, time.monotonic(), self.limit)

        def __exit__(self, typ, exc, tb) -> bool:
            wd = self.wd
            if self.name == "start-up":
                if exc is not None:  # a failed or interrupted start: stop what it started
                    kill(wd.engine_procs())
                elif wd.error is None:
                    wd._roots = [p for p in descendants() if p["ppid"] == os.getpid()
                                 and p["pid"] not in wd._before and not _is_tracker(p)]
            wd._phase = None
            if wd.error is not None:
                raise wd.error from exc  # whatever the blocked call raised once its engine was killed
            return False

    def starting(self) -> "_Phase":
        return self._Phase(self, "start-up", self.start_timeout)

    def stepping(self) -> "_Phase":
        return self._Phase(self, "step", self.step_timeout)

    def _run(self) -> None:
        next_beat = None
        while True:
            with self._cv:
                if self._closed:
                    return
                phase = self._phase
                if phase is None:
                    self._cv.wait(self.poll)
                    next_beat = None
                    continue
            name, began, limit = phase
            now = time.monotonic()
            if now - began > limit:
                self._fire(name, limit, now - began)
                return
            if name == "start-up":
                next_beat = next_beat or began + self.heartbeat
                if now >= next_beat:
                    next_beat += self.heartbeat
                    log.warning("layertap: the vLLM engine is still starting after %.0f s (limit %.0f s): %s",
                                now - began, limit,
                                "; ".join(f"pid {p['pid']} {p['comm']} {p['state']}" for p in self.engine_procs()))
            with self._cv:
                self._cv.wait(self.poll)

    def _fire(self, name: str, limit: float, waited: float) -> None:
        procs = self.engine_procs()
        what = "did not finish starting" if name == "start-up" else "did not return from one engine step"
        knob = "start_timeout" if name == "start-up" else "step_timeout"
        cls = EngineStartTimeout if name == "start-up" else EngineStepTimeout
        err = cls(f"the vLLM engine {what} within {limit:.0f} s (waited {waited:.0f} s; if it is only slow, raise "
                  f"the limit: Tap({knob}=...)). Its processes were killed.\n" + report(procs, self.diag))
        log.error("%s", err)
        self.error = err
        if self.on_timeout is not None:
            try:
                self.on_timeout(err)
            except Exception:  # noqa: BLE001 - the kill below still unblocks the caller
                log.exception("layertap watchdog: could not hand the timeout to the engine client")
        kill(procs)
        # The blocked call returns once its engine is gone; if it still has not after ``grace`` s, the
        # wait is in this process itself: interrupt the phase's thread.
        deadline = time.monotonic() + self.grace
        while self._phase is not None and time.monotonic() < deadline:
            time.sleep(self.poll)
        if self._phase is not None:
            how = interrupt_thread(self._thread_id, type(err))
            log.error("layertap watchdog: the blocked call did not return %.0f s after its engine was killed; "
                      "%s", self.grace, how)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
