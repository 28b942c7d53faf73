"""A session: the run's configuration (`RunConfig` and its sections), presets, the command-line
flags generated from the config, user modules (``--import``), bad-input reporting, and
`Session`, a loaded model with the decoders a run (a benchmark, the Python API) decodes with."""
