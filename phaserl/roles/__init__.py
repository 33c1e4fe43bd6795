"""The roles of HybridFlow, with verl's names: actor, critic, reference policy, reward model."""
from .actor import HybridActor
from .critic import Critic
from .reference import ReferencePolicy
from .reward_model import RewardModelWrapper

__all__ = ["HybridActor", "Critic", "ReferencePolicy", "RewardModelWrapper"]
