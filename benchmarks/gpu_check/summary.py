"""The GPU check's markdown summary, from its JSON record (benchmarks/gpu_check.py)."""

from __future__ import annotations

MODEL_PARTS = ("sd35_lora", "sd35_full", "flux_lora", "qwen_image_lora", "wan21_lora", "flux2_klein_lora",
               "z_image_lora", "wan22_ti2v_lora", "wan22_a14b_lora")  # fmt: skip


def _f(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value:+.0%}"


def _share(value) -> str:
    return "–" if value is None else f"{value:.0%}"


def markdown(record: dict) -> str:
    parts = record["parts"]
    device = (parts.get("device") or {}).get("result") or {}
    where = device.get("gpu") or "CPU (dry run)"
    toy = " — CPU toy shapes, no measurement: its figures only show the check runs" if record["dry_run"] else ""
    lines = [
        f"# GPU check: {where}{toy}",
        "",
        f"{record['created']}; {'dry run on the CPU with tiny shapes' if record['dry_run'] else 'real-size models'}; "
        f"torch {device.get('packages', {}).get('torch', '?')}, CUDA {device.get('torch_cuda')}, driver "
        f"{device.get('driver')}; budget {record['budget_s']:.0f} s, total {_f(record.get('total_s'), '.0f')} s.",
        "",
        "| part | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, part in parts.items():
        note = part.get("error") or part.get("reason") or ""
        lines.append(f"| {name} | {part['status']} | {_f(part.get('seconds'), '.0f')} | {note[:160]} |")
    models = {n: parts[n]["result"] for n in MODEL_PARTS if n in parts and parts[n].get("status") == "ok"}
    if models:
        lines += [
            "",
            "## One Flow-GRPO step (random weights, the ready config's settings)",
            "",
            "| run | images | step s | rollout s | update s | images/s | MFU | peak alloc GiB | peak reserved GiB "
            "| estimate GiB | memory err | estimate s | time err | efficiency fit |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in models.items():
            est = r.get("estimate") or {}
            lines.append(
                f"| {name} | {r['images_per_step']} | {_f(r['step_s'])} | {_f(r['rollout_s'])} | {_f(r['update_s'])} "
                f"| {_f(r['images_per_s'], '.3g')} | {_f(r['mfu'], '.1%')} | {_f(r['peak_allocated_gib'], '.1f')} "
                f"| {_f(r['peak_reserved_gib'], '.1f')} | {_f(est.get('peak_gib'), '.1f')} "
                f"| {_pct(r.get('estimate_memory_rel_error'))} | {_f(est.get('step_s'))} "
                f"| {_pct(r.get('estimate_time_rel_error'))} | {_f(r.get('efficiency_fit'), '.3f')} |"
            )
        lines += [
            "",
            "Estimate errors are (estimate − measured) / measured: memory against the peak reserved, time "
            "against rollout + update; the estimate without its text encoders (the check runs none).",
        ]
        skipped = {name: r["skipped_updates"] for name, r in models.items() if r.get("skipped_updates")}
        if skipped:  # a kernel returning NaN shows in no column above
            lines += ["", "**Updates skipped for a non-finite gradient** (the step's numbers do not compare): "
                      + ", ".join(f"{name} {n}" for name, n in skipped.items())]  # fmt: skip
    replay = (parts.get("replay") or {}).get("result")
    if replay:
        lines += ["", f"## Rollout replay: train/logp_diff_max ({replay['model']})", "",
                  "| precision / sde | logp_diff_max |", "|---|---|"]  # fmt: skip
        lines += [f"| {k} | {_f(v['logp_diff_max'], '.3g')} |" for k, v in replay["runs"].items()]
    comp = (parts.get("compile") or {}).get("result")
    if comp and "ratio" in comp:  # (a compile killed at its cap leaves only its step times)
        lines += ["", f"## model.compile_blocks ({comp['model']})", "",
                  f"eager {_f(comp['eager_step_s'])} s/step, compiled {_f(comp['compiled_step_s'])} s/step "
                  f"(× {_f(comp['ratio'])}); compile time {_f(comp['compile_s'], '.0f')} s."]  # fmt: skip
    attention = (parts.get("attention") or {}).get("result")
    if attention:
        lines += ["", f"## model.attention_backend ({attention['model']})", "",
                  "| backend | step s | vs sdpa | error |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {k} | {_f(v.get('step_s'))} | {_f(v.get('vs_sdpa'))} | {v.get('error', '')[:120]} |"
                  for k, v in attention["runs"].items()]  # fmt: skip
    tables = (("cudnn_ab", cudnn_ab_table), ("alloc_ab", alloc_ab_table), ("defaults_ab", defaults_ab_table),
              ("checkpoint_ab", checkpoint_ab_table), ("encoders", encoders_table),
              ("kernel_profile", kernel_profile_table))  # fmt: skip
    for name, table in tables:  # each part that has a result: its own table
        result = (parts.get(name) or {}).get("result")
        if result:
            lines += table(result)
    fsdp = (parts.get("fsdp2") or {}).get("result")
    if fsdp:
        lines += ["", f"## FSDP2 worker at world size 1 ({fsdp['backend']}, without Ray)", "",
                  f"step {_f(fsdp['step_s'])} s, logp_diff_max {_f(fsdp['logp_diff_max'], '.3g')}."]  # fmt: skip
    fsdp_compiled = (parts.get("fsdp2_compiled") or {}).get("result")
    if fsdp_compiled:
        lines += fsdp2_compiled_table(fsdp_compiled)
    syncs = (parts.get("host_syncs") or {}).get("result")
    if syncs:
        lines += ["", f"## Host synchronisations of one step ({syncs['model']}; {syncs['how']})", "",
                  f"{syncs['syncs']} in the step, {syncs['hot_path_syncs']} in the hot path; the most frequent:", "",
                  *(f"- {n} × {site}" for site, n in syncs["top_sites"])]  # fmt: skip
    return "\n".join(lines) + "\n"


def cudnn_ab_table(ab: dict) -> list[str]:
    """The cudnn_ab part's table: each model's rollout and update seconds with torch's cuDNN attention off and on."""

    def seconds(record: dict, key: str) -> str:
        return _f(record["result"].get(key)) if record.get("status") == "ok" else record.get("status", "–")

    def kernels(record: dict) -> str:
        counts = (record.get("result") or {}).get("kernels") or {}
        return ", ".join(f"{k.lower().removesuffix('_attention')} {n}" for k, n in counts.items()) or "–"

    def skipped(record: dict) -> str:
        value = (record.get("result") or {}).get("skipped_updates")
        return "–" if value is None else str(value)

    def crashed(record: dict) -> str:
        if record.get("status") == "ok":
            return "no"
        return f"{record.get('status', 'not_run')}: {record.get('error', '')[:100]}"

    lines = ["", "## torch's cuDNN attention kernel off vs on (cudnn_ab; `sdpa`, each variant its own process)", "",
             "| model | size | off: rollout s | off: update s | on: rollout s | on: update s | update on/off "
             "| kernels off / on | updates skipped off / on | cuDNN variant crashed? |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, runs in ab["runs"].items():
        off, on = runs.get("cudnn_off", {}), runs.get("cudnn_on", {})
        lines.append(
            f"| {name} | {runs['size']} | {seconds(off, 'rollout_s')} | {seconds(off, 'update_s')} "
            f"| {seconds(on, 'rollout_s')} | {seconds(on, 'update_s')} | {_f(runs.get('update_ratio'), '.3f')} "
            f"| {kernels(off)} / {kernels(on)} | {skipped(off)} / {skipped(on)} | {crashed(on)} |"
        )
    lines += ["", f"cudnn_off: {ab['variants']['cudnn_off']}; cudnn_on: {ab['variants']['cudnn_on']}; the switch: "
              f"{ab['switch']}. Kernels: torch's pick per attention call in the warm-up step. Updates skipped: for a "
              "non-finite gradient norm, in the warm-up and measured steps."]  # fmt: skip
    return lines


def alloc_ab_table(ab: dict) -> list[str]:
    """The alloc_ab part's table: peak allocated and reserved GiB and step seconds with the allocator's fixed blocks
    and with expandable segments."""

    def cells(record: dict) -> str:
        if record.get("status") != "ok":
            return f"{record.get('status', 'not_run')}: {record.get('error', '')[:80]} | | "
        r = record["result"]
        return f"{_f(r['peak_allocated_gib'])} | {_f(r['peak_reserved_gib'])} | {_f(r['step_s'])}"

    lines = ["", "## CUDA's allocator: fixed blocks vs expandable segments (alloc_ab; a process per variant)", "",
             "| model | fixed: allocated GiB | fixed: reserved GiB | fixed: step s | expandable: allocated GiB "
             "| expandable: reserved GiB | expandable: step s | reserved exp./fixed | step exp./fixed |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, runs in ab["runs"].items():
        lines.append(
            f"| {name} | {cells(runs.get('fixed_blocks', {}))} | {cells(runs.get('expandable', {}))} "
            f"| {_f(runs.get('peak_reserved_gib_ratio'), '.3f')} | {_f(runs.get('step_s_ratio'), '.3f')} |"
        )
    lines += ["", f"Effect: {ab['effect']}. Peaks of the measured (second) step; the first step's in the record."]
    return lines


def defaults_ab_table(ab: dict) -> list[str]:
    """The defaults_ab part's table: each variant's seconds, its ratios to `baseline`, replay and weights."""
    lines = ["", f"## CUDA defaults: compiled blocks and fused AdamW (defaults_ab; a process per variant; "
             f"{ab['compiler']})", "",
             "| model | variant | warm-up s | compile s | step s | rollout s | update s | step / baseline "
             "| update / baseline | logp_diff_max | weights rel. diff | skipped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += variant_rows(ab, 9, lambda name, label, r, q: (
        f"| {name} | {label} | {_f(r['warmup_step_s'])} | {_f(r['compile_s'], '.1f')} | {_f(r['step_s'])} "
        f"| {_f(r['rollout_s'])} | {_f(r['update_s'])} | {_f(q.get('step_s_ratio'), '.3f')} "
        f"| {_f(q.get('update_s_ratio'), '.3f')} | {_f(r['logp_diff_max'], '.3g')} "
        f"| {_f(q.get('weights_rel_diff'), '.2e')} | {r.get('skipped_updates')} |"))  # fmt: skip
    variants = "; ".join(f"{k}: {v}" for k, v in ab["variants"].items())
    return [*lines, "", f"Variants: {variants}. Seconds of the measured (second) step."]


def encoders_table(encoders: dict) -> list[str]:
    """The encoders part's table: the text encoders at real size, held on the device and offloaded, beside estimate."""
    lines = ["", "## Text encoders at real size (encoders; encode_prompts over one GPU's prompts of a step)", "",
             "| model | prompts | weights GiB | estimate GiB | held: encode s | offloaded: encode s | estimate s "
             "| held: working set GiB | offloaded: peak GiB |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, runs in encoders.items():
        held, offloaded, est = runs.get("held") or {}, runs.get("offloaded") or {}, runs["estimate"]
        lines.append(
            f"| {name} | {held.get('prompts', '–')} | {_f(held.get('weights_gib'))} | {_f(est['text_encoders_gib'])} "
            f"| {_f(held.get('encode_s'), '.3f')} | {_f(offloaded.get('encode_s'), '.3f')} "
            f"| {_f(est['encode_prompts_s'], '.3f')} | {_f(held.get('peak_above_before_gib'))} "
            f"| {_f(offloaded.get('peak_allocated_gib'))} |"
        )
    note = (
        "Offloaded: the encoders in host memory, copied to the device for the call (model.offload_frozen; since run "
        "11 from a pinned host copy, and nothing copied back); "
        "its seconds less the held ones are the copies `estimate` does not model."
    )
    return [*lines, "", note]


def kernel_profile_table(profiles: dict) -> list[str]:
    """The kernel_profile part's tables: each run's phases (busy and idle GPU seconds), kernel classes, top kernels."""
    lines = ["", "## Where the GPU time goes (kernel_profile; one profiled step)", "",
             "| run | phase | wall s | GPU busy s | idle s | busy |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in profiles.items():
        for phase, p in run["phases"].items():
            lines.append(f"| {name} | {phase} | {_f(p['wall_s'])} | {_f(p['busy_s'])} | {_f(p['idle_s'])} "
                         f"| {_share(p['busy_fraction'])} |")  # fmt: skip
    for name, run in profiles.items():
        if not run["top_kernels"]:
            lines += ["", f"{name}: no device kernels in the trace (a CPU has no device timeline)."]
            continue
        classes = ", ".join(f"{label} {_share(share)}" for label, share in run["class_shares"].items())
        lines += ["", f"{name}: {_f(run['device_s'])} s of kernels: {classes}.", "",
                  "| kernel | class | count | s | share |", "|---|---|---|---|---|",
                  *(f"| `{k['name'][:70]}` | {k['class']} | {k['count']} | {_f(k['s'], '.3f')} | {_share(k['share'])} |"
                    for k in run["top_kernels"][:8])]  # fmt: skip
    return lines


def failed_row(name: str, label: str, record: dict, columns: int) -> str:
    """A table row for a variant that gave no result: its status and error, then `columns` empty cells."""
    return f"| {name} | {label} | {record.get('status', 'not_run')}: {record.get('error', '')[:80]} |" + " |" * columns


def variant_rows(ab: dict, columns: int, row) -> list[str]:
    """The rows of an A/B part's table of models × variants: `row(name, label, result, its ratios)` for each variant
    that ran, `failed_row` (`columns` empty cells) for the others."""
    lines = []
    for name, runs in ab["runs"].items():
        for label, record in runs.items():
            if record.get("status") != "ok":
                lines.append(failed_row(name, label, record, columns))
                continue
            lines.append(row(name, label, record["result"], ab.get("ratios", {}).get(name, {}).get(label, {})))
    return lines


def checkpoint_ab_table(ab: dict) -> list[str]:
    """The checkpoint_ab part's table: each variant's checkpointed blocks, seconds, peak memory and ratios to `true`."""
    lines = ["", "## Selective gradient checkpointing: every block, auto's count, half (checkpoint_ab; a process per "
             "variant)", "",
             "| model | variant | checkpointed / blocks | step s | rollout s | update s | peak alloc GiB "
             "| peak reserved GiB | estimate GiB | step / true | update / true | reserved / true | logp_diff_max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += variant_rows(ab, 10, lambda name, label, r, q: (
        f"| {name} | {label} | {r['checkpointed_blocks']} / {r['blocks']} | {_f(r['step_s'])} | {_f(r['rollout_s'])} "
        f"| {_f(r['update_s'])} | {_f(r['peak_allocated_gib'], '.1f')} | {_f(r['peak_reserved_gib'], '.1f')} "
        f"| {_f(r['estimate_peak_gib'], '.1f')} | {_f(q.get('step_s_ratio'), '.3f')} "
        f"| {_f(q.get('update_s_ratio'), '.3f')} | {_f(q.get('peak_reserved_gib_ratio'), '.3f')} "
        f"| {_f(r['logp_diff_max'], '.3g')} |"))  # fmt: skip
    said = [f"- {name}: {record['result']['says']}" for name, runs in ab["runs"].items()
            for record in runs.values() if "says" in (record.get("result") or {})]  # fmt: skip
    variants = "; ".join(f"{k}: {v}" for k, v in ab["variants"].items())
    note = "Seconds and peaks of the measured (second) step; the estimate without its text encoders (none here)."
    return [*lines, "", f"Variants: {variants}. {note}", *([""] + said if said else [])]


def fsdp2_compiled_table(ab: dict) -> list[str]:
    """The fsdp2_compiled part's table: the FSDP2 worker's step eager and with compiled blocks."""
    lines = ["", f"## FSDP2 worker at world size 1, eager vs compiled blocks (fsdp2_compiled; a process per variant; "
             f"{ab['compiler']})", "",
             "| model | variant | warm-up s | compile s | step s | rollout s | update s | peak reserved GiB "
             "| logp_diff_max |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, record in ab["runs"].items():
        if record.get("status") != "ok":
            lines.append(failed_row("sd35_lora", label, record, 6))
            continue
        r = record["result"]
        lines.append(f"| sd35_lora | {label} | {_f(r['warmup_step_s'])} | {_f(r['compile_s'], '.1f')} "
                     f"| {_f(r['step_s'])} | {_f(r['rollout_s'])} | {_f(r['update_s'])} "
                     f"| {_f(r['peak_reserved_gib'], '.1f')} | {_f(r['logp_diff_max'], '.3g')} |")  # fmt: skip
    q = ab.get("ratios") or {}
    return [*lines, "", f"Compiled / eager: step {_f(q.get('step_s_ratio'), '.3f')}, update "
            f"{_f(q.get('update_s_ratio'), '.3f')}; {ab['runs'].get('eager', {}).get('result', {}).get('model', '')}; "
            "seconds of the measured (second) step, peaks over both."]  # fmt: skip
