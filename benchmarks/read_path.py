"""The read path of one training step: which files and function lines a reader opens to follow it.

Runs `Trainer.train_step` of configs/quickstart_flow_grpo.yaml (local engine, the small tiny SD3 model at 32 px) once
to warm up, then traces a second step with a profiler hook in every thread of the process and lists each function of
`diffusion_rl/` that ran, with its lines: from its first decorator to its last line, docstring included. A file's
count is the union of its functions' lines (a nested function counts inside its parent).

Each file's lines are counted twice: every line of its functions, and the code among them (no docstring, comment or
blank line). Counted: the step's own layers. Left out, as a reader takes them by their name and contract without opening
them (listed with --all): the model (models/), the reward functions (rewards/ but the combiner), data and config
plumbing (data/, config/, registry.py, utils/), the run guard (guard/), the phase timer and FLOP
tally (trainer/timing.py, engine/flops.py), the single-device no-ops (engine/parallel.py), and the sampler's
helpers named by the loop (sampling/window.py, sampling/ode.py, sampling/trajectory.py).

    python benchmarks/read_path.py [--all] [--json out.json] [override ...]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import sys
import tempfile
import threading
import tokenize
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusion_rl"
LEFT_OUT = ("models/", "data/", "config/", "registry.py", "utils/", "guard/", "trainer/timing.py",
            "engine/flops.py", "engine/parallel.py", "sampling/window.py", "sampling/ode.py",
            "sampling/trajectory.py")  # fmt: skip
REWARDS_KEPT = ("rewards/combine.py",)


def counted(path: str) -> bool:
    if path.startswith("rewards/"):
        return path in REWARDS_KEPT
    return not path.startswith(LEFT_OUT)


def code_lines(path: Path) -> set[int]:
    """The lines of `path` that hold code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}  # fmt: skip
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def function_spans(path: Path) -> dict[int, tuple[int, int]]:
    """first line of a function's code object → (its first decorator's line, its last line)."""
    spans = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[start] = spans[node.lineno] = (start, node.end_lineno)
    return spans


def trace_step(overrides: list[str]) -> list[dict]:
    from diffusion_rl.config import load
    from diffusion_rl.models.tiny import save_tiny
    from diffusion_rl.trainer.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="read_path_"))
    model = save_tiny(work / "model", "sd3", "small", seed=0)
    cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [
        f"model.path={model}", f"run.dir={work}/run", "model.device=cpu", "train.save_every=0", "val.every=0",
        "val.before_train=false", "log.tensorboard=false", "log.progress_bar=false", "sampling.height=32",
        "sampling.width=32", *overrides])  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train_step(0)  # first-shape work (FLOP counting) happens in the first step
    seen: dict[tuple[str, int, str], int] = defaultdict(int)

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            code = frame.f_code
            seen[code.co_filename, code.co_firstlineno, code.co_qualname] += 1

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        trainer.train_step(1)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    spans: dict[str, dict] = {}
    rows = []
    for (filename, first, name), calls in sorted(seen.items()):
        span = spans.setdefault(filename, function_spans(Path(filename))).get(first)
        if span is not None:  # module and class bodies, comprehensions: not functions a reader opens
            rows.append({"file": str(Path(filename).relative_to(PACKAGE)), "function": name, "lines": span,
                         "calls": calls})  # fmt: skip
    return rows


def summary(rows: list[dict], everything: bool) -> dict[str, dict]:
    files: dict[str, dict] = {}
    for row in rows:
        if everything or counted(row["file"]):
            entry = files.setdefault(row["file"], {"lines": set(), "functions": []})
            entry["lines"].update(range(row["lines"][0], row["lines"][1] + 1))
            entry["functions"].append(row["function"])
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="count every file of diffusion_rl/ the step runs")
    parser.add_argument("--json", type=Path, help="write every traced function here")
    parser.add_argument("overrides", nargs="*", help="config overrides, as `train` takes them")
    args = parser.parse_args()
    rows = trace_step(args.overrides)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    files = summary(rows, args.all)
    total = code = 0
    print(f"{'file':42s} {'lines':>5s} {'code':>5s}  functions")
    for name, entry in sorted(files.items()):
        entry_code = len(entry["lines"] & code_lines(PACKAGE / name))
        total, code = total + len(entry["lines"]), code + entry_code
        print(f"{name:42s} {len(entry['lines']):5d} {entry_code:5d}  {', '.join(entry['functions'])}")
    print(
        f"{len(files)} files, {total} lines of functions a reader opens ({code} of code: no docstring, comment or "
        "blank line)"
    )


if __name__ == "__main__":
    main()
