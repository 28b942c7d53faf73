"""What searching selectors use: Gaussian-process Bayesian optimisation over binary vectors
(BoTorch / GPyTorch) and the wall-time budget of a selector's own optimisation work."""
