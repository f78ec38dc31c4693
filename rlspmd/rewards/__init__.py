"""Rewards: rule functions selected by ``data_source``, or one user function for every sample."""

from rlspmd.rewards.manager import RewardError, RewardManager, load_function

__all__ = ["RewardError", "RewardManager", "load_function"]
