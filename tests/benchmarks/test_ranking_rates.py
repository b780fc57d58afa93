"""The ranking's rate selection (benchmarks/ranking_rates.py): a log grid grows past an end while its best rate sits
there, until the best is bracketed or the extensions run out; a selection shard runs the grown grid."""

import json

import pytest


@pytest.fixture(scope="module")
def rates(load_benchmark):
    return load_benchmark("ranking_rates")


GRID = [1e-5, 3e-5, 9e-5]


def test_a_grid_waits_for_its_runs_then_is_final_when_its_best_rate_is_inside(rates):
    assert rates.selection_grid(GRID, {1e-5: 0.4, 3e-5: 0.5}, 3) == (GRID, False)  # 9e-5 not finished
    assert rates.selection_grid(GRID, {1e-5: 0.4, 3e-5: 0.5, 9e-5: 0.45}, 3) == (GRID, True)


def test_a_best_rate_at_an_end_adds_the_next_rate_past_it_at_the_grid_s_factor(rates):
    means = {1e-5: 0.40, 3e-5: 0.45, 9e-5: 0.50}
    assert rates.selection_grid(GRID, means, 3) == ([1e-5, 3e-5, 9e-5, 2.7e-4], False)  # 9e-5 × 3
    means[2.7e-4] = 0.55  # better again: one more
    assert rates.selection_grid(GRID, means, 3) == ([1e-5, 3e-5, 9e-5, 2.7e-4, 8.1e-4], False)
    means[8.1e-4] = 0.30  # worse: 2.7e-4 has a neighbour on both sides
    assert rates.selection_grid(GRID, means, 3) == ([1e-5, 3e-5, 9e-5, 2.7e-4, 8.1e-4], True)
    low = {1e-5: 0.6, 3e-5: 0.5, 9e-5: 0.4}
    assert rates.selection_grid(GRID, low, 3) == ([3.33e-6, 1e-5, 3e-5, 9e-5], False)  # 1e-5 / 3, 3 digits


def test_extensions_stop_at_their_limit_and_failed_rates_are_never_best(rates):
    rising = {1e-5: 0.1, 3e-5: 0.2, 9e-5: 0.3, 2.7e-4: 0.4}
    assert rates.selection_grid(GRID, rising, 1) == ([1e-5, 3e-5, 9e-5, 2.7e-4], True)  # one allowed: final at an end
    assert rates.at_an_end(2.7e-4, [1e-5, 3e-5, 9e-5, 2.7e-4]) and not rates.at_an_end(3e-5, GRID)
    diverged = {1e-5: 0.4, 3e-5: 0.5, 9e-5: None}  # the highest rate failed: 3e-5 is inside what was tried
    assert rates.selection_grid(GRID, diverged, 3) == (GRID, True)
    assert rates.selection_grid(GRID, dict.fromkeys(GRID), 3) == (GRID, True)  # all failed: nowhere to go
    assert rates.selection_grid([3e-5], {}, 3) == ([3e-5], True)  # one rate: nothing to grow from
    assert rates.selection_grid(GRID, {}, 0) == (GRID, True)  # --extend 0: the grid as given


def test_only_a_log_grid_can_grow(rates):
    assert rates.log_factor([9e-5, 1e-5, 3e-5]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="not a log grid"):
        rates.log_factor([1e-5, 3e-5, 1e-4])


def test_a_selection_shard_runs_the_grown_grid_and_its_table_names_a_bracketed_rate(ranking, shapes_model,
                                                                                    tmp_path, monkeypatch):  # fmt: skip
    """A reward that peaks at 2.7e-4 (training rewards made up; no training): shard 0 alone selects, runs the three
    given rates, then 2.7e-4 and 8.1e-4, and gathers; the report shard then runs 2.7e-4."""
    peak = {1e-5: 0.40, 3e-5: 0.45, 9e-5: 0.50, 2.7e-4: 0.55, 8.1e-4: 0.30}
    ran = []

    def made_up(self, s, name, lr):
        ran.append((s, lr))
        return {"algorithm": name, "lr": lr, "seed": s, "base_model_sha256": self.model_hash(),
                "selection_reward": peak[lr], "process_cpu_seconds": 1.0, "wall_seconds": 1.0}  # fmt: skip

    monkeypatch.setattr(ranking.Benchmark, "run_one", made_up)
    argv = ["--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo", "--select-seeds", "0",
            "--lrs", "1e-5,3e-5,9e-5"]  # fmt: skip
    ranking.main(["--shard", "0", *argv])
    assert ran == [(0, 1e-5), (0, 3e-5), (0, 9e-5), (0, 2.7e-4), (0, 8.1e-4)]
    shard = json.loads((tmp_path / "shard_0.json").read_text())
    assert shard["phase"] == "select" and shard["settings"]["select_seeds"] == [0]
    ranking.main(["--shard", "1", *argv])
    assert ran[-1] == (1, 2.7e-4)  # a report shard: the chosen rate only
    picked = ranking.choices(ranking.load_shards(tmp_path))["flow_grpo"]
    assert picked["chosen_lr"] == 2.7e-4 and not picked["at_an_end"]


def test_pg_set_reaches_the_policy_gradient_configs_that_train_every_step_only(ranking, shapes_model, tmp_path):
    b = ranking.Benchmark(ranking.parse_args(["--plan", "--model", str(shapes_model), "--out-dir", str(tmp_path),
                                              "--only", "flow_grpo,awm,fast", "--pg-set", "sampling.window.kind=random",
                                              "--pg-set", "sampling.window.size=3"]))  # fmt: skip
    assert b.own_sets == {"flow_grpo": ["sampling.window.kind=random", "sampling.window.size=3"]}  # AWM: final
    assert b.settings["pg_set"] == b.own_sets["flow_grpo"]  # latents; Fast: its own window


def test_bad_selection_arguments_are_one_line(ranking, shapes_model, tmp_path, capsys):
    for argv, said in ((["--select-seeds", "a"], "--select-seeds a: give seeds as integers"),
                       (["--extend", "-1"], "--extend -1: give 0"),
                       (["--lrs", "1e-5,3e-5,1e-4"], "are not a log grid")):  # fmt: skip
        with pytest.raises(SystemExit):
            ranking.main(["--plan", "--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo",
                          *argv])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err


def test_a_run_s_guard_alerts_are_kept_and_said_under_the_table(ranking, load_benchmark, shapes_model, tmp_path):
    """run_for_flops keeps the guard's alert count and first alerting step (from guard/alerts_total); the table
    names the report seeds whose runs at the chosen rate raised alerts (a gain by reward hacking reads as such)."""
    table = load_benchmark("ranking_table")
    totals = iter([0.0, 2.0, 5.0])

    class Trainer:
        def train_step(self, step):
            return {"perf/flops_per_step": 1.0, "reward/mean": 0.5, "guard/alerts_total": next(totals)}

    point = lambda step, n: {"step": step, "val_reward": 0.5, "se": 0.0}  # noqa: E731
    record = ranking.run_for_flops(Trainer(), 3.0, point, point(0, 0), fractions=())
    assert (record["guard_alerts"], record["first_alert_step"]) == (5, 2)  # alerts first in the second step

    def run(name, seed, alerts):
        return {"algorithm": name, "config": f"configs/quickstart_{name}.yaml", "lr": 1e-5, "seed": seed,
                "selection_reward": 0.5, "curve": [{"fraction": 0.0, "val_reward": 0.4},
                                                   {"fraction": 1.0, "val_reward": 0.5}],
                "val_reward_end": 0.5, "guard_alerts": alerts, "first_alert_step": 7 if alerts else None}  # fmt: skip

    settings = {"select_seeds": [0], "val_fractions": []}
    kept = {"machine": {}, "cpu_seconds": 1.0, "wall_seconds": 1.0, "finished": "2026-11-29T00:00:00+00:00"}
    shards = [{"shard": s, "phase": "select" if s == 0 else "report", "settings": settings, **kept,
               "runs": [run("flow_grpo", s, 0), run("nft", s, 3 if s == 2 else 0)]} for s in (0, 1, 2)]  # fmt: skip
    lines = table.markdown(table.summarise(shards))
    assert lines[-1] == "Guard alerts, DiffusionNFT: seed 2: 3 from step 7." and lines[-2] == ""
    assert not any(line.startswith("Guard alerts, Flow-GRPO") for line in lines)


def test_a_plan_before_any_shard_is_timed_by_a_pilot_record_of_flow_grpo(ranking, load_benchmark, tmp_path):
    wallclock = load_benchmark("ranking_wallclock")  # after ranking.py, which puts benchmarks/ on the path
    curve = [{"step": 0, "images": 100, "seconds": 4.0}, {"step": 50, "images": 300, "seconds": 16.0}]
    run = {"seconds_per_step": 10.0, "flops_per_step": 1e11, "curve": curve}
    record = {"machine": {"load_average_after": [1.0, 1.0, 1.0]}, "algorithms": {"flow_grpo": run}}
    path = tmp_path / "pilot.json"
    path.write_text(json.dumps(record))
    measured = []
    # a budget of 100 steps × 10 s, and 50 validation images at (4 + 16) s / 400 images
    per_run, how = wallclock.pilot_seconds_per_run(path, 1e13, 50, lambda: measured.append(1) or [9e10, 2e11])
    assert per_run == pytest.approx(1000 + 50 * 0.05) and measured == [] and "10.0 s a step of 1e+11 FLOPs" in how
    del record["algorithms"]["flow_grpo"]["flops_per_step"]  # an older record: a step counted here instead
    path.write_text(json.dumps(record))
    per_run, _ = wallclock.pilot_seconds_per_run(path, 1e13, 50, lambda: measured.append(1) or [9e10, 2e11])
    assert per_run == pytest.approx(500 + 2.5) and measured == [1]


def test_an_algorithm_whose_every_selection_run_failed_is_left_out_of_the_report_shards(
        ranking, load_benchmark, shapes_model, tmp_path, monkeypatch):  # fmt: skip
    """NFT fails at every rate (e.g. a config that breaks at the recipe): once the selection shard is finished, the
    report shard runs Flow-GRPO at its rate and leaves NFT out, saying so, instead of waiting for a rate that can
    never be chosen; the plan and the table say it has none."""
    ran = []

    def made_up(self, s, name, lr):
        ran.append((s, name, lr))
        record = {"algorithm": name, "lr": lr, "seed": s, "base_model_sha256": self.model_hash(),
                  "process_cpu_seconds": 1.0, "wall_seconds": 1.0}  # fmt: skip
        if name == "nft":
            return {**record, "error": "RuntimeError: broken"}
        return {
            **record,
            "selection_reward": {1e-5: 0.4, 3e-5: 0.5, 9e-5: 0.45}.get(lr),
            "curve": [{"fraction": 0.0, "val_reward": 0.4}, {"fraction": 1.0, "val_reward": 0.5}],
            "val_reward_end": 0.5,
        }

    monkeypatch.setattr(ranking.Benchmark, "run_one", made_up)
    argv = ["--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo,nft", "--select-seeds",
            "0", "--lrs", "1e-5,3e-5,9e-5", "--shards", "2"]  # fmt: skip
    ranking.main(["--shard", "0", *argv])
    assert sorted(n for _, n, _ in ran) == ["flow_grpo"] * 3 + ["nft"] * 3  # NFT's grid: final, nothing to grow to
    ranking.main(["--shard", "1", *argv])
    assert ran[-1] == (1, "flow_grpo", 3e-5) and len(ran) == 7
    assert [r["algorithm"] for r in json.loads((tmp_path / "shard_1.json").read_text())["runs"]] == ["flow_grpo"]
    plan = ranking.Benchmark(ranking.parse_args(["--plan", *argv])).plan(2)
    assert "no rate: nft: every selection run failed (the report shards leave it out)" in plan
    table = load_benchmark("ranking_table")
    rows = table.markdown(table.summarise(table.load_shards(tmp_path)))
    assert rows[-1].startswith("| – | nft | | no rate: every selection run failed")
