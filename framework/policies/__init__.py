"""Cross-cutting policies that strategies compose: the draft gate, the work budget and the
Bayesian optimisation of skip sets."""
