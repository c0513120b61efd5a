"""Check progress=True in a real Jupyter kernel: the bar stays in the cell that started the
collector, and nothing is written to stderr (no TqdmWarning).

Not part of the test suite (it needs jupyter packages the suite does not depend on). Run it in an
environment with aiocollect, ipykernel and nbclient, with and without ipywidgets::

    python -m venv /tmp/venv-nb && /tmp/venv-nb/bin/pip install torch==2.13.0
    /tmp/venv-nb/bin/pip install -e '.[progress]' ipykernel nbclient
    /tmp/venv-nb/bin/python scripts/notebook-progress-check.py              # expects a text line
    /tmp/venv-nb/bin/pip install ipywidgets
    /tmp/venv-nb/bin/python scripts/notebook-progress-check.py              # expects the widget

Cell 1 starts a collector with ``progress=True`` (``await c.start()``); cell 2 collects every
batch; cell 3 closes it. Prints each cell's outputs, then checks them; exits 1 on a failure.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import nbclient
import nbformat

CELLS = [
    "from aiocollect import Collector\n"
    "c = Collector('CartPole-v1', frames_per_batch=256, total_frames=256 * 40, num_workers=1,\n"
    "              envs_per_worker=4, progress=True)\n"
    "await c.start()",
    "n = 0\nasync for batch in c:\n    n += 1\nprint('batches', n)",
    "await c.aclose()\nprint('closed')",
]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _describe(output: dict) -> str:
    if output["output_type"] == "stream":
        return f"stream {output['name']}: {output['text']!r}"
    data = output.get("data", {})
    return f"{output['output_type']}: " + ", ".join(f"{k}={str(v)[:110]!r}" for k, v in data.items())


def main() -> int:
    widgets = importlib.util.find_spec("ipywidgets") is not None
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3", store_widget_state=True)
    client.execute()
    for i, cell in enumerate(nb.cells, 1):
        print(f"--- cell {i}")
        for output in cell.outputs:
            print("   ", _describe(output))

    failures = []
    stderr = [o for cell in nb.cells for o in cell.outputs if o["output_type"] == "stream" and o["name"] == "stderr"]
    if stderr:
        failures.append(f"stderr output: {[o['text'] for o in stderr]}")
    first, second, third = (cell.outputs for cell in nb.cells)
    if [o.get("text") for o in second] != ["batches 40\n"] or [o.get("text") for o in third] != ["closed\n"]:
        failures.append("cells 2 and 3 must print only their own line (no progress output)")
    if widgets:
        views = [o for o in first if WIDGET_VIEW in o.get("data", {})]
        state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
        bars = [m["state"] for m in state.values() if m.get("model_name") == "FloatProgressModel"]
        print(f"widget state: {json.dumps(bars)}")
        if len(views) != 1 or len(first) != 1:
            failures.append("cell 1 must hold exactly one output, the widget")
        if [(b.get("value"), b.get("max")) for b in bars] != [(10240.0, 10240.0)]:
            failures.append("the widget must end at 10240 of 10240 frames")
    else:
        texts = [o["data"].get("text/plain", "") for o in first if o["output_type"] == "display_data"]
        if len(texts) != 1 or len(first) != 1:
            failures.append("cell 1 must hold exactly one output, the progress line")
        elif "10.2k/10.2k" not in texts[0] or "100%" not in texts[0]:
            failures.append(f"the progress line must end at 10.2k/10.2k frames: {texts[0]!r}")
    kind = "with ipywidgets (widget)" if widgets else "without ipywidgets (displayed text line)"
    for failure in failures:
        print("FAIL:", failure)
    print(f"{'FAILED' if failures else 'OK'}: progress=True in a Jupyter kernel {kind}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
