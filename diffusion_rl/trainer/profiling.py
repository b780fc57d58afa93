"""torch.profiler traces of chosen training steps (`profile.steps`) and CUDA memory snapshots (`profile.memory`).

Steps are numbered as in metrics.jsonl: the first training step is 1. For each profiled step it writes, under
`<run.dir>/profile/`:

    step_XXXXXX.trace.json     Chrome trace (open in https://ui.perfetto.dev or chrome://tracing); the phases
                               (generate, reward, prepare, update) appear as `phase/<name>` ranges
    step_XXXXXX.top_ops.txt    operators sorted by self time (also logged)
    step_XXXXXX.memory.pickle  with profile.memory on a CUDA device: the allocator's history over the step
                               (drag into https://pytorch.org/memory_viz)

Only this process is profiled (the local engine does all the work here).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from diffusion_rl.utils.files import naming

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
TOP_OPERATORS = 20
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    def __init__(self, steps: list[int], memory: bool, run_dir: str | Path, device: torch.device):
        self.steps = set(steps)
        self.dir = Path(run_dir) / PROFILE_DIR
        self.cuda = device.type == "cuda"
        self.memory = memory and self.cuda
        if memory and not self.cuda:
            logger.info("profile.memory: the model runs on %s, not CUDA; no memory snapshot is recorded", device)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile the block when `step` is one of profile.steps; otherwise run it as it is."""
        if step not in self.steps:
            yield
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        try:
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                yield
        finally:
            if self.memory:
                torch.cuda.synchronize()
                snapshot = self.dir / f"{name}.memory.pickle"
                torch.cuda.memory._dump_snapshot(str(snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)
                logger.info("profile: CUDA memory snapshot of step %d → %s", step, snapshot)
        trace = self.dir / f"{name}.trace.json"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS)
        with naming(self.dir / f"{name}.top_ops.txt"):
            (self.dir / f"{name}.top_ops.txt").write_text(table, encoding="utf-8")
        logger.info("profile: trace of step %d → %s; top operators by self time:\n%s", step, trace, table)
