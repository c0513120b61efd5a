"""A worker's exception in the user's own terms: the traceback names the user's file, line and
source line (also for code in a script's ``__main__``, a notebook cell, ``python -c``), the
message has one traceback header, and the error is also an instance of the original type
(``except ValueError`` catches an env's ValueError), pickling as itself."""

from __future__ import annotations

import linecache
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import anyio
import cloudpickle
import gymnasium as gym
import numpy as np
import pytest

from aiocollect import BrokenWorkerError, Collector, WorkerError, WorkerTimeoutError
from aiocollect._backends.child import worker_error
from aiocollect._core.errors import worker_error_class
from aiocollect._core.pickling import dumps
from procs import child_env

REPO = Path(__file__).resolve().parent.parent

# The user's script. Everything above "# END OF CELL" is also run as a notebook cell (compiled
# under a cell's file name) or as `python -c` code (file "<string>"), keeping its line numbers.
SCRIPT = textwrap.dedent('''\
    import asyncio
    import linecache
    import sys

    import gymnasium as gym
    import numpy as np
    import tensordict  # (the policies write tensordicts)

    from aiocollect import Collector, WorkerError


    class BadEnv(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return np.zeros(2, np.float32), {}

        def step(self, action):
            self.t += 1
            if self.t == 3:
                raise ValueError("the env fails on step 3")  # RAISES:env
            return np.zeros(2, np.float32), 0.0, False, False, {}


    def make_env():
        raise ValueError("the env factory fails")  # RAISES:factory


    calls = 0


    def bad_policy(td):
        global calls
        calls += 1
        if calls == 3:
            raise ValueError("the policy fails on call 3")  # RAISES:policy
        td["action"] = np.zeros(td.batch_size, np.int64)
        return td
    # END OF CELL


    def as_cell(filename, with_source):
        """Define the above again as a notebook cell (or `python -c` code) would."""
        src = open(__file__).read().split("# END OF CELL")[0]
        if with_source:  # (IPython keeps a cell's source in linecache)
            linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec"), globals())


    async def main(mode):
        if mode == "notebook":
            as_cell("/tmp/ipykernel_12345/2718281828.py", True)
        elif mode == "python-c":
            as_cell("<string>", False)
        env, policy, workers, inference = BadEnv, None, 1, "worker"
        if mode == "local":
            workers = 0
        elif mode == "factory":
            env = make_env
        elif mode in ("policy-worker", "policy-server"):
            env, policy, inference = BadEnv, bad_policy, mode.partition("-")[2]
            BadEnv.step = lambda self, action: (np.zeros(2, np.float32), 0.0, False, False, {})
        try:
            async with Collector(env, policy, frames_per_batch=8, total_frames=64, num_workers=workers,
                                 inference=inference) as c:
                async for batch in c:
                    pass
        except ValueError as e:
            if inference == "server":  # the policy ran in this process: its own exception
                import traceback
                text, message = "".join(traceback.format_exception(e)), ""
            else:
                assert isinstance(e, WorkerError), type(e).__mro__
                assert isinstance(e.__cause__, ValueError), repr(e.__cause__)
                text, message = e.worker_traceback, str(e)
            print("<<<TRACEBACK")
            print(text)
            print("TRACEBACK>>>")
            print("<<<MESSAGE")
            print(message)
            print("MESSAGE>>>")
            print(f"ok: caught {type(e).__name__} as ValueError")
            return 0
        print("no error raised")
        return 1


    sys.exit(asyncio.run(main(sys.argv[1])))
''')

CASES = {  # mode: (file name as the traceback shows it, which line raises, source line shown)
    "process": (None, "env", True),
    "local": (None, "env", True),
    "factory": (None, "factory", True),
    "policy-worker": (None, "policy", True),
    "policy-server": (None, "policy", True),
    "notebook": ("/tmp/ipykernel_12345/2718281828.py", "env", True),
    "python-c": ("<string>", "env", False),
}


def between(out: str, tag: str) -> str:
    return out.split(f"<<<{tag}\n", 1)[1].split(f"\n{tag}>>>", 1)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(CASES))
def test_a_scripts_worker_error_names_its_file_line_and_source(tmp_path, mode):
    """The user's script (a real file run as a subprocess) defines an env, an env factory or a
    policy that raises ValueError; it catches it with `except ValueError`, and the traceback it
    prints names the script's file (or the cell's), the raising line and its source text, with
    one traceback header; the WorkerError's message has one header too."""
    script = tmp_path / "user_train.py"
    script.write_text(SCRIPT)
    filename, what, with_source = CASES[mode]
    filename = filename or str(script)
    lines = SCRIPT.splitlines()
    lineno = next(i for i, line in enumerate(lines, 1) if line.endswith(f"# RAISES:{what}"))
    source = lines[lineno - 1].strip()
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=100,
                          cwd=tmp_path, env=child_env(REPO))
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"
    caught = "ValueError" if mode == "policy-server" else "WorkerValueError"
    assert out.rstrip().splitlines()[-1] == f"ok: caught {caught} as ValueError", out
    tb = between(out, "TRACEBACK")
    assert f'File "{filename}", line {lineno}, in ' in tb, tb
    assert "<dynamic-code>" not in tb, tb
    assert (source in tb) == with_source, tb
    assert tb.count("Traceback (most recent call last)") == 1, tb
    message = between(out, "MESSAGE")
    if mode != "policy-server":
        assert "raised ValueError: " in message, message
        assert message.count("traceback (most recent call last):") == 1, message
        assert "Traceback (most recent call last)" not in message, message
        assert "\n\nWorker traceback (most recent call last):\n  File " in message, message
        assert f'File "{filename}", line {lineno}, in ' in message, message


# ---- in process: caught by the original type, and pickled -------------------------------------

class KeyEnv(gym.Env):
    """Raises KeyError on its second step."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t == 2:
            raise KeyError("no such key")
        return np.zeros(2, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_a_workers_key_error_is_caught_by_except_key_error_and_pickles(num_workers):
    """`except KeyError` catches an env's KeyError from a worker, `except WorkerError` too; the
    cause is the KeyError; the message is not quoted as a KeyError's would be; pickle and
    cloudpickle keep the type, message, worker and worker traceback."""
    caught = []
    for catch in (KeyError, WorkerError):
        try:
            with anyio.fail_after(60):
                async with Collector(KeyEnv, frames_per_batch=8, total_frames=32, num_workers=num_workers) as c:
                    async for _ in c:
                        pass
        except catch as e:
            caught.append(e)
    assert len(caught) == 2
    for err in caught:
        assert isinstance(err, KeyError) and isinstance(err, WorkerError), type(err).__mro__
        assert type(err).__name__ == "WorkerKeyError"
        assert isinstance(err.__cause__, KeyError) and not isinstance(err.__cause__, WorkerError)
        assert err.worker == (0 if num_workers else None)
        assert str(err).startswith("the local worker raised KeyError" if num_workers == 0 else "worker 0 (pid "), str(err)
        assert "test_worker_errors_user_terms.py" in err.worker_traceback, err.worker_traceback
        for module in (pickle, cloudpickle):
            back = module.loads(module.dumps(err))
            assert type(back) is type(err)
            assert str(back) == str(err) and back.args == err.args
            assert back.worker_traceback == err.worker_traceback and back.worker == err.worker


# ---- the class made per original type ----------------------------------------------------------

def test_worker_error_class_mixes_in_what_it_can_and_falls_back_to_worker_error():
    """Built-in and user exception types get a WorkerError subclass, made once; types whose
    constructor does not fit, and control-flow exceptions, give plain WorkerError;
    BrokenWorkerError and WorkerTimeoutError stay as they were."""

    class Plain(Exception):
        pass

    class TwoArgs(ValueError):
        def __init__(self, a, b):
            super().__init__(a, b)

    class Meta(type):
        def __call__(cls, *args, **kwargs):
            raise TypeError("no instances here")

    class Odd(Exception, metaclass=Meta):
        pass

    for cause in (ValueError, KeyError, OSError, FileNotFoundError, TimeoutError, RuntimeError, Plain):
        cls = worker_error_class(cause)
        assert cls is not WorkerError and issubclass(cls, WorkerError) and issubclass(cls, cause), cause
        assert worker_error_class(cause) is cls
        err = cls("message", worker=2, worker_traceback="tb")
        assert (str(err), err.worker, err.worker_traceback) == ("message", 2, "tb")
    for cause in (TwoArgs, Odd, StopIteration, StopAsyncIteration, UnicodeDecodeError, anyio.EndOfStream, KeyboardInterrupt):
        assert worker_error_class(cause) is WorkerError, cause
    assert BrokenWorkerError.__bases__ == (WorkerError,) and WorkerTimeoutError.__bases__ == (WorkerError,)


def test_worker_error_for_a_local_exception_class_pickles_as_plain_worker_error():
    """A cause whose class cannot be pickled by reference (defined in a function): the error is
    still caught by that class, and pickles as a plain WorkerError with its message."""

    class Local(ValueError):
        pass

    try:
        raise Local("x")
    except Local as exc:
        err = worker_error(0, 123, exc, "Traceback (most recent call last):\n  File \"f.py\", line 1, in g\nLocal: x\n")
    assert isinstance(err, Local) and isinstance(err, WorkerError)
    assert str(err).count("raceback (most recent call last)") == 1
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is WorkerError and str(back) == str(err) and back.worker_traceback == err.worker_traceback


def test_worker_error_without_a_loadable_cause_is_plain():
    err = worker_error(1, 5, None, "Traceback (most recent call last):\nBoom\n")
    assert type(err) is WorkerError and "raised an error" in str(err)


# ---- what the workers get: file names and source kept ------------------------------------------

def test_dumps_keeps_a_cells_file_name_and_sends_its_source():
    """Code compiled under a cell's name (source only in linecache): after dumps/loads in a
    process without that linecache entry, the code keeps its file name and the source is
    there again; code with no known source keeps its file name."""
    name = "/nonexistent/ipykernel_1/cell-7.py"
    src = "def f():\n    return 1 / 0\n"
    namespace: dict = {"__name__": "__main__"}
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    try:
        exec(compile(src, name, "exec"), namespace)
        payload = dumps(namespace["f"])
    finally:
        del linecache.cache[name]
    try:
        f = cloudpickle.loads(payload)
        assert isinstance(f, types.FunctionType) and f.__code__.co_filename == name
        assert linecache.getline(name, 2).strip() == "return 1 / 0"
    finally:
        linecache.cache.pop(name, None)
    namespace = {"__name__": "__main__"}
    exec(compile(src, "<string>", "exec"), namespace)
    assert cloudpickle.loads(dumps(namespace["f"])).__code__.co_filename == "<string>"
