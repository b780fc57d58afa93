"""The ranking at equal compute (benchmarks/ranking.py): the FLOP budget, shards that resume, the plan, the table."""

import json
import shutil
import socket

import pytest

SMALL = ["--set", "data.prompts_per_step=1", "--set", "data.group_size=2", "--set", "sampling.num_steps=3",
         "--set", "val.num_steps=2", "--val-n", "1", "--val-n-subset", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def table(load_benchmark):
    return load_benchmark("ranking_table")


def bench(ranking, model, out, *argv):
    return ranking.Benchmark(ranking.parse_args(["--shard", "0", "--model", str(model), "--out-dir", str(out),
                                                 *SMALL, *argv]))  # fmt: skip


def test_two_algorithms_given_the_same_budget_count_the_same_flops_within_one_step(ranking, shapes_model, tmp_path):
    from diffusion_rl.trainer import make_trainer

    b = bench(ranking, shapes_model, tmp_path, "--only", "flow_grpo,nft")
    budget = 2.5 * b.step_flops("flow_grpo", 1)[0]  # two and a half of Flow-GRPO's steps
    point = lambda step, n: {"step": step, "val_reward": float(n), "se": 0.0}  # noqa: E731 (reward: samples asked)
    results = {}
    for name in ("flow_grpo", "nft"):
        cfg = ranking.build_config(b.configs[name][0], tmp_path / name, b.namespace(0, []), b.model_dir, b.info)
        results[name] = ranking.run_for_flops(make_trainer(cfg), budget, point, point(0, 0), fractions=(0.5,))
    fg, nft = results["flow_grpo"], results["nft"]
    assert fg["steps"] == 3  # 2.5 steps' worth: the third step reaches it
    assert nft["flops_per_step"]["mean"] < fg["flops_per_step"]["mean"]  # no CFG: cheaper steps, more of them
    assert nft["steps"] > fg["steps"]
    for r in results.values():
        assert r["flops"] >= budget > r["flops"] - r["flops_per_step"]["last"]  # the first step that reaches it
        assert [c["val_reward"] for c in r["curve"]] == [0.0, 4.0, 14.0]  # base, the subset (4) past ½, full (14) end
        assert r["curve"][1]["fraction"] >= 0.5 and r["curve"][-1]["fraction"] >= 1.0
    assert abs(fg["flops"] - nft["flops"]) <= max(fg["flops_per_step"]["last"], nft["flops_per_step"]["last"])


def test_a_shard_resumes_its_kept_runs_and_refuses_other_settings(ranking, table, shapes_model, tmp_path, monkeypatch):
    argv = ["--shard", "0", "--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo,nft",
            "--lrs", "x1", "--budget-flops", "3e10", *SMALL]  # fmt: skip
    real, calls = ranking.Benchmark.run_one, []

    def interrupted(self, s, name, lr):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stopped in the shard's second run
        return real(self, s, name, lr)

    monkeypatch.setattr(ranking.Benchmark, "run_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ranking.main(argv)
    assert [p.name for p in (tmp_path / "runs/shard_0").glob("*_lr*.json")] == ["flow_grpo_lr3e-05.json"]
    kept = tmp_path / "runs/shard_0/flow_grpo_lr3e-05.json"
    record = json.loads(kept.read_text())
    kept.write_text(json.dumps({**record, "base_model_sha256": "another"}))
    with pytest.raises(SystemExit, match="made from another base model"):
        ranking.main(argv)
    kept.write_text(json.dumps(record))
    monkeypatch.setattr(ranking.Benchmark, "run_one", lambda self, s, name, lr: (calls.append(name), real(self, s,
                                                                                 name, lr))[1])  # fmt: skip
    ranking.main(argv)
    assert calls == ["flow_grpo", "nft", "nft"]  # resumed: the kept run did not run again
    shard = json.loads((tmp_path / "shard_0.json").read_text())
    assert not (tmp_path / "runs/shard_0").exists()
    assert [r["algorithm"] for r in shard["runs"]] == ["flow_grpo", "nft"]
    assert len(shard["base_validation"]) == 2  # NFT validates without CFG: its own base validation
    for r in shard["runs"]:
        assert r["flops"] >= 3e10 > r["flops"] - r["flops_per_step"]["last"]
        assert r["curve"][0]["shared"] and r["curve"][0]["images"] == r["curve"][-1]["images"] == 78
        assert r["curve"][0]["val_reward"] == shard["base_validation"][r["validation"]]["val_reward"]
        assert r["machine"]["cpu"] and r["machine"]["boot"] == ranking.boot_id()  # each run says where it ran
    assert shard["machine"]["cpu"] and isinstance(shard["machine"]["amx"], bool) and shard["cpu_seconds"] > 0
    assert len({r["base_model_sha256"] for r in shard["runs"]}) == 1
    with pytest.raises(SystemExit, match="budget_flops differ"):
        ranking.main(["4e10" if a == "3e10" else a for a in argv])
    with pytest.raises(SystemExit, match="finish the selection shards 0, 1 first"):
        ranking.main(["--shard", "2", *argv[2:]])
    rows = table.markdown(table.summarise(table.load_shards(tmp_path)))
    assert "rate not chosen yet" in rows[-1]  # one selection shard of two: no rate, no rank


def test_the_plan_lists_the_shards_their_runs_and_compute(ranking, shapes_model, tmp_path, capsys):
    (tmp_path / "runs/shard_0").mkdir(parents=True)
    (tmp_path / "runs/shard_0/flow_grpo_lr1e-05.claim").write_text("box pid 5\n")  # held by a process
    ranking.main(["--plan", "--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo,dpo_offline",
                  "--shards", "3"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("budget per run: 1.99e+13 FLOPs") and "2028 images" in lines[0]  # 3 × 312 + 1,092
    assert "shard 0 (select, seed 0): 3 runs, 3 to do, 5.97e+13 training FLOPs, 6084 validation images" in lines
    assert "shard 2 (report, seed 2): 1 runs, 1 to do, 1.99e+13 training FLOPs, 2028 validation images" in lines
    assert sum("lr chosen on shards 0+1" in line for line in lines) == 1
    assert "  flow_grpo      lr 1e-05                  running (box pid 5)" in lines
    assert any(line.startswith("skipped: dpo_offline: a pair dataset config") for line in lines)
    assert lines[-1] == "7 runs to do: 1.393e+14 training FLOPs"
    assert not (tmp_path / "settings.json").exists()  # a plan writes nothing
    finished = {**shard(6, [run("flow_grpo", 1e-5, 6, 0.4, [(1.0, 0.4)])] * 4), "cpu_seconds": 2400.0}
    (tmp_path / "shard_6.json").write_text(json.dumps(finished))  # a finished shard: 600 CPU-s per run
    ranking.main(["--plan", "--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo",
                  "--shards", "3"])  # fmt: skip
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  about 1.2 CPU-hours at the finished shards' 600 CPU-s per run (4 runs on AMD EPYC; one process per core)"
    )  # 7 runs × 600 s


def test_the_budget_is_flow_grpo_s_quiet_three_minutes(ranking):
    assert ranking.BUDGET_FLOPS == 186 * 106_983_550_976 == pytest.approx(1.98989e13, rel=1e-5)


def test_parse_lrs_and_the_rate_is_chosen_on_training_reward_never_validation(ranking, table):
    assert ranking.parse_lrs("/3,x1,x3", 3e-5) == [1e-5, 3e-5, 9e-5]
    assert ranking.parse_lrs("x1,2e-4", 1e-3) == [1e-3, 2e-4]
    by_lr = {  # 1e-4 trains better, 1e-5 validates better: the choice reads training reward only
        1e-5: [{"selection_reward": 0.40, "val_reward_end": 0.9}, {"selection_reward": 0.42, "val_reward_end": 0.9}],
        1e-4: [{"selection_reward": 0.50, "val_reward_end": 0.1}, {"selection_reward": 0.46, "val_reward_end": 0.1}],
        1e-3: [{"error": "diverged"}],
    }
    chosen, means = table.choose_lr(by_lr)
    assert chosen == 1e-4
    assert means == {"1e-05": pytest.approx(0.41), "0.0001": pytest.approx(0.48), "0.001": None}


def test_a_config_that_keeps_its_lora_adapters_lays_its_grid_around_its_own_rate(ranking, shapes_model, tmp_path):
    """The task fine-tunes every weight at --set train.lr; TDM-R1 keeps its LoRA adapters (it refuses full
    fine-tuning), whose rate (its config's 1e-2) sits far above: its grid is laid around that one."""
    from diffusion_rl.config import load

    b = bench(ranking, shapes_model, tmp_path, "--only", "flow_grpo,tdm_r1", "--lrs", "/3,x1,x3", "--set",
              "train.lr=1e-4")  # fmt: skip
    assert b.configs["flow_grpo"][1] == pytest.approx([3.33e-5, 1e-4, 3e-4], rel=2e-3)
    own = load(str(b.configs["tdm_r1"][0])).train.lr
    assert own == 1e-2 and b.configs["tdm_r1"][1] == pytest.approx([own / 3, own, own * 3], rel=2e-3)


def run(name, lr, seed, selection, curve):
    config = "configs/quickstart_flow_grpo.yaml" if name == "flow_grpo" else f"configs/quickstart_{name}.yaml"
    return {"algorithm": name, "config": config, "lr": lr, "seed": seed, "selection_reward": selection,
            "curve": [{"fraction": f, "val_reward": v} for f, v in curve], "val_reward_end": curve[-1][1]}  # fmt: skip


def shard(s, runs):
    settings = {"select_seeds": [0, 1], "val_fractions": [0.5], "budget_flops": 1.0}
    return {"shard": s, "phase": "select" if s < 2 else "report", "settings": settings, "runs": runs,
            "machine": {"cpu": "AMD EPYC", "amx": False, "cpus": 2}, "cpu_seconds": 3600.0, "wall_seconds": 1.0,
            "finished": "2026-11-26T10:00:00+00:00"}  # fmt: skip


def test_the_table_from_shard_files_by_hand(table, tmp_path):
    """Flow-GRPO chooses 3e-5, NFT 1e-5 (training reward on shards 0, 1); finals over the report seeds 2–4:
    Flow-GRPO 0.50, 0.60, 0.55, NFT 0.55, 0.62, 0.60: paired differences 0.05, 0.02, 0.05 → +0.04 ± 4.3027 · 0.01.
    The selection shards' runs at the chosen rates (here far off: 0.9 and 0.1) are not in the statistics."""
    fg = {2: (0.40, 0.45, 0.50), 3: (0.40, 0.50, 0.60), 4: (0.40, 0.50, 0.55)}  # base, ½ budget, end
    nft = {2: (0.40, 0.50, 0.55), 3: (0.40, 0.56, 0.62), 4: (0.40, 0.54, 0.60)}
    fg[0] = fg[1] = (0.4, 0.9, 0.9)
    nft[0] = nft[1] = (0.4, 0.1, 0.1)
    grid = (0.0, 0.5, 1.01)  # the end overshoots the budget by part of a step

    def runs(s):
        out = [
            run("flow_grpo", 3e-5, s, 0.5, list(zip(grid, fg[s]))),
            run("nft", 1e-5, s, 0.6, list(zip(grid, nft[s]))),
        ]
        if s < 2:  # the selection shards also ran the other rates, which lose on training reward
            out += [run("flow_grpo", 1e-5, s, 0.3, list(zip(grid, (0.4, 0.9, 0.9)))),
                    {"algorithm": "nft", "lr": 3e-5, "seed": s, "error": "RuntimeError: diverged"}]  # fmt: skip
        return out

    for s in range(5):
        (tmp_path / f"shard_{s}.json").write_text(json.dumps(shard(s, runs(s))))
    (tmp_path / "wallclock.json").write_text(json.dumps({"seconds_per_flop_vs_flow_grpo": {"flow_grpo": 1.0,
                                                                                          "nft": 2.0}}))  # fmt: skip
    summary = table.write_table(tmp_path)
    a = summary["algorithms"]
    assert (a["flow_grpo"]["chosen_lr"], a["nft"]["chosen_lr"]) == (3e-5, 1e-5)
    assert a["nft"]["final_val_reward"] == [0.55, 0.62, 0.60] and a["nft"]["seeds"] == [2, 3, 4]
    d = a["nft"]["paired_vs_flow_grpo"]
    assert (d["mean"], d["half_width"]) == (pytest.approx(0.04), pytest.approx(0.043027, abs=1e-5))
    assert a["flow_grpo"]["paired_vs_flow_grpo"]["mean"] == 0.0
    # NFT's mean curve: 0.4, 0.53333 at ½, 0.59 at the end (at 1.01 of the budget: the end counts as the budget).
    # Flow-GRPO's final mean 0.55 is reached at 0.5 + (0.55 − 0.53333) / (0.59 − 0.53333) · 0.5 = 0.64706
    assert a["nft"]["band"][2]["mean"] == pytest.approx(0.59)
    assert a["nft"]["compute_to_match"]["value"] == pytest.approx(0.5 + (0.55 - 0.5333333) / (0.59 - 0.5333333) / 2)
    # twice Flow-GRPO's seconds per FLOP: at its wall-clock NFT has half the budget, its mean there 0.53333
    assert a["nft"]["equal_wallclock"]["mean"] == pytest.approx(0.5333333)
    assert (a["nft"]["rank"]["best_rank"], a["nft"]["rank"]["worst_rank"]) == (1, 2)  # 0.04 ± 0.043: not separated
    assert a["nft"]["failed"] == []  # the diverged 3e-5 run is not at NFT's chosen rate
    rows = table.markdown(summary)
    assert rows[2].startswith("| 1–2 | DiffusionNFT | 1e-05 (an end of its grid) | 0.5900 ± ")  # the lowest rate
    assert "+0.0400 ± 0.0430" in rows[2]
    assert "| 0.65 (" in rows[2] and (tmp_path / "ranking.png").stat().st_size > 1000
    assert "| 3 | 1.00 (1.00–1.00) |" in rows[3]  # Flow-GRPO reaches its own final mean at the budget, every seed
    (tmp_path / "shard_4.json").write_text(json.dumps({**shard(4, runs(4)), "settings": {"other": 1}}))
    with pytest.raises(SystemExit, match="other settings"):
        table.load_shards(tmp_path)


def test_the_wallclock_ratio_runs_the_algorithms_in_turns(ranking, shapes_model, tmp_path):
    b = bench(ranking, shapes_model, tmp_path, "--only", "flow_grpo,nft")
    from ranking_wallclock import measure

    result = measure(b, rounds=2, steps_per_turn=1)
    assert result["seconds_per_flop_vs_flow_grpo"]["flow_grpo"] == 1.0
    assert result["seconds_per_flop_vs_flow_grpo"]["nft"] > 0
    assert [t["steps"] for t in result["totals"].values()] == [2, 2]
    assert json.loads((tmp_path / "wallclock.json").read_text())["rounds"] == 2


def test_processes_sharing_a_shard_take_the_runs_nobody_holds(ranking, tmp_path, monkeypatch):
    import os
    import socket
    import subprocess
    import sys

    here = socket.gethostname()
    path = tmp_path / "runs/shard_1/nft_lr1e-05.claim"
    assert ranking.claim(path) is None  # taken: this process holds it now
    me = f"{here} pid {os.getpid()} boot {ranking.boot_id()}"
    assert path.read_text() == me + "\n"
    assert ranking.claim(path) == me  # a second taker (even this process) is refused
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(f"{here} pid {ended.stdout.strip()} boot {ranking.boot_id()}\n")  # its process is gone:
    assert ranking.claim(path) is None and path.read_text() == me + "\n"  # the run is taken over
    path.write_text(f"{here} pid {os.getpid()} boot 0ld-b00t\n")  # a live pid, but from before a restart
    assert ranking.claim(path) is None and path.read_text() == me + "\n"
    path.write_text("another-machine pid 1\n")  # another machine's claim: respected, its process cannot be seen
    assert ranking.claim(path) == "another-machine pid 1"
    path.write_text("")  # a claim being written this instant
    assert ranking.claim(path) == "a process starting"


def test_a_shard_leaves_runs_held_by_another_process_and_the_last_one_gathers(ranking, shapes_model, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    argv = ["--shard", "0", "--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo,nft",
            "--lrs", "x1", "--budget-flops", "3e10", *SMALL]  # fmt: skip
    fake = {"flops": 3e10, "curve": [], "base_model_sha256": None}
    calls = []
    monkeypatch.setattr(ranking.Benchmark, "run_one", lambda self, s, name, lr: (calls.append(name),
                        {**fake, "algorithm": name, "lr": lr, "base_model_sha256": self.model_hash(),
                         "process_cpu_seconds": 1.0, "wall_seconds": 1.0})[1])  # fmt: skip
    held = tmp_path / "runs/shard_0/nft_lr3e-05.claim"
    held.parent.mkdir(parents=True)
    held.write_text("another-machine pid 1\n")
    with pytest.raises(SystemExit, match="nft lr 3e-05 still running in another process"):
        ranking.main(argv)
    assert calls == ["flow_grpo"] and not (tmp_path / "shard_0.json").exists()
    held.unlink()  # that process ended, its run kept:
    ranking.write_json(held.with_suffix(".json"), {**fake, "algorithm": "nft", "lr": 3e-5, "process_cpu_seconds": 1.0,
                       "wall_seconds": 1.0, "base_model_sha256": json.loads((tmp_path / "runs/shard_0/"
                       "flow_grpo_lr3e-05.json").read_text())["base_model_sha256"]})  # fmt: skip
    ranking.main(argv)  # nothing left to run: this process gathers
    assert calls == ["flow_grpo"]
    assert [r["algorithm"] for r in json.loads((tmp_path / "shard_0.json").read_text())["runs"]] == ["flow_grpo", "nft"]


def test_a_run_or_base_validation_kept_by_its_holder_just_before_this_process_claims_it_is_not_redone(
        ranking, shapes_model, tmp_path, monkeypatch):  # fmt: skip
    """The other process keeps its result and drops its claim between this one's look for the result and its claim:
    the claim succeeds, and the result is there."""
    benchmark = bench(ranking, shapes_model, tmp_path, "--only", "flow_grpo")
    real = ranking.claim

    def kept_meanwhile(path):  # the holder writes its result, then lets go of the claim
        ranking.write_json(path.with_suffix(".json"), {"theirs": True})
        return real(path)

    monkeypatch.setattr(ranking, "claim", kept_meanwhile)
    monkeypatch.setattr(ranking.Benchmark, "run_one", lambda *a: pytest.fail("a kept run ran again"))
    benchmark.run_kept(0, "flow_grpo", 3e-5)
    run = tmp_path / "runs/shard_0/flow_grpo_lr3e-05"
    assert (
        json.loads(run.with_suffix(".json").read_text()) == {"theirs": True} and not run.with_suffix(".claim").exists()
    )
    assert benchmark.base_validation(0, "k", lambda *a: pytest.fail("measured again")) == {"theirs": True}
    assert not (tmp_path / "runs/shard_0/base_k.claim").exists()


def test_a_shard_gathered_by_another_process_just_before_this_one_claims_it_stops_cleanly(
        ranking, shapes_model, tmp_path, monkeypatch):  # fmt: skip
    argv = ["--shard", "0", "--model", str(shapes_model), "--out-dir", str(tmp_path), "--only", "flow_grpo",
            "--lrs", "x1", "--budget-flops", "3e10", *SMALL]  # fmt: skip
    monkeypatch.setattr(ranking.Benchmark, "run_one", lambda self, s, name, lr: {
        "algorithm": name, "lr": lr, "base_model_sha256": self.model_hash(), "process_cpu_seconds": 1.0,
        "wall_seconds": 1.0})  # fmt: skip
    real = ranking.claim

    def gathered_meanwhile(path):  # the other process writes the shard file and removes the kept runs, claim and all
        if path.name == "gather.claim":
            (tmp_path / "shard_0.json").write_text("{}")
            shutil.rmtree(path.parent)
        return real(path)

    monkeypatch.setattr(ranking, "claim", gathered_meanwhile)
    with pytest.raises(SystemExit, match="shard 0 is finished"):
        ranking.main(argv)
    assert (tmp_path / "shard_0.json").read_text() == "{}" and not (tmp_path / "runs/shard_0").exists()


def test_settings_that_differ_by_a_key_left_out_name_it(ranking, tmp_path, monkeypatch):
    monkeypatch.setattr(ranking, "ensure_base_model", lambda *a: {})
    argv = ["--shard", "0", "--model", str(tmp_path / "none"), "--out-dir", str(tmp_path), "--only", "flow_grpo"]
    ranking.Benchmark(ranking.parse_args([*argv, "--shape-weight", "0.5"]))  # writes settings.json with shape_weight
    with pytest.raises(SystemExit, match=r"\(shape_weight differ"):
        ranking.Benchmark(ranking.parse_args(argv))  # --shape-weight forgotten


def test_a_process_sharing_a_shard_waits_for_the_base_validation_another_is_measuring(ranking, shapes_model, tmp_path,
                                                                                         monkeypatch):  # fmt: skip
    import threading

    monkeypatch.setattr(ranking, "CLAIM_POLL_S", 0.01)
    benchmark = bench(ranking, shapes_model, tmp_path, "--only", "flow_grpo")
    measured = []

    def point(step, n):
        measured.append(n)
        return {"val_reward": 0.5, "n": n}

    path = tmp_path / "runs/shard_0/base_k.json"
    path.parent.mkdir(parents=True)
    path.with_suffix(".claim").write_text("another-machine pid 1\n")  # another process is measuring it
    theirs = {"val_reward": 0.25, "base_model_sha256": "theirs"}
    writer = threading.Timer(0.2, lambda: ranking.write_json(path, theirs))
    writer.start()
    assert benchmark.base_validation(0, "k", point) == theirs and measured == []  # waited, measured nothing
    writer.join()

    path.unlink()
    path.with_suffix(".claim").write_text(f"{socket.gethostname()} pid 999999999 boot {ranking.boot_id()}\n")
    mine = benchmark.base_validation(0, "k", point)  # that process ended without it: this one measures it
    assert measured == [benchmark.args.val_n] and mine["val_reward"] == 0.5
    assert json.loads(path.read_text()) == mine and not path.with_suffix(".claim").exists()
    assert benchmark.base_validation(0, "k", point) == mine and len(measured) == 1  # kept: measured once


def test_an_algorithm_is_named_as_its_config_s_first_line_says(load_benchmark, tmp_path):
    learning = load_benchmark("learning")
    configs = learning.algorithm_configs(None)
    assert learning.algorithm_title(configs["flow_grpo"]) == "Flow-GRPO"  # "# Quickstart: Flow-GRPO on the tiny …"
    assert learning.algorithm_title(configs["nft"]) == "DiffusionNFT"
    assert learning.algorithm_title(configs["pairwise"]) == "Pref-GRPO"
    (tmp_path / "mine.yaml").write_text("# my own recipe\nalgorithm: {}\n")
    assert learning.algorithm_title(tmp_path / "mine.yaml") == "mine"  # no name in it: the file's


def test_equal_wallclock_past_the_budget_reads_the_final_point(table):
    """An algorithm 0.8 × Flow-GRPO's seconds per FLOP gets 1.25 budgets in Flow-GRPO's wall-clock: beyond the
    measured curve, so the row gives its reward at the budget (mean of 0.55, 0.62, 0.60), marked so."""
    grid = [0.0, 0.5, 1.01]
    curves = {2: [0.40, 0.50, 0.55], 3: [0.40, 0.56, 0.62], 4: [0.40, 0.54, 0.60]}
    past = table.at_equal_wallclock(curves, grid, 0.8)
    assert past["past_budget"] and past["fraction"] == pytest.approx(1.25)
    assert past["mean"] == pytest.approx(0.59) and past["half_width"] > 0
    inside = table.at_equal_wallclock(curves, grid, 2.0)  # half the budget: the mean curve at ½, 0.53333
    assert "past_budget" not in inside and inside["mean"] == pytest.approx(0.5333333)


def test_a_shards_machines_come_from_its_runs_where_they_say(table):
    epyc, xeon = {"cpu": "AMD EPYC", "cpus": 2, "amx": False}, {"cpu": "Intel Xeon", "cpus": 2, "amx": True}
    runs = [{"machine": {**epyc, "boot": "a"}}, {"machine": {**xeon, "boot": "b"}}, {"machine": {**epyc, "boot": "a"}}]
    said = table.shard_machines({"machine": epyc, "runs": [*runs, {}]})
    assert said == "AMD EPYC, 2 CPUs, AMX no / Intel Xeon, 2 CPUs, AMX yes (3 of 4 runs say so; 2 machine start(s))"
    gathered = table.shard_machines({"machine": xeon, "runs": [{}]})  # runs recorded before they said
    assert gathered == "Intel Xeon, 2 CPUs, AMX yes (the machine that gathered it)"


def test_the_table_replaces_the_one_written_before(table):
    """--append-results adds the table once, then replaces it in place: the text around it stays as it was."""
    first = "\n".join([table.TABLE_START, "| old |", table.TABLE_END])
    second = "\n".join([table.TABLE_START, "| new |", table.TABLE_END])
    once = table.with_table("# Results\n\n## Ranking\n", first)
    assert once == f"# Results\n\n## Ranking\n\n{first}\n"
    edited = once.replace("## Ranking\n", "## Ranking\nText above.\n") + "## Later\n"
    assert table.with_table(edited, second) == f"# Results\n\n## Ranking\nText above.\n\n{second}\n## Later\n"


def one_line_exit(capsys, run) -> str:
    with pytest.raises(SystemExit) as stopped:
        run()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("shard", "said"),
    [("-1", "--shard -1: the shards are 0 to 6 (--shards 7"), ("99", "--shard 99: the shards are 0 to 6"),
     ("1e11", "argument --shard: invalid int value: '1e11'")],
)  # fmt: skip
def test_a_shard_that_is_not_one_is_one_line_before_any_work(ranking, tmp_path, capsys, shard, said):
    assert said in one_line_exit(capsys, lambda: ranking.main(["--shard", shard, "--out-dir", str(tmp_path)]))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("settings", ["", "{not json", "[1, 2]"])
def test_an_empty_or_broken_settings_file_is_one_line_before_any_work(ranking, tmp_path, capsys, monkeypatch,
                                                                      settings):  # fmt: skip
    (tmp_path / "settings.json").write_text(settings)
    monkeypatch.setattr(ranking, "ensure_base_model", lambda *a: pytest.fail("the base model was made"))
    argv = ["--shard", "0", "--model", str(tmp_path / "none"), "--out-dir", str(tmp_path), "--only", "flow_grpo"]
    err = one_line_exit(capsys, lambda: ranking.main(argv))
    assert f"{tmp_path / 'settings.json'} is empty or not the settings of the runs in {tmp_path}" in err


def test_a_model_folder_of_other_files_is_not_written_into(ranking, tmp_path, capsys):
    model = tmp_path / "mine"
    model.mkdir()
    (model / "notes.txt").write_text("mine")
    argv = ["--shard", "0", "--model", str(model), "--out-dir", str(tmp_path / "out"), "--only", "flow_grpo"]
    err = one_line_exit(capsys, lambda: ranking.main(argv))
    assert f"ranking.py: error: --model {model} holds files and no ShapesWorld model (shapes.json)" in err
    assert [p.name for p in model.iterdir()] == ["notes.txt"]
