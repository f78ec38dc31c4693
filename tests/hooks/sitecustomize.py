"""Test-only hooks, imported at start-up by Python processes whose PYTHONPATH starts with tests/hooks.

``RLSPMD_TEST_SLOW_SAVE=<fragment>:<seconds>``: DCP's ``FileSystemWriter.finish`` (rank 0 writes
``.metadata``, the last DCP file, after every rank has written its shards) first sleeps for checkpoints whose
path contains ``fragment``. A test can then SIGKILL the job while a save is half done, deterministically.
rlspmd itself never imports this.
"""

import os

_spec = os.environ.get("RLSPMD_TEST_SLOW_SAVE")
if _spec:
    import time

    from torch.distributed.checkpoint import filesystem

    _fragment, _seconds = _spec.rsplit(":", 1)
    _finish = filesystem.FileSystemWriter.finish

    def _slow_finish(self, metadata, results):
        if _fragment in str(self.path):
            time.sleep(float(_seconds))
        return _finish(self, metadata, results)

    filesystem.FileSystemWriter.finish = _slow_finish

_dump = os.environ.get("RLSPMD_TEST_DUMP_UPDATES")
if _dump:
    # ``RLSPMD_TEST_DUMP_UPDATES=<dir>``: every actor update saves the batch it trains on (this rank's rows, on CPU) to
    # ``<dir>/rank<R>_update<k>.pt`` (k counts from 1: the step, without critic warm-up), so a test can compare what
    # the run logged with what the loss saw.
    import torch

    from rlspmd.roles.policy import Policy

    _update, _calls = Policy.update, [0]

    def _dumping_update(self, batch, metrics):
        _calls[0] += 1
        torch.save(
            {"tensors": {k: v.cpu() for k, v in batch.tensors.items()}, "objects": batch.objects},
            os.path.join(_dump, f"rank{os.environ.get('RANK', '0')}_update{_calls[0]}.pt"),
        )
        return _update(self, batch, metrics)

    Policy.update = _dumping_update
