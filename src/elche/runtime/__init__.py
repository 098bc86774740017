"""The IO shell around ``elche.core``: sockets, processes, torch.

``elche.core`` decides; this package moves bytes and runs models. Modules:

- ``transport`` — the control plane: authenticated ZeroMQ frames between the
  coordinator (ROUTER) and the ranks (DEALER). Never imports torch, so the
  coordinator process starts in well under a second (design §4).
- ``frames`` — the envelope those frames travel in (version, sequence number,
  HMAC tag, frame limits, the run's secret): pure, no sockets.
- ``groups`` — the TCP store the coordinator process serves, through which
  the ranks' collective groups form and re-form (no files: hosts share none).
- ``addresses`` — which address the coordinator binds and advertises across
  hosts (``ELCHE_ADVERTISE``, ``ELCHE_BIND``).
- ``plan`` — what the launch paths (``solo``, ``launch``, ``launched``) share
  with ``elche.train``: ``Plan``, ``Hooks``, ``TrainResult``. Imports point
  one way: nothing here imports the API module, the CLI, the benchmarks or
  the simulator (an import-linter contract).

Only this package imports ``zmq`` and ``torch``; the layering test keeps
``elche.core`` and ``elche.sim`` out of it.
"""
