"""`diffusion-rl report RUN_DIR`: plots and report.md from a run's metrics.jsonl (no tracker server needed)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="plots (reward, validation, KL/clip fraction, timing) and report.md from a run's metrics.jsonl",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    p.set_defaults(fn=cmd_report)


def cmd_report(args) -> None:
    from diffusion_rl.evaluation.report import write_report

    path = write_report(args.run_dir, args.out)  # report.md, beside it report.html and the plots
    logger.info("wrote %s (one page: open it in a browser), %s and its plots", path.with_name("report.html"), path)
