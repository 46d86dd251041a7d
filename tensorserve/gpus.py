"""`tensorserve serve --gpus all|0,1`: which GPUs get a worker, one scheduler+worker group (replica)
per GPU behind the router. Splitting one model's layers across the GPUs (pipeline parallelism) is
not implemented yet: each GPU holds the whole model."""
from __future__ import annotations

from shared.option_kinds import Kind
from worker.devices import GPU, NEEDS, Detection
from worker.placement import BackendUnavailable

GPUS_HELP = ("serve on these GPUs (nvidia-smi's indices, or all): one scheduler+worker replica per GPU, each "
             "holding the whole model, behind the router (as --replicas); needs a GPU and CuPy "
             "(pip install 'tensorserve[cuda]'). Splitting a model's layers across GPUs is not implemented yet")


class GpuList(Kind):
    """`all`, or distinct GPU indices separated by commas; the value is kept as normalized text."""
    accepted = "all, or GPU indices (nvidia-smi's numbering) separated by commas, e.g. 0,1"
    metavar = "all|0,1"

    def parse(self, text: str) -> str:
        text = text.strip().lower()
        if text == "all":
            return text
        try:
            indices = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"{text!r} is neither all nor a list of GPU indices") from None
        if any(i < 0 for i in indices):
            raise ValueError(f"{text!r} names a negative GPU index")
        if len(set(indices)) != len(indices):
            raise ValueError(f"{text!r} names a GPU twice")
        return ",".join(map(str, indices))


    def from_yaml(self, value) -> str:
        if isinstance(value, list):             # gpus: [0, 1]
            value = ",".join(str(v) for v in value)
        return super().from_yaml(value)


def parse_gpus(spec: str) -> list[int] | None:
    """The indices a normalized --gpus value names (None: all)."""
    return None if spec == "all" else [int(i) for i in spec.split(",")]


def select_gpus(spec: str, detection: Detection) -> list[GPU]:
    """The detected GPUs that --gpus `spec` names; BackendUnavailable naming what was found when
    there is none, or one named is missing."""
    if not detection.gpus:
        raise BackendUnavailable(f"found {detection.describe()}; {NEEDS}")
    wanted = parse_gpus(spec)
    if wanted is None:
        return list(detection.gpus)
    missing = [i for i in wanted if detection.by_index(i) is None]
    if missing:
        raise BackendUnavailable(f"no GPU {', '.join(map(str, missing))}: found {detection.describe()}")
    return [detection.by_index(i) for i in wanted]
