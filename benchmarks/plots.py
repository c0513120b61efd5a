"""Draw the benchmarks' figures as PNGs, from the JSON files the benchmark scripts write.

Each benchmark script takes ``--json PATH`` and writes its results there. This script reads such
files, recognises which benchmark wrote each one, and draws one PNG per benchmark into
``--out`` (default ``docs/img``, where the docs site's benchmarks page finds them):

=====================  ===================  ==============================================
JSON written by        PNG                  what it shows
=====================  ===================  ==============================================
``throughput.py``      ``throughput.png``   frames/s of every setup, its ratio to the limit
``startup.py``         ``startup.png``      seconds per import and to the first batch (median, min-max)
``vector_envs.py``     ``vector_envs.png``  frames/s of every setup (or, ``--sliced``, setup against limit)
``pixels.py``          ``pixels.png``       one panel per observation format and run
``inference.py``       ``inference.png``    frames/s and the event loop's lag, per case
``weight_sync.py``     ``weight_sync.png``  update latency: idle, collecting, pickle+pipe
=====================  ===================  ==============================================

Every figure is titled with the machine and the time the JSON records, and the settings that
matter (a short development run says so in its subtitle). A benchmark given twice gets its second
PNG named after the JSON file (``pixels_<stem>.png``).

Run (needs matplotlib: ``pip install 'aiocollect[plots]'``)::

    .venv/bin/python benchmarks/throughput.py --json benchmarks/results/throughput.json
    ...
    .venv/bin/python benchmarks/plots.py benchmarks/results/*.json          # -> docs/img/*.png
    .venv/bin/python benchmarks/plots.py results/pixels.json --out /tmp/img
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "docs", "img")
DEFAULT_RESULTS = os.path.join(ROOT, "benchmarks", "results")

# colours: the reference (limit), baselines others wrote, aiocollect
LIMIT, OTHER, OURS, ZERO_COPY = "#9e9e9e", "#e0a040", "#3070b0", "#60a0d8"


class UnknownBenchmark(ValueError):
    """A JSON file that none of the benchmark scripts writes."""


def kind_of(data: Mapping[str, Any]) -> str:
    """Which benchmark wrote ``data``: the ``"benchmark"`` key where the script writes one, else
    the shape of the file (vector_envs.py and inference.py write none)."""
    if not isinstance(data, Mapping):
        raise UnknownBenchmark(f"a benchmark's JSON is an object, not a {type(data).__name__}")
    if isinstance(data.get("benchmark"), str):
        return data["benchmark"]
    if "cartpole_sliced" in data or ("cartpole" in data and "limit_fps" in data.get("cartpole", {})):
        return "vector_envs"
    if "gpu" in data or ("cartpole" in data and "worker" in data.get("cartpole", {})):
        return "inference"
    raise UnknownBenchmark(f"no benchmark script writes a JSON with the keys {sorted(data)[:8]}")


# -- shared pieces ---------------------------------------------------------------------------------


def machine_of(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The machine fields (``cpu_count``, ``python``, ``torch`` ...): at the top level in some
    files, under ``"machine"`` in others."""
    return data.get("machine") or data


def caption(data: Mapping[str, Any], settings: str = "") -> str:
    """``2 CPUs, torch 2.13.0+cpu, 2026-11-23T22:24`` (+ the settings that matter, on a second
    line). Scripts that record no time get the JSON file's modification time, said so."""
    m = machine_of(data)
    parts = []
    if m.get("cpu_count"):
        parts.append(f"{m['cpu_count']} CPUs")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    when = data.get("time") or m.get("time")
    if when:
        parts.append(str(when)[:16].replace("T", " "))
    elif data.get("_file_time"):
        parts.append(f"file written {data['_file_time']}")
    return ", ".join(parts) + (f"\n{settings}" if settings else "")


def title(fig: Any, script: str, text: str) -> None:
    """The figure's title: the script, then the machine, the time and the settings."""
    fig.suptitle(f"benchmarks/{script}\n{text}", fontsize=9)


def short_run(seconds: float | None, usual: float) -> str:
    """A note for windows shorter than the script's default: such figures are not measurements."""
    if seconds is not None and seconds < usual:
        return f" (short run: {seconds:g} s windows, not a measurement)"
    return ""


def hbars(ax: Any, names: Sequence[str], values: Sequence[float], colors: Sequence[str], *,
          labels: Sequence[str] | None = None, xlabel: str = "") -> None:
    """Horizontal bars, the first name on top, each labelled at its end."""
    y = list(range(len(names)))[::-1]
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, names)
    ax.set_xlabel(xlabel)
    top = max(values, default=0) or 1
    for yi, v, text in zip(y, values, labels or [f"{v:,.0f}" for v in values], strict=True):
        ax.text(v + top * 0.01, yi, text, va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    ax.grid(axis="x", alpha=0.3)


def color_for(name: str) -> str:
    n = name.lower()
    if n.startswith("limit"):
        return LIMIT
    if "aiocollect" in n or n in ("worker", "server") or "server" in n or "inference" in n:
        return ZERO_COPY if "zero_copy" in n else OURS
    return OTHER


# -- one function per benchmark ---------------------------------------------------------------------


def plot_throughput(data: Mapping[str, Any], fig: Any) -> None:
    args = data.get("args", {})
    rows = [r for r in data["results"].values() if r.get("fps")]
    ax = fig.subplots()
    hbars(ax, [r["name"] for r in rows], [r["fps"] for r in rows], [color_for(r["name"]) for r in rows],
          labels=[f"{r['fps']:,.0f}  ({r['ratio_to_limit']:.2f} of the limit)" if r.get("ratio_to_limit") else
                  f"{r['fps']:,.0f}" for r in rows],
          xlabel="frames per second")
    skipped = [f"{r['name']}: {r['note']}" for r in data["results"].values() if not r.get("fps") and r.get("note")]
    settings = (f"{data.get('env', 'CartPole-v1')}, {args.get('workers', '?')} workers x "
                f"{args.get('envs_per_worker', '?')} envs, {args.get('frames_per_batch', '?')} frames/batch"
                + short_run(args.get("seconds"), 4.0)
                + ("\nnot measured: " + "; ".join(skipped) if skipped else ""))
    title(fig, "throughput.py", caption(data, settings))


def plot_startup(data: Mapping[str, Any], fig: Any) -> None:
    names, med, lo, hi = [], [], [], []

    def add(name: str, runs: Sequence[Mapping[str, float]], key: str) -> None:
        values = [r[key] for r in runs if key in r]
        if values:
            names.append(name)
            med.append(statistics.median(values))
            lo.append(min(values))
            hi.append(max(values))

    for row, runs in data.get("imports", {}).items():
        add("python up" if row == "python -c pass" else row, runs, "launch_to_done" if row == "python -c pass" else "total")
    def policy_words(label: str) -> str:  # "MLP, 4 workers" (a row per number of workers): "MLP policy, 4 workers"
        policy, _, workers = label.partition(", ")
        return f"{policy} policy" + (f", {workers}" if workers else "")

    for label, runs in data.get("first_batch", {}).items():
        add(f"launch -> first batch, {policy_words(label)}", runs, "launch_to_first_batch")
    for label, runs in data.get("first_batch", {}).items():
        add(f"second collector, {policy_words(label)}", runs, "second_collector")
    ax = fig.subplots()
    y = list(range(len(names)))[::-1]
    ax.barh(y, med, color=[OURS if "first batch" in n or "collector" in n.lower() or "aiocollect" in n else OTHER
                           for n in names])
    ax.errorbar(med, y, xerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                fmt="none", ecolor="black", capsize=3, linewidth=1)
    ax.set_yticks(y, names)
    ax.set_xlabel("seconds (median; whiskers: min - max)")
    for yi, m in zip(y, med):
        ax.text(m, yi + 0.3, f"{m:.2f} s", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    repeat = max((len(v) for v in data.get("imports", {}).values()), default=0)
    title(fig, "startup.py", caption(data, f"{repeat} fresh process(es) per figure"
                                     + (" (a short run: 5 is the default)" if repeat < 5 else "")))


def _sliced_panel(ax: Any, results: Mapping[str, Mapping[str, Any]], title: str) -> None:
    """Setup against limit, side by side, for a ``--sliced`` comparison (the two took turns)."""
    names = list(results)
    y = list(range(len(names)))[::-1]
    h = 0.38
    ax.barh([v + h / 2 for v in y], [results[n]["limit_fps"] for n in names], h, color=LIMIT, label="limit (same turns)")
    ax.barh([v - h / 2 for v in y], [results[n]["fps"] for n in names], h,
            color=[color_for(n) for n in names], label="setup")
    ax.set_yticks(y, names)
    top = max([results[n]["limit_fps"] for n in names] + [results[n]["fps"] for n in names], default=1)
    for yi, n in zip(y, names):
        r = results[n]
        ax.text(r["fps"] + top * 0.01, yi - h / 2, f"{r['ratio']:.2f} (drift {r['limit_drift']:.0%})",
                va="center", fontsize=8)
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("frames per second")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)


def _results_panel(ax: Any, results: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]], title: str,
                   limit_fps: float | None = None) -> None:
    """Frames/s of setups measured one after the other, each labelled with its ratio to the limit
    (``ratio_to_limit``, or pixels.py's ``ratio`` and ``ratio_adjacent``)."""
    rows = [r for r in (results.values() if isinstance(results, Mapping) else results) if r.get("fps")]
    if limit_fps:
        rows = [{"name": "limit (mean of its runs)", "fps": limit_fps, "ratio_to_limit": 1.0}, *rows]

    def label(r: Mapping[str, Any]) -> str:
        ratio = r.get("ratio_to_limit", r.get("ratio"))
        text = f"{r['fps']:,.0f}" + (f"  ({ratio:.2f}" if ratio is not None else "")
        if r.get("ratio_adjacent") is not None:
            text += f"; adjacent {r['ratio_adjacent']:.2f}"
        return text + (")" if ratio is not None else "")

    hbars(ax, [r["name"] for r in rows], [r["fps"] for r in rows], [color_for(r["name"]) for r in rows],
          labels=[label(r) for r in rows], xlabel="frames per second (ratio to the limit)")
    ax.set_title(title, fontsize=9)


def plot_vector_envs(data: Mapping[str, Any], fig: Any) -> None:
    panels: list[tuple[str, Callable[[Any], None]]] = []
    if "cartpole_sliced" in data:
        results = data["cartpole_sliced"]
        panels.append(("CartPole vector entry point, --sliced (setup and limit took turns)",
                       lambda ax: _sliced_panel(ax, results, "")))
    if "cartpole" in data:
        panels.append(("CartPole vector entry point + MLP", lambda ax: _results_panel(ax, data["cartpole"]["results"], "")))
    if isinstance(data.get("pong"), dict) and "results" in data["pong"]:
        panels.append(("EnvPool Pong", lambda ax: _results_panel(ax, data["pong"]["results"], "")))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (heading, draw_panel) in zip(axes, panels):
        draw_panel(ax)
        ax.set_title(heading, fontsize=9)
    title(fig, "vector_envs.py", caption(data, "the JSON does not record the windows' length"))


def plot_pixels(data: Mapping[str, Any], fig: Any) -> None:
    args = data.get("args", {})
    runs = data.get("runs", [])
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    seen: dict[str, int] = {}
    for ax, run in zip(axes, runs):
        obs = run.get("obs", "?")
        seen[obs] = seen.get(obs, 0) + 1
        heading = f"{obs}" + (f", run {seen[obs]}" if len(runs) > len(set(r.get('obs') for r in runs)) else "")
        if run.get("sliced"):
            _sliced_panel(ax, run["results"], heading + " (--sliced: setup and limit took turns)")
        else:
            _results_panel(ax, run["results"], heading, limit_fps=run.get("limit_fps"))
    settings = (f"Pong, random policy, {args.get('workers', '?')} workers x {args.get('envs_per_worker', '?')} envs, "
                f"{args.get('frames_per_batch', '?')} frames/batch")
    if args.get("sliced"):
        turns, seconds = args.get("turns", 8), args.get("turn_seconds", 2.0)
        settings += f", {turns} turns of {seconds:g} s per setup"
        if turns < 8 or seconds < 2.0:
            settings += " (a short run, not a measurement)"
    else:
        settings += short_run(args.get("seconds"), 6.0)
    title(fig, "pixels.py", caption(data, settings))


def plot_inference(data: Mapping[str, Any], fig: Any) -> None:
    cases = [(name, data[name]) for name in ("cartpole", "pong") if isinstance(data.get(name), dict)]
    cases += [(f"Pong, {total} envs, GPU", table) for total, table in data.get("gpu", {}).items()]
    axes = fig.subplots(len(cases), 2, squeeze=False)
    for (name, table), (ax_fps, ax_lag) in zip(cases, axes):
        setups = list(table)
        hbars(ax_fps, setups, [table[s]["fps"] for s in setups], [OURS if s != "worker" else OTHER for s in setups],
              labels=[f"{table[s]['fps']:,.0f} ({table[s]['ratio']:.2f})" for s in setups],
              xlabel="frames per second (ratio to worker inference)")
        ax_fps.set_title(name, fontsize=9)
        y = list(range(len(setups)))[::-1]
        h = 0.38
        ax_lag.barh([v + h / 2 for v in y], [max(table[s]["lag_ms"]["p50"], 0) for s in setups], h, color=OTHER,
                    label="p50")
        ax_lag.barh([v - h / 2 for v in y], [table[s]["lag_ms"]["p99"] for s in setups], h, color=OURS, label="p99")
        ax_lag.set_yticks(y, [""] * len(setups))
        ax_lag.set_xlabel("event-loop lag while collecting (ms)")
        ax_lag.legend(fontsize=7)
        ax_lag.grid(axis="x", alpha=0.3)
    title(fig, "inference.py", caption(data, "the JSON does not record the windows' length or the rounds"))


def plot_weight_sync(data: Mapping[str, Any], fig: Any) -> None:
    models = data.get("models", {})
    results = data["results"]
    series = [("idle", "aiocollect, workers idle"), ("collecting", "aiocollect, workers collecting"),
              ("naive", "pickle + pipe, workers idle")]
    names = [models.get(key, {}).get("name", key) for key in results]
    ax = fig.subplots()
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [results[m].get(key, {}).get("latency", {}).get("p50") for m in results]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax.bar([x for x, v in zip(xs, values) if v], [v for v in values if v], width,
               color=(OURS, ZERO_COPY, OTHER)[i], label=label)
        for x, v in zip(xs, values):
            if v:
                ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("update_weights -> every worker applied, p50 (ms, log)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    args = data.get("args", {})
    updates = f"{args.get('n', '?')} updates per series"
    if "n_big" in args:  # (the big model's series are shorter)
        updates = f"{args['n']} updates per series of the small model, {args['n_big']} of the big one"
    short = args.get("n", 30) < 10
    title(fig, "weight_sync.py", caption(data, f"{args.get('workers', '?')} workers, {updates}"
                                         + (" (a short run, not a measurement)" if short else "")))


PLOTTERS: dict[str, tuple[Callable[[Mapping[str, Any], Any], None], tuple[float, float]]] = {
    "throughput": (plot_throughput, (9, 4)),
    "startup": (plot_startup, (9, 5)),
    "vector_envs": (plot_vector_envs, (9, 5)),
    "pixels": (plot_pixels, (9, 4.5)),
    "inference": (plot_inference, (11, 5)),
    "weight_sync": (plot_weight_sync, (8, 4.5)),
}


def figure_size(kind: str, data: Mapping[str, Any]) -> tuple[float, float]:
    w, h = PLOTTERS[kind][1]
    if kind == "pixels":
        return w, 1.2 + 3.0 * max(len(data.get("runs", [])), 1)
    if kind == "inference":
        return w, 1.2 + 3.2 * max(sum(isinstance(data.get(k), dict) for k in ("cartpole", "pong")) + len(data.get("gpu", {})), 1)
    return w, h


def draw(path: str, out_dir: str, taken: set[str]) -> str:
    """Draw the PNG for the JSON file ``path`` into ``out_dir``; return the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data["_file_time"] = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))
    kind = kind_of(data)
    if kind not in PLOTTERS:
        raise UnknownBenchmark(f"{path}: benchmark {kind!r} has no plot (plots exist for {sorted(PLOTTERS)})")
    name = kind if kind not in taken else f"{kind}_{os.path.splitext(os.path.basename(path))[0]}"
    taken.add(kind)
    fig = plt.figure(figsize=figure_size(kind, data), layout="constrained")
    try:
        PLOTTERS[kind][0](data, fig)
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, f"{name}.png")
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("json", nargs="*", help=f"JSON files written by the benchmarks' --json (default: {DEFAULT_RESULTS}/*.json)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the PNGs (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    paths = args.json
    if not paths:
        if not os.path.isdir(DEFAULT_RESULTS):
            p.error(f"no JSON file given, and {DEFAULT_RESULTS} does not exist: run the benchmarks with --json first")
        paths = sorted(os.path.join(DEFAULT_RESULTS, f) for f in os.listdir(DEFAULT_RESULTS) if f.endswith(".json"))
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("plots.py needs matplotlib: pip install 'aiocollect[plots]'", file=sys.stderr)
        return 2
    failed = 0
    taken: set[str] = set()
    for path in paths:
        try:
            print(f"{path} -> {draw(path, args.out, taken)}")
        except (OSError, ValueError, KeyError, TypeError) as exc:  # one bad file must not hide the others
            print(f"{path}: not drawn: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
