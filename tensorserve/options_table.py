"""The README's options table, generated from the configurations (router, scheduler, worker,
serve): `python -m tensorserve.options_table` rewrites it between the README's markers;
tests/test_config.py fails when the README and the configurations disagree."""
from __future__ import annotations

import sys
from pathlib import Path

from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from shared.options import Option, options_of
from tensorserve.serve import ServeOptions
from worker.config import WorkerConfig

BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"
README = Path(__file__).resolve().parents[1] / "README.md"
PROCESSES = (("router", RouterConfig), ("scheduler", SchedulerConfig), ("worker", WorkerConfig),
             ("serve", ServeOptions))


def _row(opt: Option, users: list[str]) -> str:
    flags = ", ".join(f"`{f}`" for f in opt.flags)
    default = "unset" if opt.default is None else f"`{opt.shown(opt.default)}`"
    where = ", ".join(users) + (" (set by `serve`)" if opt.spec.internal else "")
    text = opt.spec.help.replace("|", "\\|")
    return f"| {flags} | `{opt.env[0]}` | {default} | {where} | {text} |"


def markdown() -> str:
    rows: dict[int, tuple[Option, list[str]]] = {}
    for process, cls in PROCESSES:
        for opt in options_of(cls):
            rows.setdefault(id(opt.spec), (opt, []))[1].append(process)
    lines = ["Every option not marked *set by `serve`* is also an option of `tensorserve serve`, which hands it "
             "to the process that uses it.", "",
             "| flag | variable | default | process | what it does |", "|---|---|---|---|---|"]
    lines += [_row(opt, users) for opt, users in rows.values()]
    return "\n".join(lines)


def readme_with_table(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + markdown() + "\n" + text[end:]


def main() -> int:
    text = README.read_text()
    README.write_text(readme_with_table(text))
    print(f"wrote the options table into {README}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
