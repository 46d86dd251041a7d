"""What `serve` and the router are told about the models they serve: `--model [NAME=]MODEL`
(repeatable) and the router's `--scheduler [NAME=]HOST:PORT[,HOST:PORT...]` (one entry per model,
several addresses being that model's replicas)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.option_kinds import Address, Kind


@dataclass(frozen=True)
class ServedModel:
    name: str          # the id clients send and /v1/models lists
    ref: str           # a bundled model's name or a GGUF path


def _is_model(text: str) -> bool:
    from shared.model_registry import BUNDLED
    return text in BUNDLED or Path(text).expanduser().is_file()


def served_model(entry: str, served_model_name: str | None = None) -> ServedModel:
    """`MODEL` or `NAME=MODEL` (a model whose own name holds '=' is taken whole)."""
    from shared.model_registry import model_name
    if not _is_model(entry) and "=" in entry:
        name, ref = entry.split("=", 1)
        return ServedModel(name.strip(), ref.strip())
    return ServedModel(served_model_name or model_name(entry), entry)


def served_models(entries: tuple[str, ...], served_model_name: str | None = None) -> list[ServedModel]:
    """The models in order; --served-model-name names the only one (several are named NAME=MODEL)."""
    return [served_model(e, served_model_name if len(entries) == 1 else None) for e in entries]


class ModelEntry(Kind):
    """`MODEL` or `NAME=MODEL`, MODEL a bundled model or a GGUF path (opened at start, not here)."""
    metavar = "[NAME=]MODEL"

    def __init__(self) -> None:
        from shared.model_registry import BUNDLED
        self.accepted = (f"a bundled model ({', '.join(BUNDLED)}) or the path of a GGUF file, optionally "
                         "named NAME=MODEL")

    def parse(self, text: str) -> str:
        text = text.strip()
        ref = served_model(text).ref
        if not _is_model(ref):
            raise ValueError(f"{ref!r} is neither a bundled model nor an existing file")
        return text


def scheduler_group(entry: str) -> tuple[str | None, list[str]]:
    """`[NAME=]HOST:PORT[,HOST:PORT...]` -> (the model's name or None, its replicas' addresses)."""
    name, sep, addresses = entry.rpartition("=")
    return (name.strip() if sep else None), [a.strip() for a in addresses.split(",") if a.strip()]


class SchedulerGroup(Kind):
    """One model's scheduler replicas."""
    metavar = "[MODEL=]HOST:PORT[,...]"
    accepted = ("host:port, a comma list of them (one model's replicas), optionally named by the model "
                "they serve: MODEL=host:port,host:port")

    def parse(self, text: str) -> str:
        _, addresses = scheduler_group(text)
        if not addresses:
            raise ValueError(f"{text!r} names no address")
        for a in addresses:
            Address().parse(a)
        return text.strip()
