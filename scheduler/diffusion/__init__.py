"""Text diffusion in the scheduler: each request's block schedule (schedule.py, request.py) and the
batcher that packs every running canvas into one step (batcher.py)."""
from scheduler.diffusion.batcher import DiffusionBatcher
from scheduler.diffusion.request import DiffusionRequest
from scheduler.diffusion.schedule import BlockSchedule

__all__ = ["BlockSchedule", "DiffusionBatcher", "DiffusionRequest"]
