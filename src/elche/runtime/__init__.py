"""The IO shell around ``elche.core``: sockets, processes, torch.

``elche.core`` decides; this package moves bytes and runs models. Modules:

- ``transport`` — the control plane: authenticated ZeroMQ frames between the
  coordinator (ROUTER) and the ranks (DEALER). Never imports torch, so the
  coordinator process starts in well under a second (design §4).

Only this package imports ``zmq`` and ``torch``; the layering test keeps
``elche.core`` and ``elche.sim`` out of it.
"""
