"""Results: the records a run and a benchmark write, the metrics the papers report and the
results table, plots, and the interleaved comparison protocol that produces the records."""
