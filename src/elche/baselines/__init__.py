"""The systems elche is measured against, run side by side on the same rig.

Every performance claim is a ratio against one of these, on the same
workload, with the same speed injection (``elche.runtime.pacing``).

Modules:

- ``ddp`` — torch ``DistributedDataParallel`` on gloo, one spawned process
  per rank (``run_ddp``; ``python -m elche.baselines.ddp``);
- ``torchft_peers`` — torchft's ``LocalSGD`` and ``DiLoCo`` under the same
  rules, its lighthouse in the calling process (``run_torchft``; needs
  ``elche[peers]``).
"""
