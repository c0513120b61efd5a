"""``python -m aiocollect``: ``info`` (versions, platform, CUDA) and ``bench`` (the side-by-side
throughput comparison for any gymnasium id, on this machine).

Kept light at import time: a spawned process of the benchmark imports ``aiocollect.__main__``
(multiprocessing's "spawn" re-imports the main module), hence this module too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from typing import TYPE_CHECKING, Any, TextIO

from .. import __version__

if TYPE_CHECKING:  # (bench is imported when the command runs: see above)
    from .bench import Row, Stage

PROG = "python -m aiocollect"
# distributions shown by `info`, in order ("trio": only where installed)
CORE = ("torch", "tensordict", "gymnasium", "numpy", "anyio", "cloudpickle", "uvloop")
# what aiocollect works with when installed, in no extra: trio's event loop, TorchRL's losses and
# buffers on its batches, EnvPool's envs
ALSO = ("trio", "torchrl", "envpool")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # aiocollect/


class _CliError(Exception):
    """A problem with the command line's input: printed as ``error: ...`` with exit status 2."""


# -- info -----------------------------------------------------------------------------------------


def _extras() -> dict[str, list[str]] | None:
    """aiocollect's extras and the distributions each needs, from the installed metadata, or
    from ``pyproject.toml`` where aiocollect runs from a source tree that was not installed (None
    when neither is there)."""
    from importlib import metadata

    try:
        requires = metadata.requires("aiocollect") or []
    except metadata.PackageNotFoundError:
        from_tree = _source_tree_extras()
        if from_tree is None:
            return None
        requires = from_tree
    extras: dict[str, list[str]] = {}
    for requirement in requires:
        found = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if found is None or name is None or name.group() == "aiocollect":  # ("dev": all the others)
            continue
        extras.setdefault(found.group(1), []).append(name.group())
    return extras


def _source_tree_extras() -> list[str] | None:
    """The optional requirements of the ``pyproject.toml`` beside the package, written as the
    installed metadata writes them (``name>=x; extra == "progress"``), or None."""
    import tomllib

    path = os.path.join(os.path.dirname(_PACKAGE_DIR), "pyproject.toml")
    try:
        with open(path, "rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if project.get("name") != "aiocollect":
        return None
    optional = project.get("optional-dependencies", {})
    return [f'{req}; extra == "{extra}"' for extra, reqs in optional.items() for req in reqs]


def _check(probe: Any) -> bool:
    try:
        probe()
    except (OSError, AttributeError):
        return False
    return True


def _memfd() -> None:
    os.close(os.memfd_create("aiocollect-info", os.MFD_CLOEXEC))


def _pidfd() -> None:
    os.close(os.pidfd_open(os.getpid()))


def _memory() -> dict[str, float] | None:
    """Total and available memory in GiB (Linux /proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {key: int(fields[name].split()[0]) / 2**20 for key, name in
                (("total_gib", "MemTotal"), ("available_gib", "MemAvailable"))}  # fmt: skip
    except (OSError, KeyError, ValueError):
        return None


def _cuda(names: bool) -> dict[str, Any]:
    """Whether torch sees CUDA (``torch.cuda.is_available()``: it creates no CUDA context);
    the devices' names only with ``names`` (that initialises CUDA)."""
    import torch

    out: dict[str, Any] = {"torch_cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if out["available"]:
        out["devices"] = torch.cuda.device_count()
        if names:
            out["names"] = [torch.cuda.get_device_name(i) for i in range(out["devices"])]
    return out


def gather_info(cuda_names: bool = False) -> dict[str, Any]:
    """Everything ``info`` prints, as plain data."""
    from .bench import dist_version

    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    extras = _extras()
    return {
        "aiocollect": {"version": __version__, "path": _PACKAGE_DIR},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "packages": {name: dist_version(name) for name in CORE},
        "extras": None if extras is None else {
            extra: {name: dist_version(name) for name in names} for extra, names in sorted(extras.items())
        },
        "also": {name: dist_version(name) for name in ALSO},
        "platform": {
            "system": platform.system(), "kernel": platform.release(), "machine": platform.machine(),
            "cores": os.cpu_count(), "usable_cores": usable, "memory": _memory(),
            "memfd": _check(_memfd), "pidfd": _check(_pidfd),
            "supported": sys.platform.startswith("linux"),
        },
        "cuda": _cuda(cuda_names),
    }  # fmt: skip


def _version(v: str | None) -> str:
    return v if v is not None else "not installed"


def format_info(info: dict[str, Any]) -> str:
    """``info``'s text."""
    width = 12
    lines = [
        f"{'aiocollect':<{width}} {info['aiocollect']['version']} ({info['aiocollect']['path']})",
        f"{'python':<{width}} {info['python']['version']} ({info['python']['implementation']}, "
        f"{info['python']['executable']})",
    ]
    lines += [f"{name:<{width}} {_version(v)}" for name, v in info["packages"].items()]
    lines += [f"{name:<{width}} {_version(v)} (optional)" for name, v in info["also"].items()]
    lines.append("extras:")
    if info["extras"] is None:
        lines.append("  unknown: aiocollect runs from a source tree that is not installed (pip install -e .)")
    else:
        for extra, dists in info["extras"].items():
            present = all(v is not None for v in dists.values())
            state = "yes" if present else ("partly" if any(v is not None for v in dists.values()) else "no")
            detail = ", ".join(f"{name} {_version(v)}" for name, v in dists.items())
            lines.append(f"  {extra:<{width - 2}} {state:<6} ({detail})")
    p = info["platform"]
    usable = "" if p["usable_cores"] in (None, p["cores"]) else f", {p['usable_cores']} usable by this process"
    memory = p["memory"]
    lines += [
        "platform:",
        f"  {'system':<{width - 2}} {p['system']} {p['kernel']} ({p['machine']})",
        f"  {'cores':<{width - 2}} {p['cores']}{usable}",
        f"  {'memory':<{width - 2}} " + ("unknown" if memory is None else
                                         f"{memory['total_gib']:.1f} GiB, {memory['available_gib']:.1f} GiB available"),
        f"  {'memfd':<{width - 2}} {'yes' if p['memfd'] else 'no'}",
        f"  {'pidfd':<{width - 2}} {'yes' if p['pidfd'] else 'no'}",
        f"  {'workers':<{width - 2}} " + ("supported" if p["supported"] and p["memfd"] and p["pidfd"] else
                                          "NOT supported here: worker processes need Linux with memfd and pidfd"),
    ]  # fmt: skip
    cuda = info["cuda"]
    if cuda["available"]:
        names = cuda.get("names")
        which = f": {', '.join(names)}" if names else " (--cuda for their names; that initialises CUDA)"
        lines.append(f"CUDA: available, {cuda['devices']} device(s){which}; torch built with CUDA {cuda['torch_cuda']}")
    elif cuda["torch_cuda"] is None:
        lines.append("CUDA: not available (this torch is built without CUDA)")
    else:
        lines.append(f"CUDA: not available (torch built with CUDA {cuda['torch_cuda']}, but it finds no device)")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace, out: TextIO) -> int:
    info = gather_info(cuda_names=args.cuda)
    print(json.dumps(info, indent=2) if args.json else format_info(info), file=out)
    return 0


# -- bench ----------------------------------------------------------------------------------------


class Progress:
    """The bench's progress display on stderr: ``"bar"``, a tqdm bar over the setups (needs
    tqdm); ``"lines"``, a line per setup; ``"auto"``, the bar where tqdm is installed and stderr
    is a terminal, else lines."""

    def __init__(self, total: int, mode: str = "auto", file: TextIO | None = None) -> None:
        self.file = file if file is not None else sys.stderr
        self.total, self.done = total, 0
        self.bar: Any = None
        if mode == "lines" or (mode == "auto" and not self.file.isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            if mode == "bar":
                raise _CliError("--progress bar needs tqdm: pip install 'aiocollect[progress]' (or --progress lines)")
            return
        self.bar = tqdm(total=total, file=self.file, dynamic_ncols=True, desc="starting",
                        bar_format="[{n_fmt}/{total_fmt}] {desc}{postfix} ({elapsed})")  # fmt: skip

    def start(self, title: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"measuring {title}")
        else:
            print(f"[{self.done + 1}/{self.total}] {title} ...", file=self.file, flush=True)

    def finish(self, result: str) -> None:
        self.done += 1
        if self.bar is not None:
            if "\n" in result:  # an error with its traceback: printed above the bar, in full
                self.bar.write(result, file=self.file)
            self.bar.set_postfix_str(f"previous: {result.splitlines()[0]}", refresh=False)
            self.bar.update(1)
        else:
            print(f"  -> {result}", file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_description_str("done")
            self.bar.close()


def _positive(kind: type, what: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0 ({what})")
        return value

    return parse


def check_env(env_id: str, imports: tuple[str, ...]) -> None:
    """Import ``imports``, then make and close one env of ``env_id``: raise :class:`_CliError`
    naming the cause and the fix if that fails."""
    import importlib

    for name in imports:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise _CliError(f"--import {name}: {exc}; install the package that provides it") from exc
    import gymnasium as gym

    try:
        env = gym.make(env_id)
    except gym.error.UnregisteredEnv as exc:
        raise _CliError(
            f"unknown environment id {env_id!r}: {exc}\n"
            "  Check the id (python -c 'import gymnasium; gymnasium.pprint_registry()' lists the registered ones);"
            " an id registered by a package needs it imported first: --import PACKAGE (e.g. --import ale_py),"
            " or the form PACKAGE:ID"
        ) from exc
    except gym.error.DependencyNotInstalled as exc:
        raise _CliError(f"environment {env_id!r} needs a package that is not installed: {exc}") from exc
    except ModuleNotFoundError as exc:
        raise _CliError(f"environment {env_id!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the env's own constructor raises
        raise _CliError(f"environment {env_id!r} could not be made: {type(exc).__name__}: {exc}") from exc
    env.close()


def _fps(value: float) -> str:
    return f"{value:,.0f} frames/s"


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    from . import bench as _bench

    config = _bench.BenchConfig(
        env_id=args.env,
        workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        frames_per_batch=args.frames_per_batch or 0,
        seconds=args.seconds,
        warmup=args.warmup,
        imports=tuple(args.imports),
    )
    if config.batch_frames % config.num_envs:
        raise _CliError(
            f"--frames-per-batch {config.batch_frames} must be a multiple of --workers x --envs-per-worker "
            f"({config.num_envs}): every env steps the same number of times per batch"
        )
    check_env(config.env_id, config.imports)
    stages = _bench.stages(config)
    progress = Progress(len(stages), args.progress)

    sizes = f"{_bench.plural(config.workers, 'worker')} x {_bench.plural(config.envs_per_worker, 'env')}"
    print(f"aiocollect bench: {config.env_id}, random actions, {sizes}, {config.batch_frames} frames per batch, "
          f"{config.seconds:g} s per setup after {config.warmup:g} s warm-up", file=out, flush=True)  # fmt: skip
    print(_bench.machine_line(_bench.machine()), file=out, flush=True)

    limits, rows, leftovers = _run_stages(stages, progress)
    return _report(limits, rows, leftovers, out)


def _run_stages(stages: list[Stage], progress: Progress) -> tuple[list[Row], dict[str, Row], list[str]]:
    """Run each setup in turn (one failing does not stop the others): the limit's runs, the
    other setups' rows by key, and the processes a setup left running (killed)."""
    from . import bench as _bench

    limits: list[Row] = []
    rows: dict[str, Row] = {}
    leftovers: list[str] = []
    try:
        for stage in stages:
            progress.start(stage.title)
            try:
                row = stage.run()
            except Exception as exc:  # noqa: BLE001 - one failing setup must not hide the others
                row = _bench.Row(stage.name, error=_bench.describe(exc))
            finally:
                if stage.key == "aiocollect_async":
                    _bench.shutdown_aiocollect()
                leftovers += _bench.stop_leftovers()
            progress.finish(_fps(row.fps) if row.fps is not None else f"FAILED: {row.error}")
            if stage.key == "limit":
                limits.append(row)
            else:
                rows[stage.key] = row
    finally:
        progress.close()
        _bench.shutdown_aiocollect()
    return limits, rows, leftovers


def _report(limits: list[Row], rows: dict[str, Row], leftovers: list[str], out: TextIO) -> int:
    """Print the table (frames per second, ratio to the limit) and its notes; 1 if a setup failed."""
    from . import bench as _bench

    limit = _bench.combine_limits(limits)
    print(f"\n{'setup':<40}{'frames/s':>12}{'ratio to limit':>16}", file=out)
    failed = any(r.fps is None for r in limits)
    for row in (limit, *rows.values()):
        if row.fps is None:
            failed = True
            error = (row.error or "?").splitlines()
            more = " (in full on stderr)" if len(error) > 1 else ""
            print(f"{row.name:<40}  FAILED: {error[0]}{more}", file=out)
        else:
            ratio = f"{row.fps / limit.fps:.2f}" if limit.fps else "n/a"
            print(f"{row.name:<40}{row.fps:>12,.0f}{ratio:>16}", file=out)
    runs = [r.fps for r in limits if r.fps is not None]
    if len(runs) < len(limits):
        print(f"the limit failed in {len(limits) - len(runs)} of its {len(limits)} runs: {limit.name} is "
              f"{'the other run' if runs else 'not measured'}", file=out)  # fmt: skip
    if len(runs) == 2:
        drift = abs(runs[1] - runs[0]) / max(runs)
        note = "  <- the machine's load changed during the run: ratios are unreliable" if drift > 0.15 else ""
        print(f"limit at the start / at the end: {runs[0]:,.0f} / {runs[1]:,.0f} frames/s (differ by {drift:.0%}){note}",
              file=out)  # fmt: skip
    if leftovers:
        print(f"WARNING: processes left running after a setup (killed): {'; '.join(leftovers)}", file=out)
    return 1 if failed else 0


# -- the command line --------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=PROG, description="aiocollect's command line: versions and platform "
                                  "(info), throughput on this machine (bench).")  # fmt: skip
    top.add_argument("--version", action="version", version=f"aiocollect {__version__}")
    sub = top.add_subparsers(dest="command", metavar="{info,bench}")
    sub.required = True

    info = sub.add_parser(
        "info", help="print versions, platform and whether CUDA is there",
        description="Print the versions of aiocollect and its dependencies, which optional extras are installed, "
        "the platform (kernel, cores, memory, memfd and pidfd) and whether torch sees CUDA. Paste it into bug reports.",
    )  # fmt: skip
    info.add_argument("--json", action="store_true", help="print it as JSON")
    info.add_argument("--cuda", action="store_true", help="also print the CUDA devices' names (initialises CUDA)")
    info.set_defaults(run=cmd_info)

    bench = sub.add_parser(
        "bench", help="compare aiocollect's throughput with the limit and gymnasium's AsyncVectorEnv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure, one after the other, for one gymnasium env with random actions:\n"
        "  limit             WORKERS independent processes, each stepping ENVS_PER_WORKER envs in a plain\n"
        "                    loop, with no communication and no storage (run first and last; the mean is\n"
        "                    the reference of every ratio)\n"
        "  AsyncVectorEnv    gymnasium's, with WORKERS x ENVS_PER_WORKER envs (one process each) and\n"
        "                    shared memory\n"
        "  aiocollect sync   Collector(..., delivery='sync'), consumed with async for\n"
        "  aiocollect async  Collector(..., delivery='async')\n"
        "and print frames per second and the ratio to the limit for each. Exit status: 0, 1 if a setup\n"
        "failed (its row says why), 2 for bad arguments or an env that cannot be made.",
        epilog="example: python -m aiocollect bench --env CartPole-v1 --workers 2 --envs-per-worker 8",
    )  # fmt: skip
    bench.add_argument("--env", required=True, metavar="ENV_ID",
                       help="a gymnasium id, e.g. CartPole-v1 (PACKAGE:ID imports PACKAGE first)")
    bench.add_argument("--workers", type=_positive(int, "worker processes"), default=2,
                       help="worker processes (default 2)")
    bench.add_argument("--envs-per-worker", type=_positive(int, "envs per worker"), default=8,
                       help="envs per worker process (default 8)")
    bench.add_argument("--frames-per-batch", type=_positive(int, "aiocollect's frames_per_batch"), default=None,
                       help="aiocollect's frames per batch (default: 128 steps of every env)")
    bench.add_argument("--seconds", type=_positive(float, "the measuring window"), default=3.0,
                       help="measuring window of each setup, in seconds (default 3)")
    bench.add_argument("--warmup", type=_positive(float, "the warm-up"), default=1.0,
                       help="warm-up before each window, in seconds (default 1)")
    bench.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                       help="import MODULE first, in every process (a package that registers envs, e.g. ale_py); "
                       "repeatable")
    bench.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                       help="progress on stderr: a tqdm bar, a line per setup, or (auto, the default) the bar "
                       "where tqdm is installed and stderr is a terminal")
    bench.set_defaults(run=cmd_bench)
    return top  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    p = parser()
    args = p.parse_args(argv)
    try:
        status: int = args.run(args, sys.stdout)
        return status
    except _CliError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
