"""Test-only hook, imported at start-up by Python processes whose PYTHONPATH starts with tests/hooks.

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
