"""What the router adds for a text-diffusion model's requests: the checks of its settings before
anything reaches a scheduler, and the canvas text streamed after each denoising step."""
from __future__ import annotations

from protos.tensorserve.v1 import common_pb2
from router.requests import FrontendError
from shared.sampling_params import SamplingParams


def check_diffusion(frontend, options: common_pb2.DiffusionOptions | None, params: SamplingParams) -> None:
    """Diffusion options only for a diffusion model, which has no logprobs."""
    if options is not None and not frontend.is_diffusion:
        raise FrontendError(f"diffusion options were given, but '{frontend.served_model_name}' is an "
                            "autoregressive model: leave 'diffusion' out", 400, code="invalid_value",
                            param="diffusion")
    if frontend.is_diffusion and params.logprobs is not None:
        raise FrontendError(f"'{frontend.served_model_name}' is a text-diffusion model, which returns no "
                            "logprobs: leave logprobs unset", 400, code="unsupported_value", param="logprobs")


def canvas_text(frontend, ids) -> str:
    """The canvas with every masked position shown as the mask token's text."""
    mask, parts, run = frontend.mask_token_id, [], []
    for t in ids:
        if t == mask:
            if run:
                parts.append(frontend.tokenizer.decode(run))
                run = []
            parts.append(frontend.token_str(mask))
        else:
            run.append(t)
    if run:
        parts.append(frontend.tokenizer.decode(run))
    return "".join(parts)
