"""ourobatch.rollout: continuous RL collection on an Engine or an EnginePool (docs/rollout.md).

Torch-free: it drives the engine through its public calls only."""

from .collector import Collector
from .types import Batch, Group, Sample, keep_varied_rewards

__all__ = ["Batch", "Collector", "Group", "Sample", "keep_varied_rewards"]
