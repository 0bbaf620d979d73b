"""torch.compile with piecewise CUDA graphs (DESIGN.md, "The one idea", layer 2).

  split.py       cut Dynamo's FX graph at the attention op; structural key of a piece
  backend.py     the Dynamo backend: split, fake-run for the pieces' inputs, Inductor per piece,
                 one artifact per distinct piece, counters, dump_graph()
  piecewise.py   CompiledForward: runner.forward_fn of the compiled modes (one trace, T symbolic)
  cuda_graph.py  GraphPool (one memory pool, capture stream, phase) and GraphedPiece (a graph per
                 token bucket per piece, replayed without input copies)
  replay_program.py  a captured bucket's forward as a flat list of graph replays and attention
                 launches, recorded from its first forward (skips Dynamo and the split module)
  full_graph.py  FullDecodeGraphs: one graph of the whole forward per decode batch bucket
  cache.py       the on-disk compile cache (Inductor's FX graph cache in a verified, private dir)
  setup.py       setup_compiled_modes(runner, progress): wires the modes into a ModelRunner
"""
