"""Rewards: rule functions selected by ``data_source``, or one user function for every sample.

Imported lazily (PEP 562): a reward worker process imports ``rlspmd.rewards.worker`` without pulling in torch.
"""

__all__ = ["RewardError", "RewardManager", "load_function"]


def __getattr__(name: str):
    if name in ("RewardError", "RewardManager"):
        from rlspmd.rewards import manager

        return getattr(manager, name)
    if name == "load_function":
        from rlspmd.rewards.functions import load_function

        return load_function
    raise AttributeError(f"module 'rlspmd.rewards' has no attribute {name!r}")
