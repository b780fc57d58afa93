"""The ranking's table, recomputed from whatever shard files exist (benchmarks/ranking.py --table).

Per algorithm, at its chosen learning rate (benchmarks/ranking.py: chosen on the selection shards' training reward),
over the report shards' seeds only (the selection shards' runs chose the rate, so they would lean the estimate its
way): each seed's final validation reward; their mean ± 95 % interval; the paired difference from Flow-GRPO over the
seeds both have (same seeds, prompts and validation images) and a rank from paired comparisons (a range where they
do not separate: ranking_stats.rank_paired); the compute at which its mean validation curve first reaches
Flow-GRPO's final mean, as a fraction of the budget, with a paired bootstrap interval over seeds; and, where a
wall-clock ratio was measured (ranking_wallclock.py), the reward at Flow-GRPO's wall-clock: the curve read at
budget / ratio.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import ROOT, algorithm_title, write_json  # noqa: E402
from ranking_rates import at_an_end  # noqa: E402
from ranking_stats import band, compute_to_match, interval, paired_difference, rank_label, rank_paired  # noqa: E402

REFERENCE = "flow_grpo"


def load_shards(out: Path) -> list[dict]:
    """The shard files under `out`, in shard order; every one must have been made with the same settings."""
    shards = [json.loads(p.read_text()) for p in sorted(out.glob("shard_*.json"), key=lambda p: int(p.stem[6:]))]
    for shard in shards[1:]:
        if shard["settings"] != shards[0]["settings"]:
            sys.exit(f"{out}/shard_{shard['shard']}.json was made with other settings than shard_{shards[0]['shard']}"
                     ".json: they cannot be pooled")  # fmt: skip
    return shards


def choose_lr(by_lr: dict[float, list[dict]]) -> tuple[float | None, dict[str, float | None]]:
    """The rate whose runs have the highest mean selection_reward (training reward over each run's last third;
    validation is never read), and each rate's mean. Rates without a finished run are not candidates."""
    means = {}
    for lr, runs in by_lr.items():
        values = [r["selection_reward"] for r in runs if r.get("selection_reward") is not None]
        means[f"{lr:.3g}"] = sum(values) / len(values) if values else None
    candidates = [lr for lr in by_lr if means[f"{lr:.3g}"] is not None]
    return (max(candidates, key=lambda lr: means[f"{lr:.3g}"]) if candidates else None), means


def choices(shards: list[dict]) -> dict[str, dict]:
    """algorithm → {chosen_lr, selection_reward_by_lr, at_an_end, no_rate} from the selection shards (chosen_lr None
    until all exist; at_an_end: the chosen rate is the lowest or highest one tried, so the grid did not bracket it;
    no_rate: they all exist and every run of the algorithm failed, so it has no rate and no report run)."""
    select = shards[0]["settings"]["select_seeds"] if shards else []
    done = [s for s in shards if s["shard"] in select]
    runs = [r for s in done for r in s["runs"]]
    out = {}
    for name in sorted({r["algorithm"] for r in runs}):
        by_lr = {}
        for r in runs:
            if r["algorithm"] == name:
                by_lr.setdefault(r["lr"], []).append(r)
        chosen, means = choose_lr(by_lr)
        finished = len(done) == len(select)
        chosen = chosen if finished else None
        out[name] = {"chosen_lr": chosen, "selection_reward_by_lr": means, "at_an_end": at_an_end(chosen, list(by_lr)),
                     "no_rate": finished and chosen is None}  # fmt: skip
    return out


def grid_of(shards: list[dict]) -> list[float]:
    return [0.0, *shards[0]["settings"]["val_fractions"], 1.0]


def on_grid(run: dict, grid: list[float]) -> list[float]:
    """A run's validation curve (x: fraction of the budget) interpolated linearly at the grid's fractions. The last
    point, the end of the run, is at the budget: its overshoot of less than one step counts as the budget (else a
    run would read below its own final reward at 1)."""
    xs = [c["fraction"] for c in run["curve"][:-1]] + [grid[-1]]
    return np.interp(grid, xs, [c["val_reward"] for c in run["curve"]]).tolist()


def summarise(shards: list[dict], wallclock: dict | None = None) -> dict:
    """The table's numbers: per algorithm its seeds' finals and curves at its chosen rate, and the statistics."""
    chosen = choices(shards)
    grid = grid_of(shards) if shards else []
    finals, curves, failed, alerted = {}, {}, {}, {}
    titles = {r["algorithm"]: algorithm_title(ROOT / r["config"]) for s in shards for r in s["runs"] if "config" in r}
    for shard in shards:
        if shard["phase"] != "report":  # the selection shards chose the rates: their runs would bias the estimate
            continue
        for r in shard["runs"]:
            name = r["algorithm"]
            if chosen.get(name, {}).get("chosen_lr") != r["lr"]:
                continue
            if "error" in r:
                failed.setdefault(name, []).append({"seed": r["seed"], "error": r["error"]})
                continue
            finals.setdefault(name, {})[r["seed"]] = r["val_reward_end"]
            if r.get("guard_alerts"):
                alerted.setdefault(name, []).append({"seed": r["seed"], "alerts": r["guard_alerts"],
                                                     "first_step": r.get("first_alert_step")})  # fmt: skip
            curves.setdefault(name, {})[r["seed"]] = on_grid(r, grid)
    ranks = rank_paired(finals)
    reference = finals.get(REFERENCE, {})
    ratios = (wallclock or {}).get("seconds_per_flop_vs_flow_grpo", {})
    algorithms = {}
    for name in sorted(chosen):
        seeds = finals.get(name, {})
        result = {"title": titles.get(name, name), **chosen[name], "seeds": sorted(seeds),
                  "final_val_reward": [seeds[s] for s in sorted(seeds)], "interval": interval(list(seeds.values())),
                  "failed": failed.get(name, []), "guard_alerted": alerted.get(name, [])}  # fmt: skip
        if seeds:
            ys = [curves[name][s] for s in sorted(seeds)]
            result["band"] = [{"fraction": x, **interval([y[i] for y in ys])} for i, x in enumerate(grid)]
            result["paired_vs_flow_grpo"] = paired_difference(seeds, reference)
            result["compute_to_match"] = compute_to_match(curves[name], reference, grid)
            result["rank"] = ranks[name]
            if name in ratios:
                result["equal_wallclock"] = at_equal_wallclock(curves[name], grid, ratios[name])
        algorithms[name] = result
    kept = ("shard", "phase", "machine", "cpu_seconds", "wall_seconds", "finished")
    return {"grid": grid, "algorithms": algorithms, "wallclock": wallclock,
            "shards": [{k: s[k] for k in kept} for s in shards]}  # fmt: skip


def at_equal_wallclock(curves: dict[int, list[float]], grid: list[float], ratio: float) -> dict:
    """The reward after Flow-GRPO's wall-clock: an algorithm `ratio` × slower per FLOP gets budget / ratio of compute;
    its seeds' curves read there (interval over seeds). Past the budget (ratio < 1) the curve is not measured: the
    reward at the budget, marked `past_budget`."""
    fraction = 1.0 / ratio
    seeds = [list(zip(grid, ys)) for ys in curves.values()]
    if fraction > grid[-1]:
        return {"fraction": fraction, **band(seeds, [grid[-1]])[0], "past_budget": True}
    return {"fraction": fraction, **band(seeds, [fraction])[0]}


def markdown(summary: dict) -> list[str]:
    """The ranked table (by the paired difference from Flow-GRPO) and the algorithms that have no result yet."""
    algorithms = summary["algorithms"]
    lines = ["| rank | algorithm | lr | final val reward, mean ± 95 % CI | − Flow-GRPO, paired, mean ± 95 % CI | seeds "
             "| compute to reach Flow-GRPO's final (× budget, 95 % CI) | reward at Flow-GRPO's wall-clock |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def pm(iv: dict, signed: bool = False) -> str:
        if iv.get("mean") is None:
            return "–"
        mean = f"{iv['mean']:+.4f}" if signed else f"{iv['mean']:.4f}"
        return mean if iv.get("half_width") is None else f"{mean} ± {iv['half_width']:.4f}"

    ranked = sorted((n for n, a in algorithms.items() if "rank" in a), key=lambda n: algorithms[n]["rank"]["rank"])
    for name in ranked:
        a = algorithms[name]
        c = a["compute_to_match"]
        match = "not reached" if c["value"] is None else f"{c['value']:.2f}"
        if c.get("low") is not None:
            match += f" ({c['low']:.2f}–{c['high']:.2f})".replace("inf", "∞")
        wall = a.get("equal_wallclock")
        if wall is None:
            wall = "not measured"
        elif wall.get("past_budget"):  # as fast per FLOP or faster: the curve ends before Flow-GRPO's wall-clock
            wall = f"{pm(wall)} at the budget (its wall-clock buys {wall['fraction']:.2f}×)"
        else:
            wall = pm(wall)
        paired = pm(a["paired_vs_flow_grpo"], signed=True)
        seeds = str(a["interval"]["n"]) + (f" ({len(a['failed'])} failed)" if a["failed"] else "")
        rate = f"{a['chosen_lr']:.3g}" + (" (an end of its grid)" if a.get("at_an_end") else "")
        lines.append(f"| {rank_label(a['rank'])} | {a['title']} | {rate} | {pm(a['interval'])} | "
                     f"{paired} | {seeds} | {match} | {wall} |")  # fmt: skip
    for name, a in algorithms.items():
        if name not in ranked:
            state = (
                "no rate: every selection run failed"
                if a.get("no_rate")
                else ("rate not chosen yet" if a["chosen_lr"] is None else "no finished run at its rate")
            )
            tried = ", ".join(f"{lr}: {v:.4f}" for lr, v in a["selection_reward_by_lr"].items() if v is not None)
            lines.append(f"| – | {a['title']} | | {state} (training reward by rate so far: {tried or '–'}) | | | | |")
    alerted = [name for name in ranked if algorithms[name].get("guard_alerted")]
    if alerted:  # a gain the guard flags may be reward hacking: said under the table, per seed
        lines.append("")
    for name in alerted:
        runs = algorithms[name]["guard_alerted"]
        seeds = ", ".join(f"seed {r['seed']}: {r['alerts']} from step {r['first_step']}" for r in runs)
        lines.append(f"Guard alerts, {algorithms[name]['title']}: {seeds}.")
    return lines


def plot(summary: dict, out_png: Path) -> None:
    """One panel per algorithm, in rank order: its validation curve against compute (the mean over seeds and its 95 %
    band) over Flow-GRPO's mean (dashed), on one y scale: twelve bands in one axes hide each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    algorithms = summary["algorithms"]
    shown = sorted((n for n, a in algorithms.items() if a.get("band")), key=lambda n: algorithms[n]["rank"]["rank"])
    if not shown:
        return
    cols = min(4, len(shown))
    rows = -(-len(shown) // cols)
    fig = Figure(figsize=(3.2 * cols, 2.5 * rows + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    reference = algorithms.get(REFERENCE, {}).get("band")
    for ax, name in zip(axes, shown):
        a, points = algorithms[name], algorithms[name]["band"]
        xs = [p["fraction"] for p in points]
        if reference and name != REFERENCE:
            ax.plot([p["fraction"] for p in reference], [p["mean"] for p in reference], "--", color="0.5", lw=1,
                    label=f"{algorithms[REFERENCE]['title']}'s mean")  # fmt: skip
        ax.plot(xs, [p["mean"] for p in points], marker="o", markersize=3, color="C0")
        if all(p["low"] is not None for p in points):
            ax.fill_between(xs, [p["low"] for p in points], [p["high"] for p in points], color="C0", alpha=0.2)
        n = len(a["seeds"])
        about = f"rank {rank_label(a['rank'])}, lr {a['chosen_lr']:.3g}, {n} seed{'' if n == 1 else 's'}"
        ax.set_title(f"{a['title']}\n{about}", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    for ax in axes[(rows - 1) * cols :]:
        ax.set_xlabel("compute (× budget)", fontsize=8)
    for ax in axes[::cols]:
        ax.set_ylabel("validation shapes_geneval", fontsize=8)
    handles, labels = next((ax.get_legend_handles_labels() for ax, n in zip(axes, shown) if n != REFERENCE), ([], []))
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle("ShapesWorld, held-out prompts: the mean validation reward over seeds and its 95 % band, each\n"
                 "algorithm at its chosen lr; compute as a fraction of the budget (Flow-GRPO's 3 quiet minutes)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


def shard_machines(shard: dict) -> str:
    """The machines a shard's runs ran on: each run's (CPU, cores, AMX; machine starts by boot id) where its record
    says, else the machine that gathered the shard."""
    recorded = [r["machine"] for r in shard["runs"] if r.get("machine")]
    kinds = sorted({f"{m['cpu']}, {m['cpus']} CPUs, AMX {'yes' if m['amx'] else 'no'}"
                    for m in recorded or [shard["machine"]]})  # fmt: skip
    if not recorded:
        return " / ".join(kinds) + " (the machine that gathered it)"
    starts = len({m.get("boot") for m in recorded})
    return " / ".join(kinds) + f" ({len(recorded)} of {len(shard['runs'])} runs say so; {starts} machine start(s))"


TABLE_START, TABLE_END = "<!-- ranking table: benchmarks/ranking_table.py -->", "<!-- end of the ranking table -->"


def with_table(text: str, block: str) -> str:
    """RESULTS.md's `text` with the table `block` in place of the one an earlier --append-results wrote (between
    TABLE_START and TABLE_END), else appended."""
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start >= 0 and end > start:
        return text[:start] + block + text[end + len(TABLE_END) :]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write_table(out: Path, append_results: bool = False) -> dict:
    """Recompute the table from `out`'s shard files (and wallclock.json when measured); write ranking.json and .png,
    print the markdown; with append_results put it in benchmarks/RESULTS.md (`with_table`)."""
    shards = load_shards(out)
    if not shards:
        sys.exit(f"no shard files under {out}: run `python benchmarks/ranking.py --shard 0` first")
    wall_file = out / "wallclock.json"
    summary = summarise(shards, json.loads(wall_file.read_text()) if wall_file.is_file() else None)
    summary["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(out / "ranking.json", summary)
    plot(summary, out / "ranking.png")
    lines = markdown(summary)
    lines += [
        "",
        "Compute to reach: where the mean validation curve first reaches Flow-GRPO's final mean, as a "
        "fraction of the budget (0.00: the base model's validation already does; a curve starts at its own "
        "base — DiffusionNFT's validates without CFG). Ranks: a range where paired differences do not separate.",
    ]
    cpu = sum(s["cpu_seconds"] for s in shards)
    lines += ["", f"CPU time {cpu / 3600:.2f} h in all, in runs; by shard:"]
    lines += [f"- shard {s['shard']} ({s['phase']}, {len(s['runs'])} runs): {s['cpu_seconds'] / 3600:.2f} CPU-h; "
              f"{shard_machines(s)}; gathered {s['finished'][:16].replace('T', ' ')} UTC" for s in shards]  # fmt: skip
    print("\n".join(lines))
    if append_results:
        results = ROOT / "benchmarks/RESULTS.md"
        title = f"### Ranking table ({summary['date'][:10]}; `python benchmarks/ranking.py --table`)"
        figure = "![mean validation reward against compute](results/ranking/ranking.png)"
        block = "\n".join([TABLE_START, title, "", *lines, "", figure, TABLE_END])
        results.write_text(with_table(results.read_text(), block))
    return summary
