"""The engine's execution, one question per file.

- `spec`: what one forward computes (`ForwardSpec`) and the key of its whole graph (`GraphKey`);
- `route`: which way a forward runs (`choose_route`, every eligibility rule named in one place);
- `blocks`: the block loop, written once, with the route supplying attention and MLP;
- `pool`: the KV pool that CUDA graphs write into, and its lease to one cache at a time;
- `store`: the graph store: recording, bounding (least recently used first) and the span policy,
  once for branch graphs, whole forwards and device work;
- `branches`: one graph per attention or MLP branch;
- `forward_graph`: one graph per whole forward;
- `work`: strategies' device work, keyed, randomised and run by the engine;
- `executor`: runs a forward by its route and counts the work done.
"""
