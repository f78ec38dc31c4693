"""rlspmd: multi-controller SPMD reinforcement-learning post-training for LLMs (README.md, docs/)."""

import importlib.abc
import sys


class _NoSklearnForHFGeneration(importlib.abc.MetaPathFinder):
    """Where scikit-learn is installed (mlflow brings it), ``transformers.generation`` imports it, and scipy with it,
    for one function: assisted decoding's confidence-threshold tuning, which rlspmd never runs. That is 1-2 s of every
    rank's start on a CPU core. Just before that module is first imported, transformers is told scikit-learn is
    absent (``transformers.utils.is_sklearn_available``, for this process); scikit-learn itself stays importable."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformers.generation.candidate_generator":
            sys.meta_path.remove(self)
            utils = sys.modules.get("transformers.utils")
            if utils is not None and hasattr(utils, "is_sklearn_available"):
                utils.is_sklearn_available = lambda: False
        return None  # the usual finders load the module


if "transformers.generation.candidate_generator" not in sys.modules:
    sys.meta_path.insert(0, _NoSklearnForHFGeneration())
