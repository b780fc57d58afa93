"""The first 3 steps' logged numbers of every quickstart (configs/quickstart*.yaml on the local engine, and
quickstart_flow_grpo.yaml on a colocated Ray engine of 2 workers, quickstart_nft.yaml on one of 1) stay what they
were when recorded in tests/fixtures/quickstart_numbers.json: a refactor of the engine or the sampler must not move
them.

Each run is shortened, not changed in kind: the small tiny models of tests/conftest.py (quickstart.yaml: the shipped
ShapesWorld model it trains), 32 px, 3 training steps,
no validation or checkpoints; the sampler, window, tree, loss and rewards stay as each quickstart sets them.
Compared: every numeric key of every metrics row except durations and speeds (`timing/`, `perf/`, `driver/`,
`sync/`, `images_per_second`).

Floats differ across CPUs (AMX bf16 tiles or not, AVX-512 or not), torch versions and thread counts, so the fixture
keeps one recording per machine fingerprint (torch version, AMX and AVX-512 flags of /proc/cpuinfo, torch threads):
- on a fingerprint that has a recording, every number must be equal bit for bit;
- on another, the numbers must match the first recording within rel 0.25 or abs 0.05 (DIFFERENT_CPU). That is
  loose on purpose: the JPEG reward moves by whole bytes when one pixel rounds the other way, and the advantages
  normalise reward spreads of ~20 bytes in ~1.5 kB, so one byte moves an advantage by ~5 % and everything trained
  from it after; fractions (clip fraction of 8 samples) move by 1/8. Across CPUs this catches a lost term, a wrong
  branch or a missing metric, not a last-bit change; `--record` on that machine adds its fingerprint.

Re-record (only when a change of numbers is intended, and say why in the commit):
    python tests/test_quickstart_numbers.py --record                          # every case
    python tests/test_quickstart_numbers.py --record local:quickstart.yaml    # only these, into this machine's
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as tests/conftest.py: Ray on loopback only
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/quickstart_numbers.json"
QUICKSTARTS = sorted(p.name for p in (ROOT / "configs").glob("quickstart*.yaml"))
RAY_WORKERS = {"quickstart_flow_grpo.yaml": 2, "quickstart_nft.yaml": 1}  # 2: the metrics reduced over workers
CASES = [f"local:{name}" for name in QUICKSTARTS] + [f"ray:{name}" for name in RAY_WORKERS]
SHIPPED_MODEL = "quickstart.yaml"  # trains the ShapesWorld model shipped in the package, not a small tiny model
# the quickstarts not on sd3
FAMILY = {"quickstart_edit.yaml": "flux_kontext", "quickstart_video.yaml": "wan", "quickstart_i2v.yaml": "wan_i2v"}
STEPS = 3
THREADS = 2
SKIP = ("timing/", "perf/", "driver/", "sync/")
DIFFERENT_CPU = {"rel": 0.25, "abs": 0.05}
SHORT = ("model.device=cpu", f"train.total_steps={STEPS}", "train.save_every=0", "val.every=0",
         "val.before_train=false", "log.tensorboard=false", "log.progress_bar=false", "sampling.height=32",
         "sampling.width=32", f"engine.num_threads={THREADS}")  # fmt: skip
# as tests/engine/conftest.py's Ray runs: one CPU (and torch thread) per worker, short timeouts
RAY = ("engine.kind=ray", "engine.cpus_per_worker=1", "engine.collective_timeout_s=60",
       "engine.start_timeout_s=120")  # fmt: skip


def fingerprint() -> dict:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "amx": "amx_tile" in flags,
        "avx512": "avx512f" in flags,
        "threads": THREADS,
    }


def make_models(root: Path) -> dict[str, Path]:
    """The tiny models of tests/conftest.py (small presets, seed 0)."""
    from diffusion_rl.models.tiny import save_tiny

    families = ("sd3", "wan", "flux_kontext", "wan_i2v")
    return {family: save_tiny(root / family, family, "small", seed=0) for family in families}


def numbers(row: dict) -> dict[str, float]:
    """A metrics row's numbers, durations and speeds aside."""
    numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: float(v) for k, v in numeric.items() if not k.startswith(SKIP) and k != "images_per_second"}


def run_case(case: str, models: dict[str, Path], work: Path) -> list[dict[str, float]]:
    """The numbers of the first STEPS rows of one case ("local:NAME" or "ray:NAME")."""
    from diffusion_rl.config import load
    from diffusion_rl.trainer import make_trainer
    from tests.helpers import random_pair_file

    kind, name = case.split(":")
    run_dir = work / case.replace(":", "_")
    if name == SHIPPED_MODEL:  # the shipped ShapesWorld model itself (32 px already), copied out as a user gets it
        shapes = work / "shapes"
        overrides = [*SHORT, f"run.dir={run_dir}", f"model.path={shapes}",
                     f"data.train={shapes / 'shapes_prompts/train.jsonl'}",
                     f"val.prompts={shapes / 'shapes_prompts/val.jsonl'}"]  # fmt: skip
    else:
        overrides = [*SHORT, f"run.dir={run_dir}", f"model.path={models[FAMILY.get(name, 'sd3')]}"]
    if name == "quickstart_dpo_offline.yaml":
        overrides.append(f"data.pairs={random_pair_file(work / 'pairs', 4)}")
    if kind == "ray":
        overrides += [*RAY, f"engine.num_workers={RAY_WORKERS[name]}"]
    threads = torch.get_num_threads()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the quickstarts name their prompt files relative to the repository
    try:
        trainer = make_trainer(load(ROOT / "configs" / name, overrides))
        try:
            rows = trainer.train()
        finally:
            if hasattr(trainer.engine, "close"):
                trainer.engine.close()
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    assert len(rows) == STEPS, case
    return [numbers(row) for row in rows]


def read_fixture() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {"recordings": []}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("quickstart_models"))


@pytest.fixture(scope="module")
def ray_for_module():
    ray = pytest.importorskip("ray")
    ray.shutdown()  # the local cluster the engine tests share (tests/engine/conftest.py ray_session), if it runs
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def test_the_fixture_covers_every_quickstart():
    recordings = read_fixture()["recordings"]
    assert recordings, f"no recording in {FIXTURE}: run python tests/test_quickstart_numbers.py --record"
    for recording in recordings:
        assert sorted(recording["numbers"]) == sorted(CASES), "re-record: the quickstart configs changed"


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("local:")])
def test_local_quickstart_logs_the_recorded_numbers(case, models, tmp_path):
    check(case, run_case(case, models, tmp_path))


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("ray:")])
def test_colocated_ray_quickstart_logs_the_recorded_numbers(case, models, tmp_path, ray_for_module):
    check(case, run_case(case, models, tmp_path))


def check(case: str, rows: list[dict[str, float]]) -> None:
    recordings = read_fixture()["recordings"]
    same = [r for r in recordings if r["fingerprint"] == fingerprint()]
    recorded = (same or recordings)[0]["numbers"][case]
    assert len(rows) == len(recorded), f"{case}: {len(rows)} steps logged, {len(recorded)} recorded"
    for step, (row, expected) in enumerate(zip(rows, recorded), start=1):  # new metrics may appear, none may go
        assert not expected.keys() - row.keys(), f"{case} step {step}: no longer logs {sorted(expected.keys() - row)}"
    for step, (row, expected) in enumerate(zip(rows, recorded, strict=True), start=1):
        for key, value in expected.items():
            if same:  # bit for bit (NaN equal to NaN)
                assert row[key] == value or (math.isnan(row[key]) and math.isnan(value)), (case, step, key)
            else:
                assert row[key] == pytest.approx(value, nan_ok=True, **DIFFERENT_CPU), (case, step, key)


def record(cases: list[str]) -> None:
    """Run the cases (all when empty) and store their numbers under this machine's fingerprint: all of them replace
    an older recording of it; named ones are added to it (a new quickstart, or one whose numbers changed on purpose)
    and drop cases that no longer exist."""
    import tempfile

    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    data = read_fixture()
    mine = next((r for r in data["recordings"] if r["fingerprint"] == fingerprint()), None)
    if cases and mine is None:
        sys.exit(f"no recording of {fingerprint()} to add cases to: record them all (--record)")
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = make_models(work / "models")
        needs_ray = any(case.startswith("ray:") for case in cases or CASES)
        if needs_ray:
            import ray

            ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
        try:
            result = {case: run_case(case, models, work) for case in cases or CASES}
        finally:
            if needs_ray:
                ray.shutdown()
    if cases:
        result = {case: numbers for case, numbers in {**mine["numbers"], **result}.items() if case in CASES}
    data["recordings"] = [r for r in data["recordings"] if r["fingerprint"] != fingerprint()]
    data["recordings"].append({"fingerprint": fingerprint(), "numbers": result})
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(cases or CASES)} runs under {fingerprint()} in {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/test_quickstart_numbers.py --record [CASE ...]  (e.g. local:quickstart.yaml)")
    sys.path.insert(0, str(ROOT))  # tests.helpers, as pytest imports it from the repository root
    record(sys.argv[2:])
