"""The GPU check's markdown summary, from its JSON record (benchmarks/gpu_check.py)."""

from __future__ import annotations

MODEL_PARTS = ("sd35_lora", "sd35_full", "flux_lora", "qwen_image_lora", "wan21_lora", "flux2_klein_lora",
               "z_image_lora", "wan22_ti2v_lora")  # fmt: skip


def _f(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value:+.0%}"


def markdown(record: dict) -> str:
    parts = record["parts"]
    device = (parts.get("device") or {}).get("result") or {}
    where = device.get("gpu") or "CPU (dry run)"
    lines = [
        f"# GPU check: {where}",
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
    fsdp = (parts.get("fsdp2") or {}).get("result")
    if fsdp:
        lines += ["", f"## FSDP2 worker at world size 1 ({fsdp['backend']}, without Ray)", "",
                  f"step {_f(fsdp['step_s'])} s, logp_diff_max {_f(fsdp['logp_diff_max'], '.3g')}."]  # fmt: skip
    return "\n".join(lines) + "\n"
