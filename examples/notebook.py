"""The notebook shape: start, collect and close in separate steps (each would be a cell with
top-level `await` in Jupyter, where the kernel's loop is already running). Here each "cell" is
run with anyio.run on purpose: the collector's own task belongs to no cell.

    .venv/bin/python examples/notebook.py
"""

import anyio

from aiocollect import Collector


async def notebook() -> None:
    collector = Collector("CartPole-v1", frames_per_batch=1000, num_workers=1, envs_per_worker=4)

    async def cell_1():
        await collector.start()
        print("started:", collector)

    async def cell_2():
        batch = await collector.collect()
        print("one batch:", tuple(batch.batch_size), "frames so far:", collector.frames)

    async def cell_3():
        await collector.aclose()
        await collector.aclose()  # closing twice is fine
        print("closed:", collector.state.value)

    for cell in (cell_1, cell_2, cell_2, cell_3):  # each cell is its own task, as in Jupyter
        async with anyio.create_task_group() as tg:
            tg.start_soon(cell)


anyio.run(notebook)
