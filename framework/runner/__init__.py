"""The experiment runner: the command line (``run.py``), the PyTorch Lightning predict loop, and
tracking (W&B, CSV, the run's plots). It composes the session (`framework.session`), the data
(`framework.data`), the models (`framework.models`) and the results (`framework.results`)."""
