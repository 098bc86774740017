"""Small, offline training workloads for elche's demo, tests and benchmarks.

A workload is a module of plain top-level functions (picklable for the
``spawn`` start method), so every system under comparison — elche's modes and
the torch DDP baseline — trains exactly the same model on exactly the same
data:

- ``load_<name>_split(seed=...)`` → ``(train, test)`` datasets;
- ``make_model(device)`` → the model, with identical initial weights on every
  rank;
- ``make_optimizer(params)`` → the optimizer;
- ``step_fn(model, batch)`` → the loss to backpropagate;
- ``eval_fn(model, dataset)`` → a score in [0, 1].

Modules:

- ``digits`` — scikit-learn's 8×8 handwritten digits (1,797 images, shipped
  with scikit-learn, no download) and a small MLP.
"""
