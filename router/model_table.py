"""The models one router serves, by the id clients send: each a Frontend (tokenizer, chat
template, its scheduler replicas) with its ModelKind. A request is answered by its model's
Frontend; with one model a request may leave `model` out, as before."""
from __future__ import annotations

from typing import Iterator

from router.frontend import Frontend, FrontendError
from shared.served_models import ServedModel


class ModelTable:
    def __init__(self, frontends: list[Frontend]):
        if not frontends:
            raise ValueError("a router serves at least one model")
        self.frontends = frontends
        self.by_id = {f.served_model_name: f for f in frontends}

    @classmethod
    def open(cls, models: list[ServedModel], schedulers: dict[str | None, list[str]], **options) -> "ModelTable":
        """A Frontend per model; `schedulers` maps a model's id (None: the only model's) to its replicas."""
        return cls([Frontend(m.ref, schedulers.get(m.name) or schedulers.get(None), m.name, **options)
                    for m in models])

    def __iter__(self) -> Iterator[Frontend]:
        return iter(self.frontends)

    def __len__(self) -> int:
        return len(self.frontends)

    @property
    def default(self) -> Frontend:
        return self.frontends[0]

    @property
    def ids(self) -> list[str]:
        return list(self.by_id)

    def get(self, model: str | None) -> Frontend:
        """The Frontend of a request's `model`; 404 (model_not_found) listing the ids when there is
        none of that id, or when several models are served and the request names none."""
        if len(self.frontends) == 1:
            self.default.check_model(model)
            return self.default
        found = self.by_id.get(model) if model else None
        if found is None:
            served = ", ".join(f"'{i}'" for i in self.by_id)
            what = f"the model '{model}' does not exist here" if model else "the request names no model"
            raise FrontendError(f"{what}; this server serves {served}: send one of them as `model`", 404,
                                code="model_not_found", param="model")
        return found

    async def close(self) -> None:
        for f in self.frontends:
            await f.close()
